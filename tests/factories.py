"""Wire messages for the end-to-end tests, stamped with the wall clock: proposals of a given
service, signals, signed operator acts (reviews, grants) and L4 binary swaps. Pure builders;
what sends them is in `tests.bus`. The core's tests use `tests.builders` (a fixed clock)."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from improved import testing
from improved.core.signing import PAYLOAD_TYPES, sign
from improved.protocol.model import (
    GrantCommand,
    Origin,
    Proposal,
    Review,
    Signal,
    Vote,
    to_json,
)
from improved.testing import rank_proposal, skill_proposal, unique_ms  # noqa: F401
from tests.keys import ALICE, VOTERS


def now_ms() -> int:
    return int(time.time() * 1000)


def signal(svc: str, actor: str, positive: bool = True, kind: str = "refine",
           proposal_id: str | None = None, **over: Any) -> Signal:
    return Signal(kind=kind, actor=actor, service=over.pop("service", svc), positive=positive,
                  at=over.pop("at", int(time.time() * 1000)), proposal_id=proposal_id, **over)


def review(pid: str, verdict: str = "approve", who=ALICE, principal: str | None = None,
           at: int | None = None, reason: str = "looked at it"):
    """A review of `pid` signed by `who` (ALICE: an operator the test daemons trust)."""
    body = Review(proposal_id=pid, verdict=verdict, principal=principal or who[0],
                  reason=reason, at=at or now_ms())
    return sign(PAYLOAD_TYPES["review"], to_json(body), who[1])


def grant(skill: str, op: str = "grant", who=ALICE, proposal: str | None = None):
    """A signed L3 grant (or, with op="revoke", its revocation) of one skill identity; a grant
    names `proposal`, the L2 proposal that applied the definition (`tests.bus.applied_at_l2`)."""
    body = GrantCommand(op=op, skill=skill, principal=who[0], reason="trusted", at=now_ms(),
                        proposal_id=proposal)
    return sign(PAYLOAD_TYPES["grant"], to_json(body), who[1])


def sha(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def swap(svc: str, new: dict[str, str], smoke: dict[str, str] | None = None,
         actor: str = "agentd:run-7:1") -> Proposal:
    """An L4 swap of `svc`'s artefacts to the `new` texts, each with its last-known-good."""
    smoke = smoke or {}
    return testing.proposal(
        svc, f"binary:{svc}", "L4", template="swap_binary", args={"n": len(new)},
        analyzer="acme.deployer/1", scope="operation", created_at=now_ms(),
        origin=Origin(actor=actor, service="agentd"), proposal_data={"artefacts": new},
        lkg=[{"artefact": name, "digest": sha(text), "smoke_test": smoke.get(name, "json")}
             for name, text in new.items()])


def vote(reads: list[str], voter: str, session: str, verdict: str = "approve"):
    """A quorum vote signed by one of the test voters, having read `reads` (what
    `quorum.expected_reads` says is on the chain: `tests.bus.quorum_reads`)."""
    pid = reads[0].removeprefix("proposal:")
    body = Vote(proposal_id=pid, vote=verdict, voter=voter, session=session, read=reads,
                at=now_ms())
    return sign(PAYLOAD_TYPES["vote"], to_json(body), VOTERS[voter])
