"""The policy in force (DESIGN §9: invariants are floors): recorded on the `_policy` chain when it
changed, and a quorum allowed only under the constitution edit that permits it, judged on that
edit's verified chain.
"""

from __future__ import annotations

from typing import Any

import msgspec
import structlog

from improved.client.chain_writer import decode_trailer
from improved.core import audit, policy, propose
from improved.core.audit import Draft
from improved.core.policy import Policy
from improved.protocol import subjects as S
from improved.protocol.model import Trailer
from improved.runtime.clock import now_ms
from improved.runtime.store import Store
from improved.runtime.trusting import TrustInForce

log = structlog.get_logger("improved.engine")


class PolicyInForce:
    """The configured policy, as its chain records it and as the quorum's amendment allows."""

    def __init__(self, store: Store, trust: TrustInForce, policy: Policy, actor: str):
        self.store = store
        self.trust = trust
        self.policy = policy
        self.actor = actor

    async def amendment_problem(self) -> str | None:
        """With `quorum` on: why the named constitution edit does not permit it, judged on the
        record replayed from its verified chain (never a retained record); else None."""
        pid = self.policy.quorum_amendment
        if not self.policy.quorum or pid is None:
            return None
        svc = await self.store.service_of(pid)
        chain = await self.store.read_chain(svc, pid) if svc else []
        record = None
        if chain:
            broken = audit.verify_chain(pid, [body for _, body in chain], self.trust.chain_trust,
                                        [seq for seq, _ in chain])
            if broken is not None:
                return f"the chain of {pid} does not verify: {broken}"
            try:
                record = propose.rebuild_record([decode_trailer(b) for _, b in chain],
                                                [seq for seq, _ in chain], self.policy)
            except (ValueError, KeyError, msgspec.MsgspecError) as exc:
                return f"the chain of {pid} cannot be replayed: {exc}"
            if record.service != svc:
                return f"the chain of {pid} is filed under {svc}, not {record.service}"
        return policy.amendment_problem(pid, record)

    async def record_policy(self) -> Trailer | None:
        """Append the effective policy to the `_policy` chain when its digest differs from the
        last one recorded; the appended trailer, or None when it was already in force."""
        digest = policy.digest(self.policy)

        def next_draft(chain: list[tuple[int, dict[str, Any]]], now: int) -> Draft | None:
            if policy.recorded_digest(chain[-1][1] if chain else None) == digest:
                return None
            return policy.draft(self.policy, self.actor)

        trailer = await self.store.append_sealed(
            S.policy_audit(policy.POLICY_ID), policy.POLICY_ID, "L0", "operation", next_draft,
            clock=now_ms)
        if trailer is not None:  # a start's normal business: the chain keeps every change
            log.info("policy recorded on the policy chain", digest=digest,
                     differs=sorted(policy.differences(self.policy)))
        return trailer
