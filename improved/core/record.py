"""A proposal's cached state and how it follows from the audit chain (DESIGN §4).

The record is a cache: nothing in it is taken from a message, only folded from the trailers
the loop wrote. `fold(record, trailer, stream_seq)` is the one place a trailer becomes record
state: the engine folds each trailer it commits, and `replay` folds a whole chain, so a record
committed and a record rebuilt are alike by construction. What a trailer says is typed in
core/trailers.py; how the status follows is `trailers.status_after`. Everything else the
stages need — the proposal, its decision, its apply outcome, the signals counted — travels
with it so a stage is a pure function of (record, input) to the draft it decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, cast, get_args

import msgspec
from msgspec import Struct

from improved.core.trailers import (
    Applied,
    Approved,
    Decided,
    Dispatched,
    Inherited,
    LkgRefused,
    LkgVerified,
    Measured,
    QuorumReached,
    Rejected,
    RollbackAsked,
    RolledBack,
    SignalCounted,
    Signed,
    Superseded,
    TrailerData,
    TrailerDataError,
    Undelivered,
    Voted,
    decode,
    status_after,
)
from improved.protocol.model import (
    ApplyOutcome,
    ChangeClass,
    Proposal,
    ProposalState,
    SchemaClass,
    Stage,
    Status,
    Trailer,
    TriageDecision,
)


class CountedSignal(Struct, kw_only=True, frozen=True):
    digest: str
    kind: str
    actor: str
    service: str
    positive: bool
    at: int
    independent: bool
    name: str | None = None
    value: float | None = None
    emitter: str = ""  # the verified identity that sent it (core/identity.py); "" unverified


class ChainHead(Struct, kw_only=True, frozen=True):
    """Where the proposal's audit chain ends: its length, last hash and JetStream sequence."""

    length: int = 0
    last_hash: str = ""
    stream_seq: int = 0


class Ballot(Struct, kw_only=True, frozen=True):
    """One counted quorum vote (SPEC 09 §6): who, from which session, what they said."""

    keyid: str
    voter: str
    session: str
    vote: str
    at: int
    act: str  # digest of the signed envelope
    sig: str = ""
    read: tuple[str, ...] = ()


class ProposalRecord(Struct, kw_only=True, frozen=True):
    proposal_id: str
    service: str
    dedup_key: str
    proposal: Proposal
    summary_text: str
    skill: str | None = None  # `<name>:<sha256>` of a skill proposal's definition
    gate_class: ChangeClass
    status: Status = "pending"
    stage: Stage = "observe"
    decision: TriageDecision | None = None
    outcome: ApplyOutcome | None = None
    approved_by: str | None = None  # the principal whose signed approval the apply runs under
    superseded_by: str | None = None  # newer content under the same dedup_key
    dispatched_by: str | None = None  # the authority of the ApplyOrder recorded as dispatched
    dispatched_at: int | None = None  # when that dispatch was recorded (the intent trailer)
    # the intent trailer's stream sequence: an L3's grant counts as it stood below it
    dispatched_seq: int | None = None
    rollback_by: str | None = None  # the principal who asked for the inverse
    rollback_dispatched_at: int | None = None  # when the rollback order was recorded as sent
    rollback_outcome: ApplyOutcome | None = None
    measured: str | None = None  # `held`, `regressed` or `unmeasured`, once review_after came
    measured_value: float | None = None  # what the owning service answered then, if anything
    revert: Proposal | None = None  # L4: the reversal generated and validated before apply
    revert_id: str | None = None
    ballots: tuple[Ballot, ...] = ()  # quorum votes counted so far
    acts: tuple[tuple[str, int], ...] = ()  # (envelope digest, stream sequence) of signed acts seen
    signals: tuple[CountedSignal, ...] = ()
    # the verified identity that signed the proposal (its registration's envelope), None when
    # unsigned: then the proposer is the whole service (core/identity.py)
    proposer: str | None = None
    chain: ChainHead = ChainHead()
    updated_at: int = 0

    def replace(self, **changes: object) -> ProposalRecord:
        return msgspec.structs.replace(self, **changes)

    @property
    def applied_at(self) -> int | None:
        return self.outcome.at if self.outcome is not None and self.outcome.ok else None

    @property
    def in_flight(self) -> bool:
        """The ApplyOrder's dispatch is on the chain and its outcome is not (yet): no review
        may decide otherwise now, and the order is sent again until its outcome is recorded."""
        return self.dispatched_at is not None and self.outcome is None

    @property
    def positives(self) -> int:
        return sum(1 for s in self.signals if s.positive)

    @property
    def independent_positives(self) -> int:
        return sum(1 for s in self.signals if s.positive and s.independent)


# What learn-back found at review_after, as `learnback.judge` decides it (the verdicts of a
# `trailers.Measured` trailer; every other kind says its own verdict, core/trailers.py).
HELD: Final = "held"  # the metric held
REGRESSED: Final = "regressed"  # beyond the tolerance; a rollback is proposed
UNMEASURED: Final = "unmeasured"  # the owning service gave no usable value: not "held"


def closed(record: ProposalRecord) -> bool:
    """Nothing more is awaited of the proposal: rejected, expired, rolled back, superseded
    before it ran, or applied with no measurement still to make. Its retained records may then
    leave the bus after a while (docs/protocol.md "Records"); its chain keeps everything, and a
    later transition (a rollback, a late signal) publishes them again."""
    if record.status in ("rejected", "expired", "rolled_back"):
        return True
    if record.status == "pending":
        return record.superseded_by is not None and not record.in_flight
    if record.status == "applied":
        snap = record.proposal.metric_snapshot
        return snap is None or snap.review_after is None or record.measured is not None
    return False


def expired_at(valid_to: int | None, now: int) -> bool:
    """`valid_to` has passed at `now` (it is the first millisecond of expiry)."""
    return valid_to is not None and valid_to <= now


def status_at(record: ProposalRecord, now: int) -> Status:
    """The status as of `now`: the one every place that shows or decides on a status asks.
    The chain's status, except `expired` once `valid_to` has passed for a proposal still
    pending or approved whose order is not in flight (OMS §8.12: expiry is computed from
    `valid_to`, reachable only from pending or approved, and withdraws an approval; once the
    dispatch is on the chain, its outcome decides). The daemon records the expiry at its first
    pass after `valid_to`; until then the chain still says pending or approved."""
    if (record.status in ("pending", "approved") and not record.in_flight
            and expired_at(record.proposal.valid_to, now)):
        return "expired"
    return record.status


def state_of(record: ProposalRecord, now: int) -> ProposalState:
    """The retained ProposalState, its status as of `now` (`status_at`: expired once
    `valid_to` passed, even before the chain records it)."""
    p = record.proposal
    return ProposalState(
        proposal_id=record.proposal_id, service=record.service, target_ref=p.target_ref,
        change_class=p.change_class, gate_class=record.gate_class, scope=p.scope,
        dedup_key=record.dedup_key, stage=record.stage, status=status_at(record, now),
        summary_text=record.summary_text, updated_at=record.updated_at,
        proposer=record.proposer,
    )


def expiry_unrecorded(record: ProposalRecord, now: int) -> bool:
    """Expired as of `now` and not yet on the chain, and still standing: its expiry is due.
    A superseded proposal is shown expired but left as it is (it is never decided again)."""
    return (record.superseded_by is None and record.status != "expired"
            and status_at(record, now) == "expired")


# The OMS lifecycle (DESIGN §4): every status change a chain may make. Anything else — a
# rejected proposal approved, an expired one applied, a rolled-back one applied again, a second
# registration resetting a decision — is a broken chain, whatever its hashes say.
LIFECYCLE: Final = frozenset({
    ("pending", "approved"), ("pending", "rejected"), ("pending", "expired"),
    ("pending", "applied"),  # accepted L0/L3: applied from pending
    ("approved", "pending"),  # superseded: an approval never carries to new content
    ("approved", "rejected"), ("approved", "expired"), ("approved", "applied"),
    ("applied", "rolled_back"),
})


class _Step(Struct, kw_only=True):
    seq: int = 0
    to_stage: str = ""
    verdict: str | None = None
    cause: str | None = None


def lifecycle_problem(bodies: Sequence[object]) -> tuple[int, str] | None:
    """(position, why) of the first transition the OMS lifecycle forbids, or None. Only a
    chain's first trailer may register (`to_stage: propose`)."""
    status: Status = "pending"
    for at, body in enumerate(bodies):
        status, problem = lifecycle_step(status, at, body)
        if problem is not None:
            return at, problem
    return None


def lifecycle_step(status: Status, at: int, body: object) -> tuple[Status, str | None]:
    """The status after the trailer at position `at`, or why the lifecycle forbids it."""
    try:
        step = msgspec.convert(body, type=_Step)
    except msgspec.ValidationError as exc:
        return status, f"not a trailer: {exc}"
    if step.to_stage == "propose" and at > 0:
        return status, "a second registration: only the first trailer registers a proposal"
    after = status_after(status, step)
    if after != status and (status, after) not in LIFECYCLE:
        return status, f"the lifecycle forbids {status} → {after}"
    return after, None


def fold_status(trailers: list[Trailer]) -> tuple[Status, Stage]:
    """(status, stage) of a chain, from nothing but its trailers."""
    status: Status = "pending"
    stage: Stage = "observe"
    for t in trailers:
        status = status_after(status, t)
        stage = t.to_stage
    return status, stage


record_encoder = msgspec.msgpack.Encoder()
record_decoder = msgspec.msgpack.Decoder(ProposalRecord)


def _with_head(record: ProposalRecord, trailer: Trailer, stream_seq: int,
               data: TrailerData) -> ProposalRecord:
    """What every trailer says of the record, whatever its kind: the status after it, its
    stage, where the chain ends, the time; and an ApplyOrder's intent, where it sits in the
    stream (`dispatched_seq`)."""
    intent = isinstance(data, Dispatched) and data.dispatch == "apply"
    return record.replace(
        status=status_after(record.status, trailer),
        stage=trailer.to_stage,
        chain=ChainHead(length=trailer.seq + 1, last_hash=trailer.hash, stream_seq=stream_seq),
        updated_at=max(record.updated_at, trailer.at),
        dispatched_seq=stream_seq if intent else record.dispatched_seq,
    )


SCHEMA_CLASSES: Final = frozenset(get_args(SchemaClass))


def schema_class(value: str | None) -> SchemaClass | None:
    """The `schema_class` ref of an `applied` trailer as the outcome carries it; anything else
    (no ref, an older chain) is none. Read back for auditors; nothing decides on it."""
    return cast("SchemaClass", value) if value in SCHEMA_CLASSES else None


# The stream sequence a trailer folds at while its commit is still to be appended: a pass folds
# every trailer it decides at once, and `settle` gives the message's sequence to what folded at
# this once the commit is acknowledged (one message carries the trailers of one commit).
PENDING_SEQ: Final = -1


def settle(record: ProposalRecord, stream_seq: int) -> ProposalRecord:
    """The record whose pending trailers (folded at PENDING_SEQ) were appended in the message
    at `stream_seq`: what folding them at `stream_seq` makes, without folding them again."""
    if record.chain.stream_seq != PENDING_SEQ:
        return record
    return record.replace(
        chain=ChainHead(length=record.chain.length, last_hash=record.chain.last_hash,
                        stream_seq=stream_seq),
        dispatched_seq=stream_seq if record.dispatched_seq == PENDING_SEQ
        else record.dispatched_seq)


def hashed(folded: ProposalRecord, trailer: Trailer, stream_seq: int) -> ProposalRecord:
    """What `fold` makes of `trailer` at `stream_seq`, from `folded`, the fold of the same
    trailer before it had its hash: of the hash a record keeps only where its chain ends."""
    return folded.replace(chain=ChainHead(length=trailer.seq + 1, last_hash=trailer.hash,
                                          stream_seq=stream_seq))


def replay(start: ProposalRecord, trailers: list[Trailer], stream_seqs: list[int]) -> ProposalRecord:
    """Rebuild a record from its registration and its chain alone (the store is only a cache):
    the fold of every trailer, as each was committed."""
    record = start
    for trailer, stream_seq in zip(trailers, stream_seqs, strict=True):
        record = fold(record, trailer, stream_seq)
    return record


def fold(record: ProposalRecord, trailer: Trailer, stream_seq: int,
         data: TrailerData | None = None) -> ProposalRecord:
    """The record after `trailer` joined its chain at JetStream sequence `stream_seq`: the one
    place a trailer becomes record state, for a commit and a rebuild alike. `data`: what the
    trailer says, when a caller decoded it already (`trailers.decode`). TrailerDataError
    (a ValueError) when its refs are not its kind's data; a trailer of no kind known here
    (`trailers.Unknown`) moves only the head."""
    data = decode(trailer) if data is None else data
    if isinstance(data, Signed) and data.act is not None:
        if data.act_seq is None:
            raise TrailerDataError(f"trailer {trailer.seq} names its act without act_seq")
        record = record.replace(acts=(*record.acts, (data.act, data.act_seq)))
    changes = _changes(record, trailer, data)
    if changes:
        record = record.replace(**changes)
    return _with_head(record, trailer, stream_seq, data)


def _changes(record: ProposalRecord, t: Trailer, data: TrailerData) -> dict[str, object]:
    """What one trailer of a proposal's chain says of the record, by its kind."""
    match data:
        case Superseded(superseded_by=by):
            return {"superseded_by": by, "approved_by": None}
        case Approved():
            return {"approved_by": t.actor, "decision": _accepted(record, t, t.actor)}
        case Decided() | Rejected():
            return {"gate_class": t.gate_class, "dispatched_by": None, "dispatched_at": None,
                    "dispatched_seq": None, "decision": _decision(record, t, data)}
        case Inherited(authority=by, revert_proposal_id=rid, revert=revert) if rid is not None:
            return {"approved_by": by or t.actor, "decision": _accepted(record, t, by or t.actor),
                    "revert": revert, "revert_id": rid}
        case Inherited(authority=by) | QuorumReached(authority=by):
            return {"approved_by": by or t.actor, "decision": _accepted(record, t, by or t.actor)}
        case Voted():
            return {"ballots": (*record.ballots, _ballot(t, data))}
        case LkgVerified(revert=revert, revert_proposal_id=rid):
            return {"revert": revert, "revert_id": rid}
        case Dispatched(dispatch="rollback"):
            return {"rollback_dispatched_at": t.at}
        case Dispatched(authority=by):
            return {"dispatched_by": by, "dispatched_at": t.at}
        case Undelivered():
            return {"dispatched_by": None, "dispatched_at": None, "dispatched_seq": None}
        case RollbackAsked():
            return {"rollback_by": t.actor}
        case RolledBack():
            return {"rollback_outcome": _rolled_back(record, t, data)}
        case Applied() | LkgRefused():
            return {"outcome": _outcome(record, t, data)}
        case SignalCounted():
            return {"signals": (*record.signals, _signal(t, data))}
        case Measured(verdict=verdict, value=value):
            return {"measured": verdict, "measured_value": value}
    return {}


def _decision(record: ProposalRecord, t: Trailer, data: Decided | Rejected) -> TriageDecision:
    return TriageDecision(proposal_id=record.proposal_id, service=record.service,
                          verdict=data.verdict, cause=data.cause if isinstance(data, Decided)
                          else None, gate_class=t.gate_class, rationale=t.reason,
                          actor=t.actor, at=t.at)


def _accepted(record: ProposalRecord, t: Trailer, by: str) -> TriageDecision:
    """The decision an approval makes: accepted under `by`."""
    return TriageDecision(proposal_id=record.proposal_id, service=record.service,
                          verdict="accept", cause=None, gate_class=t.gate_class,
                          rationale=t.reason, actor=by, at=t.at)


def _ballot(t: Trailer, v: Voted) -> Ballot:
    return Ballot(keyid=v.keyid, voter=t.actor, session=v.session, vote=v.vote, at=v.voted_at,
                  act=v.act or "", sig=v.sig, read=v.read)


def _rolled_back(record: ProposalRecord, t: Trailer, data: RolledBack) -> ApplyOutcome:
    return ApplyOutcome(proposal_id=record.proposal_id, service=record.service,
                        ok=data.verdict == "rolled_back", applied_id=data.applied,
                        authority=t.actor, error=data.error, at=t.at)


def _outcome(record: ProposalRecord, t: Trailer, data: Applied | LkgRefused) -> ApplyOutcome:
    ok = isinstance(data, Applied) and data.verdict == "applied"
    return ApplyOutcome(
        proposal_id=record.proposal_id, service=record.service, ok=ok,
        applied_id=data.applied, authority=t.actor,
        inverse=data.inverse if isinstance(data, Applied) else None,
        rollbackable=data.rollbackable, error=data.error, at=t.at,
        revert_proposal_id=record.revert_id if ok else None,
        schema_class=schema_class(data.schema_class if isinstance(data, Applied) else None))


def _signal(t: Trailer, s: SignalCounted) -> CountedSignal:
    return CountedSignal(digest=s.signal, kind=s.kind, actor=t.actor, service=s.service,
                         positive=s.positive, at=t.at if s.at is None else s.at,
                         independent=s.independent, name=s.name, value=s.value,
                         emitter=s.emitter)


def same_state(a: ProposalRecord, b: ProposalRecord) -> bool:
    """Equal in everything the chain decides (where its head and its intent sit in the
    stream, and when the record was last touched, aside)."""
    return a.replace(chain=b.chain, updated_at=b.updated_at,
                     dispatched_seq=b.dispatched_seq) == b
