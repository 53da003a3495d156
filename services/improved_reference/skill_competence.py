"""Competence as the OMS Skill grain keeps it, and what a proposal's audit chain says was
practised. Pure: no NATS, no clock.

OMS records a holder's mastery of a skill as a supersession chain of immutable grains: every
change of proficiency, up or down, is a new grain with `practice_count + 1` (oms.md §5.3).
What moves it here is learn-back, and only independent learn-back (SPEC 09 §5, the
feedback-collapse guard): an outcome the daemon recorded on the proposal's chain with
`independent:true`, after the skill was applied and before any rollback. The chain is read and
verified by the store itself; a retained learn-back record only says where to look.

The holder whose competence an outcome describes is the agent that proposed running the skill.
A signed proposal names it verifiably: the holder is the identity whose key signed it
(`agent:<svc>:<name>` or `service:<svc>`), as its registration trailer records it beside the
envelope (`propose.registration`). An unsigned one names it only by its own word, under the
service that verifiably proposed it: `service:<svc>/<origin.actor>` (`holder_of`).
`origin.actor` is only recorded, so an unsigned proposer could name any agent there; the
verified service in front keeps that within its own service's holders — it can never move the
competence of another service's agent, nor of a signed holder (whose name has no `/`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from improved.core import propose
from improved.core.audit import Authenticity, verify_chain
from improved.core.identity import of_subject as identity_of_subject
from improved.core.identity import proposer_problem
from improved.core.trailers import Applied, Registration, RolledBack, SignalCounted, decode
from improved.protocol import canonical, wire
from improved.protocol.model import Proposal, Trailer

ALPHA = 0.2  # weight of one independent outcome in the proficiency average
NAMESPACE = "agent:skills"  # OMS: Skill grains SHOULD use it
COUNTED_KEEP = 256  # proposals whose counted outcomes a competence head remembers


class NotPractice(ValueError):
    """A chain that records no practice of a skill this store holds; the text says why."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """One independent outcome on a proposal's chain, after the apply."""

    seq: int  # the trailer's position on the chain: counted once per (proposal, seq)
    positive: bool
    at: int


@dataclass(frozen=True, slots=True)
class Practice:
    """What a verified chain says: who practised which skill, and how it went."""

    proposal_id: str
    identity: str  # <name>:<sha256> of the definition the proposal carried
    holder: str
    outcomes: tuple[Outcome, ...]


def next_proficiency(p: float, positive: bool) -> float:
    """Exponential moving average toward 1.0 on success, toward 0.0 on failure."""
    return p + ALPHA * (1.0 - p) if positive else p * (1.0 - ALPHA)


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def competence_grain(definition: dict[str, Any], *, holder_did: str, proficiency: float,
                     practice_count: int, created_at: int, derived_from: list[str],
                     last_practiced_at: int | None = None,
                     origin_did: str | None = None) -> dict[str, Any]:
    """One OMS Skill grain with learned-competence fields; confidence mirrors proficiency."""
    return _drop_none({
        "type": "skill", **definition, "holder_did": holder_did, "author_did": holder_did,
        "proficiency": float(proficiency), "confidence": float(proficiency),
        "practice_count": practice_count, "last_practiced_at": last_practiced_at,
        "created_at": created_at, "namespace": NAMESPACE, "derived_from": derived_from,
        "origin_did": origin_did,
    })


def address_of(grain: dict[str, Any]) -> str:
    return canonical.content_address(grain, canonical.SKILL)


def holder_of(proposal: Proposal) -> str:
    """Whose competence an unsigned proposal's outcomes describe: the agent it declares, under
    the service whose subject carried it (the proposal's `service`, which must be the
    subject's) — only as good as that service's own word."""
    return f"{identity_of_subject(proposal.service)}/{proposal.origin.actor}"


def practice_on_chain(proposal_id: str, bodies: list[Any], service: str,
                      trust: Authenticity | None = None,
                      seqs: list[int] | None = None) -> Practice:
    """The practice a proposal's chain records, or NotPractice naming why it records none.

    The chain must verify (hashes, links, the lifecycle) and carry, in its registration, a
    proposal of `service` whose content address is `proposal_id` and whose body is a skill
    definition. With `trust` (evidence.DaemonWriters), every trailer must also carry a trusted
    daemon's signature: without it, a correctly hashed trailer anyone allowed to publish on the
    chain's subject appended would count. Outcomes count from an `applied` trailer until a `rolled_back` one: evidence
    before the apply (which may have released the feedback-collapse guard) is about the
    proposal, not practice of the skill."""
    if not bodies:
        raise NotPractice(f"no audit chain for {proposal_id[:12]}")
    broken = verify_chain(proposal_id, bodies, trust, seqs)
    if broken is not None:
        raise NotPractice(f"the audit chain of {proposal_id[:12]} does not verify: {broken}")
    try:
        trailers = [msgspec.convert(body, type=Trailer) for body in bodies]
        said = [decode(t) for t in trailers]
        first = propose.registration(trailers[0])
        proposal = first.proposal
        pid, _ = propose.identify(proposal)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError, wire.WireError) as exc:
        raise NotPractice(f"the chain of {proposal_id[:12]} carries no readable proposal: "
                          f"{exc}") from None
    if pid != proposal_id:
        raise NotPractice(f"the registration of {proposal_id[:12]} carries another proposal")
    if proposal.service != service:
        raise NotPractice(f"{proposal_id[:12]} is a proposal of {proposal.service!r}, not of "
                          f"{service!r}")
    skill = propose.skill_definition(proposal)
    if skill is None or not proposal.target_ref.startswith("skill:"):
        raise NotPractice(f"{proposal_id[:12]} carries no skill definition to practise")
    try:
        identity = canonical.skill_identity(skill)
    except canonical.CanonicalError as exc:
        raise NotPractice(f"the skill of {proposal_id[:12]} has no identity: {exc}") from None
    outcomes: list[Outcome] = []
    live = False
    for trailer, data in zip(trailers, said, strict=True):
        match data:
            case Applied(verdict="applied"):
                live = True
            case RolledBack(verdict="rolled_back"):
                live = False
            case SignalCounted(independent=True) if live:
                outcomes.append(Outcome(seq=trailer.seq, positive=data.positive,
                                        at=trailer.at if data.at is None else data.at))
    return Practice(proposal_id=proposal_id, identity=identity,
                    holder=holder_on_chain(trailers[0], first), outcomes=tuple(outcomes))


def holder_on_chain(registration: Trailer, first: Registration) -> str:
    """The holder a registration names: its verified proposer when the proposal came signed
    (the chain's verification checks the envelope beside it), else `holder_of` the proposal.
    NotPractice for a signer the registration says is of another service."""
    proposal, signer = first.proposal, first.proposer
    if signer is None:
        return holder_of(proposal)
    problem = proposer_problem(signer, proposal.service)
    if problem is not None or registration.envelope is None:
        raise NotPractice(f"the registration of {registration.proposal_id[:12]} names a "
                          f"proposer it does not prove: {problem or 'no envelope'}")
    return signer


def already_counted(head: dict[str, Any] | None, proposal_id: str, seq: int) -> bool:
    """The head's `counted` map says this outcome (or a later one of the proposal) is in."""
    counted = (head or {}).get("counted")
    last = counted.get(proposal_id) if isinstance(counted, dict) else None
    return isinstance(last, int) and last >= seq


def with_counted(head: dict[str, Any] | None, proposal_id: str, seq: int) -> dict[str, int]:
    """The head's `counted` map with `proposal_id` at `seq`, newest last, at most
    COUNTED_KEEP proposals (an older proposal's outcomes have left its review window)."""
    counted = dict((head or {}).get("counted") or {})
    counted.pop(proposal_id, None)
    counted[proposal_id] = seq
    while len(counted) > COUNTED_KEEP:
        counted.pop(next(iter(counted)))
    return counted
