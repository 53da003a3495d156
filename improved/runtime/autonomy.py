"""The autonomy chain (constitution IV.5, IV.6, V.4): the circuit breaker that pauses autonomous
applies after too many rollbacks, the autonomy switch the configuration sets, and the crisis a
broken log opens, which only an operator's signed act resolves.

Every pass reads this chain's state before it decides (`state`, at most once a second), so a
head no trusted daemon wrote, or an audit stream that no longer keeps what the last checkpoint
covered, reads as a crisis at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from improved.client import anchor as anchor_file
from improved.client import archive
from improved.core import audit, authority, breaker
from improved.core import checkpoint as checkpoints
from improved.core.audit import Draft
from improved.core.authority import Act
from improved.core.merkle import merkle_root
from improved.core.policy import Policy
from improved.core.record import ProposalRecord
from improved.core.signing import PAYLOAD_TYPES, ActRefused
from improved.protocol import subjects as S
from improved.protocol.model import CrisisAct, Envelope, ObserverType
from improved.runtime import anchor as anchor_write
from improved.runtime.clock import now_ms
from improved.runtime.metrics import Metrics
from improved.runtime.store import Store
from improved.runtime.trusting import TrustInForce, recorded_act

log = structlog.get_logger("improved.engine")

AUTONOMY_TTL_MS = 1000  # how stale this process's view of the breaker may be


class AutonomyChain:
    """This process's view of the autonomy chain, and every append to it."""

    def __init__(self, store: Store, trust: TrustInForce, policy: Policy, actor: str,
                 data_dir: Path, metrics: Metrics):
        self.store = store
        self.trust = trust
        self.policy = policy
        self.actor = actor
        self.data_dir = data_dir
        self.metrics = metrics
        self._autonomy: tuple[breaker.Autonomy, int] | None = None
        self._autonomy_verified = True  # whether that state's trailer verified
        # the anchor of the last checkpoint this process signed, and the daemon keys whose
        # seals count: what the O(1) look at the audit stream before each decision compares
        # with (`_retention_problem`)
        self._retained: tuple[checkpoints.Anchor, set[str], int] | None = None
        self._recording_loss = False
        # the read when the view is stale: the passes that find it stale meanwhile wait for
        # it rather than each reading (and verifying) the same head again
        self._reading = asyncio.Lock()

    def keep(self, anchor: checkpoints.Anchor, trusted: set[str], removable: int) -> None:
        """What the checkpoint just signed covered: from now on, every read of the state
        first checks that the audit stream still holds it (`_retention_problem`)."""
        self._retained = (anchor, trusted, removable)

    def forget(self) -> None:
        """Read the chain afresh at the next `state`, however recent the last read."""
        self._autonomy = None

    async def state(self, now: int) -> breaker.Autonomy:
        """The autonomy chain's current state, read at most once a second, as every pass reads
        it before it decides. A head no trusted daemon wrote (or a resolution no operator
        signed) is not believed: it reads as a crisis, which the next checkpoint records. So
        does an audit stream that forgot what the last checkpoint covered or that no longer
        keeps every trailer (`_retention_problem`, O(1)): the crisis is recorded at once."""
        if self._autonomy is None or now - self._autonomy[1] > AUTONOMY_TTL_MS:
            lost = None
            async with self._reading:  # one read at a time; the passes behind it take it
                if self._autonomy is None or now - self._autonomy[1] > AUTONOMY_TTL_MS:
                    lost = await self._read(now)
            if lost is not None and not self._recording_loss:
                self._recording_loss = True
                try:
                    await self.chain_broken(lost)
                finally:
                    self._recording_loss = False
        assert self._autonomy is not None
        return self._autonomy[0]

    async def _read(self, now: int) -> str | None:
        """Read the chain's head and the audit stream's retention, and keep what they say;
        what the stream lost, if it did."""
        seq, body = await self.store.chain_head(S.autonomy_audit(breaker.AUTONOMY_ID))
        problem = self.trust.chain_trust.problem(
            body, breaker.AUTONOMY_ID, seq, self.trust.chain_trust.start()) if body else None
        if problem:
            log.error("the autonomy chain's head does not verify; applies refused",
                      stream_seq=seq, problem=problem)
        state = breaker.believed(body, seq, problem)
        lost = await self._retention_problem()
        if lost is not None:
            state = breaker.in_crisis(state, state.crisis or f"crisis-{now_ms()}")
        self._autonomy = (state, now_ms())  # when it was read, whatever `now` asked for
        self._autonomy_verified = not problem and lost is None
        self._show(state, now)
        return lost

    async def _retention_problem(self) -> str | None:
        """In O(1), whether the audit stream still holds everything the last checkpoint this
        process signed covered, and keeps every trailer from now on (no limit, no deletes):
        a decision relies on the log not forgetting — a chain that is gone reads as a proposal
        never seen, an autonomy chain that is gone as no crisis — and on an open bus anyone may
        set a limit and take it back between two checkpoints. None when it holds, or before
        this process's first checkpoint."""
        if self._retained is None:
            return None
        kept, trusted, removable = self._retained
        view, changed = await self.store.audit_retention()
        if changed:
            return (f"the audit stream no longer keeps every trailer: its {', '.join(changed)} "
                    "differ from the loop's")
        found = checkpoints.prefix_problem(kept, view, kept.last_hash, removable=removable)
        if found is not None:  # an epoch sealed and removed since allows what it removed
            seal, _ = await archive.last_seal(self.store, trusted)
            found = checkpoints.prefix_problem(kept, view, kept.last_hash,
                                               removable=seal.removable if seal else 0)
        return found

    async def append(self, change: Callable[[breaker.Autonomy], breaker.Autonomy],
                               verdict: breaker.AutonomyVerdict, actor: str,
                               observer: ObserverType,
                               reason: str, marks: breaker.Marks | None = None,
                               envelope: Envelope | None = None) -> breaker.Autonomy:
        """Append the next state (`change(state)`) to the autonomy chain, retrying on a race."""
        states: list[breaker.Autonomy] = []

        def next_draft(chain: list[tuple[int, dict[str, Any]]], now: int) -> Draft:
            states.append(change(breaker.from_trailer(chain[-1][1] if chain else None)))
            return breaker.draft(states[-1], verdict, actor, observer, reason, marks, envelope)

        trailer = await self.store.append_sealed(
            S.autonomy_audit(breaker.AUTONOMY_ID), breaker.AUTONOMY_ID, "L0", "operation",
            next_draft, clock=now_ms)
        assert trailer is not None  # next_draft always has a draft
        self._autonomy = (states[-1], trailer.at)
        self._show(states[-1], trailer.at)
        return states[-1]

    def _show(self, state: breaker.Autonomy, now: int) -> None:
        """The metrics of the state just read or appended: what holds applies back, the
        breaker and the crisis (an operator's dashboard and alerts read them)."""
        p = self.policy
        self.metrics.set_autonomy(state.blocks(now) or "on")
        self.metrics.set_breaker(state.paused_until,
                                 state.rollbacks_within(now, p.breaker_window_days),
                                 p.breaker_threshold)
        self.metrics.set_crisis(bool(state.crisis))

    async def count_autonomous_rollback(self, record: ProposalRecord, at: int) -> None:
        p = self.policy
        state = await self.append(
            lambda s: breaker.after_rollback(s, at, p.breaker_threshold, p.breaker_window_days,
                                             p.breaker_pause_hours),
            "rollback", record.rollback_by or self.actor, "rec:system",
            f"autonomous apply {record.proposal_id} rolled back",
            breaker.Marks(proposal=record.proposal_id))
        if state.blocks(at) == "circuit_open":
            log.warning("circuit breaker open: autonomous applies paused",
                        until=state.paused_until, rollbacks=len(state.rollbacks))

    async def sync_switch(self) -> breaker.Autonomy:
        """Record the configured autonomy switch on the chain when it differs from it."""
        current = await self.state(now_ms() + AUTONOMY_TTL_MS + 1)
        wanted = self.policy.autonomy
        if current.switch == wanted:
            return current
        log.warning("autonomy switched by configuration", autonomy=wanted)
        return await self.append(
            lambda s: breaker.switched(s, wanted),
            "autonomy_on" if wanted == "on" else "autonomy_off", self.actor,
            "rec:system", f"autonomy switched {wanted} in the configuration")

    # -- crisis (constitution V.4) ---------------------------------------------------------------

    async def chain_broken(self, problem: str) -> None:
        """A chain about to be decided on does not verify: open a crisis (applies refused)."""
        path = anchor_file.path_in(self.data_dir)
        try:
            kept = anchor_file.read(path)
        except ValueError:
            kept = None
        view = checkpoints.StreamView(kept.stream_created if kept else None)
        await self.crisis([problem], kept.crisis if kept else "", kept, view, path, now_ms())

    async def crisis(self, problems: list[str], crisis: str, kept: checkpoints.Anchor | None,
                      view: checkpoints.StreamView, path: Path, now: int) -> None:
        """Open a crisis (or keep the open one) on the autonomy chain and in the data
        directory: the file first, so a crisis survives even if the chain append fails."""
        state = await self.state(now + AUTONOMY_TTL_MS + 1)
        crisis = crisis or state.crisis or f"crisis-{now}"
        baseline = kept or checkpoints.Anchor(view.created or "", 0, 0, merkle_root([]),
                                             "", now)
        if baseline.crisis != crisis:
            anchor_write.write(path, dataclasses.replace(baseline, crisis=crisis))
        if state.crisis == crisis and self._autonomy_verified:
            return
        problem = "; ".join(problems)
        log.error("audit log broken: entering crisis, applies refused", crisis=crisis,
                  problem=problem)
        await self.append(lambda s: breaker.in_crisis(s, crisis), "crisis",
                                    self.actor, "rec:system", f"{crisis}: {problem}"[:500])

    @recorded_act
    async def resolve_crisis(self, env: Envelope, act: Act) -> bool:
        """An operator's signed act clears the crisis it names; anything else is refused."""
        try:
            verified, cmd = authority.check_signed(
                self.trust.operators, env, PAYLOAD_TYPES["crisis"], CrisisAct, now_ms(),
                self.trust.max_act_age_ms)
        except ActRefused as refused:
            log.warning("crisis resolution refused", code=refused.code, reason=refused.reason)
            return False
        current = await self.state(now_ms() + AUTONOMY_TTL_MS + 1)
        if not current.crisis or current.crisis != cmd.crisis:
            log.warning("crisis resolution refused: no such open crisis", crisis=cmd.crisis)
            return False
        await self.append(lambda s: breaker.in_crisis(s, ""), "crisis_resolved",
                                    cmd.principal, "human",
                                    f"{cmd.crisis} resolved by {cmd.principal}: {cmd.reason}",
                                    breaker.Marks(act=act.digest, keyid=verified.keyid,
                                                  resolved=cmd.crisis), verified.envelope)
        log.warning("crisis resolved; applies resume", crisis=cmd.crisis,
                    principal=cmd.principal)
        return True

    async def resolved(self, crisis: str) -> bool:
        """Whether the autonomy chain, verified, records `crisis` as resolved by an operator."""
        chain = await self.store.read_chain_at(S.autonomy_audit(breaker.AUTONOMY_ID))
        if audit.verify_chain(breaker.AUTONOMY_ID, [body for _, body in chain],
                              self.trust.chain_trust, [seq for seq, _ in chain]) is not None:
            return False
        return breaker.resolved([body for _, body in chain], crisis)
