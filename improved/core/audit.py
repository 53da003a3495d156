"""The hash-chained audit trail (DESIGN §6): sealing trailers and verifying chains.

`prev` of seq 0 is the proposal id; `hash` is SHA-256 over the canonical MessagePack of the
trailer without `hash` and `sig`. Verification works on the JSON a reader got from the broker,
re-deriving every hash and link, so it needs no trust in the broker. Given the trust a reader
holds (`evidence.ChainTrust`: the daemon keys, the trust history), it also checks who wrote each
trailer and the signed act every authority trailer carries.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import msgspec

from improved.core.record import ChainHead, ProposalRecord, lifecycle_problem, lifecycle_step
from improved.core.trailers import Data, TrailerData, Unknown, encode, verdict_of
from improved.protocol import canonical
from improved.protocol.model import (
    Cause,
    ChangeClass,
    Envelope,
    ObserverType,
    Scope,
    Stage,
    Status,
    Trailer,
    TrailerVerdict,
)

REASON_LIMIT = 500


class Authenticity(Protocol):
    """What a reader trusts beyond hashes (`evidence.ChainTrust`): `start()` opens one chain's
    pass, `problem` names why a trailer was not written by a trusted daemon or does not rest
    on a valid signed act, or None. `covered`: a later trailer of the same message (a commit)
    follows it in its chain, whose signature vouches for it through the links (`covering`)."""

    def start(self) -> object: ...

    def problem(self, body: dict[str, Any], chain_id: str, stream_seq: int,
                state: object, covered: bool = False) -> str | None: ...


def covering(seqs: Sequence[int]) -> list[bool]:
    """For the trailers of one chain at stream sequences `seqs`, in order: whether each is
    followed by a later trailer of the same message (a commit shares one sequence), so the
    signature of the commit's last trailer vouches for it. A commit is signed once, on its
    last trailer: the hash links from it back to the commit's first make that one signature
    cover every trailer of the commit, and the last trailer of every message is checked."""
    return [0 < seq == after for seq, after in zip(seqs, [*seqs[1:], 0], strict=False)]


class Draft(msgspec.Struct, frozen=True):
    """What a stage decided; sealing turns it into the next trailer of the proposal's chain."""

    from_stage: Stage
    to_stage: Stage
    actor: str
    observer_type: ObserverType
    reason: str
    verdict: TrailerVerdict | None = None
    cause: Cause | None = None
    refs: tuple[str, ...] = ()
    envelope: Envelope | None = None  # the signed act an authority trailer rests on
    gate_class: ChangeClass | None = None  # a decision's class; else the chain's (`seal`)
    # what `refs` say, typed, when the stage wrote it from typed data (`draft_of`): a commit
    # folds it without reading the refs back (`trailers.decode` gives back the same)
    data: TrailerData | None = None


def draft_of(data: Data, from_stage: Stage, actor: str, observer_type: ObserverType,
             reason: str, envelope: Envelope | None = None,
             gate_class: ChangeClass | None = None) -> Draft:
    """The draft of a trailer saying `data`: its stage, verdict and cause, and its refs
    (`trailers.encode`) — the one way a stage writes what it decided."""
    return Draft(from_stage=from_stage, to_stage=data.STAGE, actor=actor,
                 observer_type=observer_type, reason=reason, verdict=verdict_of(data),
                 cause=cast("Cause | None", getattr(data, "cause", None))
                 if "cause" in data.__struct_fields__ else None,
                 refs=encode(data), envelope=envelope, gate_class=gate_class,
                 data=None if isinstance(data, Unknown) else cast("TrailerData", data))


COMMIT_KEY = "trailers"  # the one key of a message carrying several trailers (`TrailerCommit`)


def trailers_in(body: Any) -> list[Any]:
    """The trailers one message of an audit chain carries, in order: the trailers of a commit
    (`{"trailers": [...]}`, two or more), else the message itself as one trailer — what is no
    trailer at all (not an object, a commit of fewer than two trailers or with other keys)
    stays one body that no verifier takes for a trailer."""
    if isinstance(body, dict) and COMMIT_KEY in body and len(body) == 1:
        inner = body[COMMIT_KEY]
        if isinstance(inner, list) and len(inner) >= 2:
            return inner
    return [body]


def trailer_hash(body: dict[str, Any]) -> str:
    """SHA-256 hex of the canonical MessagePack of a trailer without its `hash` and `sig`."""
    if "hash" in body or "sig" in body:
        body = {k: v for k, v in body.items() if k not in ("hash", "sig")}
    return canonical.digest(body)


def seal(draft: Draft, record: ProposalRecord, at: int) -> Trailer:
    """The next trailer of `record`'s chain; `fold(record, seal(...), seq)` is the record
    after it."""
    return seal_next(draft, record.proposal_id, record.chain,
                     draft.gate_class or record.gate_class, record.proposal.scope, at)


def seal_next(draft: Draft, chain_id: str, head: ChainHead, gate_class: ChangeClass, scope: Scope,
              at: int) -> Trailer:
    """The next trailer of the chain `chain_id` that ends at `head`."""
    return hashed(_unhashed(draft, chain_id, head, gate_class, scope, at))


def hashed(trailer: Trailer) -> Trailer:
    """`trailer` with its hash: what `seal` makes of the trailer `unhashed` gave."""
    return msgspec.structs.replace(trailer, hash=trailer_hash(msgspec.to_builtins(trailer)))


def unhashed(draft: Draft, record: ProposalRecord, at: int) -> Trailer:
    """The trailer `seal` makes of `draft`, but for its hash: what a fold reads to know the
    record after it (its indexes, say) before the trailer is sealed for good."""
    return _unhashed(draft, record.proposal_id, record.chain, draft.gate_class or record.gate_class,
                     record.proposal.scope, at)


def _unhashed(draft: Draft, chain_id: str, head: ChainHead, gate_class: ChangeClass,
              scope: Scope, at: int) -> Trailer:
    return Trailer(
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
        envelope=draft.envelope,
    )


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


def verify_chain(proposal_id: str, bodies: Iterable[dict[str, Any]],
                 trust: Authenticity | None = None,
                 seqs: Sequence[int] | None = None, service: str | None = None) -> Break | None:
    """Re-derive every hash and link of one chain and check that its transitions are ones the
    OMS lifecycle allows; None when it verifies. With `trust`, also `verify_writers`; with
    `service` (the token of the subject it was read from), that it is filed under its own
    proposal's service (`filing_problem`)."""
    bodies = list(bodies)
    brk = verify_links(proposal_id, bodies)
    if brk is None and bodies:
        filed = filing_problem(service, 0, bodies[0])
        if filed is not None:
            brk = Break(proposal_id, 0, filed)
    if brk is None:
        forbidden = lifecycle_problem(bodies)
        if forbidden is not None:
            brk = Break(proposal_id, *forbidden)
    if brk is None and trust is not None:
        brk = verify_writers(proposal_id, bodies, trust, seqs)
    return brk


def verify_links(proposal_id: str, bodies: Sequence[Any]) -> Break | None:
    """Every hash re-derived, every link followed: nothing altered, removed or reordered."""
    prev = proposal_id
    for at, body in enumerate(bodies):  # a break is named by its position in the chain
        problem, prev = _link(body, proposal_id, at, prev)
        if problem is not None:
            return Break(proposal_id, at, problem)
    if not bodies:
        return Break(proposal_id, 0, "no trailers")
    return None


def _link(body: Any, chain_id: str, at: int, prev: str) -> tuple[str | None, str]:
    """(why the trailer at position `at` does not follow `prev`, or None; its derived hash)."""
    if not isinstance(body, dict):
        return "not a trailer object", prev
    if body.get("proposal_id") != chain_id:
        return f"belongs to proposal {body.get('proposal_id')!r}", prev
    seq = body.get("seq")
    if seq != at:
        return f"sequence jumps to {seq!r}", prev
    if not _same(body.get("prev"), prev):
        return "prev does not link to the previous trailer", prev
    try:
        derived = trailer_hash(body)
    except canonical.CanonicalError as exc:
        return f"not canonical: {exc}", prev
    if not _same(body.get("hash"), derived):
        return "hash does not match the trailer's content", prev
    return None, derived


class _Filed(msgspec.Struct):
    service: str


def filing_problem(service: str | None, position: int, body: Any) -> str | None:
    """Why a proposal's chain read from `improve.audit.<service>.<id>` is not that service's
    chain, or None: its registration (position 0) carries a proposal of another service. A
    daemon-signed chain copied under another service's subject verifies trailer by trailer;
    filed there, it would be a second chain for one proposal, which that service's messages
    would find. `service` None (a mesh chain, or a reader that does not know the subject):
    nothing to check."""
    if service is None or position != 0 or not isinstance(body, dict):
        return None
    for r in body.get("refs") or ():
        if isinstance(r, str) and r.startswith("proposal:"):
            try:
                named = msgspec.json.decode(r[len("proposal:"):].encode(), type=_Filed).service
            except msgspec.MsgspecError:
                return None  # not a proposal at all: the replay names it
            if named != service:
                return (f"filed under service {service!r}, but its registration is a proposal "
                        f"of {named!r}")
            return None
    return None


@dataclass(slots=True)
class ChainRun:
    """Where one chain's verification stands after the trailers fed to `verify_next` so far:
    what a reader that sees the whole log once, trailer by trailer, keeps per chain instead of
    the chain itself. `start` makes a run at a chain's first trailer; `after` continues one from
    a trailer already verified (its position and hash)."""

    chain_id: str
    position: int
    prev: str
    status: Status
    acts: object
    service: str | None = None  # the subject's service, for `filing_problem`

    @classmethod
    def start(cls, chain_id: str, trust: Authenticity | None,
              service: str | None = None) -> ChainRun:
        return cls(chain_id, 0, chain_id, "pending", trust.start() if trust else None, service)

    @classmethod
    def after(cls, chain_id: str, position: int, last_hash: str, status: Status,
              trust: Authenticity | None) -> ChainRun:
        return cls(chain_id, position + 1, last_hash, status, trust.start() if trust else None)


def verify_next(run: ChainRun, body: Any, trust: Authenticity | None = None,
                stream_seq: int = 0, covered: bool = False) -> Break | None:
    """Check one more trailer of `run`'s chain — its hash and link, the lifecycle, and with
    `trust` its writer and signed act — and advance the run; the break, if it is one.
    `covered`: the next trailer fed is a later one of the same message (`covering`)."""
    at = run.position
    problem, derived = _link(body, run.chain_id, at, run.prev)
    status = run.status
    if problem is None:
        problem = filing_problem(run.service, at, body)
    if problem is None:
        status, problem = lifecycle_step(status, at, body)
    if problem is None and trust is not None:
        problem = trust.problem(body, run.chain_id, stream_seq, run.acts, covered)
    if problem is not None:
        return Break(run.chain_id, at, problem)
    run.position, run.prev, run.status = at + 1, derived, status
    return None


def verify_writers(proposal_id: str, bodies: Sequence[dict[str, Any]], trust: Authenticity,
                   seqs: Sequence[int] | None = None) -> Break | None:
    """The writing daemon's signature on the last trailer of every message (`covering`) and
    the signed act on every authority trailer, against the keys trusted at its stream
    sequence (from `seqs`; without them every trailer must be signed); trailers a trusted
    checkpoint already vouches for (`trust.covered_to`) are not checked again. Run on a chain
    whose links verify."""
    state = trust.start()
    covered = covering(seqs) if seqs is not None else [False] * len(bodies)
    for at, body in enumerate(bodies):
        problem = trust.problem(body, proposal_id, seqs[at] if seqs is not None else 0, state,
                                covered[at])
        if problem is not None:
            return Break(proposal_id, at, problem)
    return None
