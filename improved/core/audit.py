"""The hash-chained audit trail (DESIGN §6): sealing trailers and verifying chains.

`prev` of seq 0 is the proposal id; `hash` is SHA-256 over the canonical MessagePack of the
trailer without `hash`. Verification works on the JSON a reader got from the broker, re-deriving
every hash and link, so it needs no trust in the broker or in this daemon.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from improved.core.record import ChainHead, ProposalRecord
from improved.protocol import canonical
from improved.protocol.model import (
    Cause,
    ChangeClass,
    ObserverType,
    Scope,
    Stage,
    Trailer,
    TrailerVerdict,
)

REASON_LIMIT = 500


@dataclass(frozen=True, slots=True)
class Draft:
    """What a stage decided; sealing turns it into the next trailer of the proposal's chain."""

    from_stage: Stage
    to_stage: Stage
    actor: str
    observer_type: ObserverType
    reason: str
    verdict: TrailerVerdict | None = None
    cause: Cause | None = None
    refs: tuple[str, ...] = field(default_factory=tuple)


def trailer_hash(body: dict[str, Any]) -> str:
    """SHA-256 hex of the canonical MessagePack of a trailer without its `hash`."""
    if "hash" in body:
        body = dict(body)
        del body["hash"]
    return canonical.digest(body)


def seal(draft: Draft, record: ProposalRecord, at: int) -> Trailer:
    return seal_next(draft, record.proposal_id, record.chain, record.gate_class,
                     record.proposal.scope, at)


def seal_next(draft: Draft, chain_id: str, head: ChainHead, gate_class: ChangeClass, scope: Scope,
              at: int) -> Trailer:
    """The next trailer of the chain `chain_id` that ends at `head`."""
    t = Trailer(
        proposal_id=chain_id,
        seq=head.length,
        from_stage=draft.from_stage,
        to_stage=draft.to_stage,
        gate_class=gate_class,
        scope=scope,
        verdict=draft.verdict,
        cause=draft.cause,
        actor=draft.actor,
        observer_type=draft.observer_type,
        reason=draft.reason[:REASON_LIMIT],
        refs=list(draft.refs),
        at=at,
        prev=head.last_hash or chain_id,
    )
    return msgspec.structs.replace(t, hash=trailer_hash(msgspec.to_builtins(t)))


@dataclass(frozen=True, slots=True)
class Break:
    """The first place a chain stops verifying."""

    proposal_id: str
    seq: int
    problem: str

    def __str__(self) -> str:
        return f"{self.proposal_id} trailer {self.seq}: {self.problem}"


def _same(claimed: object, derived: str) -> bool:
    """Constant-time comparison that never raises, whatever a tampered field holds."""
    return isinstance(claimed, str) and hmac.compare_digest(claimed.encode(), derived.encode())


def verify_chain(proposal_id: str, bodies: Iterable[dict[str, Any]]) -> Break | None:
    """Re-derive every hash and link of one proposal's chain; None when it verifies."""
    prev = proposal_id
    expected_seq = 0
    for body in bodies:
        at = expected_seq  # a break is named by its position in the chain
        if not isinstance(body, dict):
            return Break(proposal_id, at, "not a trailer object")
        if body.get("proposal_id") != proposal_id:
            return Break(proposal_id, at, f"belongs to proposal {body.get('proposal_id')!r}")
        seq = body.get("seq")
        if seq != expected_seq:
            return Break(proposal_id, at, f"sequence jumps to {seq!r}")
        if not _same(body.get("prev"), prev):
            return Break(proposal_id, at, "prev does not link to the previous trailer")
        try:
            derived = trailer_hash(body)
        except canonical.CanonicalError as exc:
            return Break(proposal_id, at, f"not canonical: {exc}")
        if not _same(body.get("hash"), derived):
            return Break(proposal_id, at, "hash does not match the trailer's content")
        prev = derived
        expected_seq += 1
    if expected_seq == 0:
        return Break(proposal_id, 0, "no trailers")
    return None
