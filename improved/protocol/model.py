"""Every wire message of DESIGN §3 as a msgspec Struct.

Inbound messages forbid unknown fields: a proposal that smuggles in `status` or `rec_status` is
refused by the decoder itself, and a typo never silently changes a proposal's content address.
Optional fields default to None and are omitted on the wire, so re-encoding a decoded message
gives the same canonical content (and the same proposal id).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

ChangeClass = Literal["L0", "L1", "L2", "L3", "L4"]
Scope = Literal["knowledge", "code", "operation", "charter"]
Status = Literal["pending", "approved", "rejected", "applied", "rolled_back", "expired"]
Stage = Literal["observe", "propose", "triage", "apply", "learn-back"]
Verdict = Literal["accept", "defer", "reject"]  # a triage decision's
# Every verdict a trailer may carry (the registration trailer carries none): the triage
# decision's, the signed acts', the apply's, learn-back's, and the mesh chains' own.
TrailerVerdict = Literal[
    "accept", "defer", "reject",  # triage
    "approve", "refused", "superseded", "inherit", "vote", "quorum",  # authority
    "lkg_verified", "dispatched", "undelivered", "applied", "failed", "rollback", "rolled_back", "rollback_failed",  # apply
    "signal", "held", "regressed", "unmeasured",  # learn-back
    "grant", "revoke",  # the grant chain of a skill hash
    "autonomy_on", "autonomy_off", "crisis", "crisis_resolved",  # the autonomy chain
    "checkpoint",  # the checkpoint chain
    "policy",  # the policy chain: the effective policy a daemon started with
    "trust",  # the trust chain: the operator and voter keys a daemon started with
    "tool_call",  # a runtime's tools chain: a call allowed (a refused one is `refused`)
    "ledger",  # a runtime's tools chain: the mark streams it trusts from now on
]
ObserverType = Literal["human", "rec:agent", "rec:policy", "rec:system"]
Cause = Literal[
    "forbidden_target",
    "feedback_collapse",
    "class_mismatch",
    "scope_mismatch",
    "no_grant",
    "awaiting_operator",
    "awaiting_quorum",
    "quorum_dissent",
    "expired",
    "duplicate_rejected",
    "circuit_open",
    "autonomy_off",
    "invalid",
]

Held = Literal["circuit_open", "autonomy_off"]  # the causes that hold autonomous applies back
# The class a schema store says it found for a `schema:` change it applied (SPEC 09 §7.4):
# forward-compatible, breaking (on an operator's own approval), or the recorded reversal of a
# change it applied. Backward is refused, so never applied. A claim for readers, never an input.
SchemaClass = Literal["forward", "breaking", "reversal"]

Millis = Annotated[int, Meta(ge=0, le=2**53)]
ServiceName = Annotated[str, Meta(pattern=r"^[a-z][a-z0-9_-]{0,62}\Z")]
ProposalId = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}\Z",
                                 description="a proposal id (64 lowercase hex)")]
TargetRef = Annotated[str, Meta(pattern=r"^[a-z][a-z0-9+.-]*:.+\Z", max_length=1024)]
# SPEC 07 §3.5.7: `<svc>[:<uuid>]`, `<runtime>:<uuid>[:<seq>]` or `operator:<principal>`.
Actor = Annotated[str, Meta(pattern=r"^[a-z][a-z0-9_-]{0,62}(:[A-Za-z0-9._@+-]{1,128}){0,2}\Z")]
ShortText = Annotated[str, Meta(max_length=500)]


class _In(Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """Base of inbound messages: strict about unknown fields, sparse on output."""


class _Out(Struct, omit_defaults=True, kw_only=True):
    """Base of outbound records."""


# -- proposal -----------------------------------------------------------------------------------


class Origin(_In):
    actor: Actor
    service: ServiceName


class AnalyzerRef(_In):
    # `publisher.name/major`: checked by `propose.validate` (`canonical.analyzer_id_problem`),
    # which names the form, and not here, so a chain registered before the rule still decodes
    id: Annotated[str, Meta(min_length=1, max_length=128)]
    params: dict[str, Any] | None = None


class Summary(_In):
    template_id: Annotated[str, Meta(min_length=1, max_length=128)]
    args: dict[str, Any] = {}


class ProposalEdit(_In):
    format: Annotated[str, Meta(min_length=1, max_length=64)]
    base_digest: Annotated[str, Meta(min_length=1, max_length=128)]
    diff: str


class MetricSnapshot(_In):
    metric: Annotated[str, Meta(min_length=1, max_length=128)]
    baseline: float
    unit: str | None = None
    n: int | None = None
    window: str | None = None
    query: str | None = None
    review_after: Millis | None = None


class Signal(_In):
    """Learn-back evidence (DESIGN §3.3)."""

    kind: Literal["refine", "check", "world", "metric"]
    actor: Actor
    service: ServiceName
    positive: bool
    at: Millis
    proposal_id: ProposalId | None = None
    target_ref: TargetRef | None = None
    name: Annotated[str, Meta(max_length=128)] | None = None
    value: float | None = None


# This project's bound on a proposal's `derived_from` (the evidence it is grounded in). OMS only
# RECOMMENDS at most 64 for a Recommendation grain (a representative set, with an
# `evidence_query` that regenerates the rest); `improved` makes that a rule, so a chain's
# registration and every ApplyOrder stay small whatever a publisher sends.
DERIVED_FROM_LIMIT = 64


class Proposal(_In):
    """A request to change the mesh (DESIGN §3.2). Its content address is the proposal id."""

    service: ServiceName
    target_ref: TargetRef
    change_class: ChangeClass
    scope: Scope
    origin: Origin
    analyzer: AnalyzerRef
    summary: Summary
    created_at: Millis
    proposal_cal: str | None = None
    proposal_edit: ProposalEdit | None = None
    proposal_data: dict[str, Any] | None = None
    signals: Annotated[list[Signal], Meta(max_length=256)] | None = None
    target_files: Annotated[list[Annotated[str, Meta(max_length=1024)]], Meta(max_length=256)] | None = None
    # at most DERIVED_FROM_LIMIT, checked by `propose.validate` with a message that says why
    derived_from: list[str] | None = None
    evidence_query: str | None = None
    metric_snapshot: MetricSnapshot | None = None
    confidence: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    importance: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    severity: Literal["info", "low", "medium", "high"] | None = None
    valid_to: Millis | None = None
    namespace: Annotated[str, Meta(max_length=256)] | None = None
    lkg: list[dict[str, Any]] | None = None
    revert: dict[str, Any] | None = None
    amends: str | None = None
    # OMS Recommendation fields a grain carries and a publisher may send as they are: the type
    # (only "recommendation") and the dedup_key (only the computed one, OMS rule 5). Both are
    # part of every proposal's grain anyway, so `propose.validate` checks and drops them: they
    # never change the proposal id.
    type: Literal["recommendation"] | None = None
    dedup_key: Annotated[str, Meta(max_length=128)] | None = None

    @property
    def action_kind(self) -> str:
        """OMS action kind of the one proposal body: `cal`, `edit` or `data`."""
        if self.proposal_cal is not None:
            return "cal"
        if self.proposal_edit is not None:
            return "edit"
        return "data"


# -- outbound records (retained, DESIGN §3.4) ---------------------------------------------------


class ProposalState(_Out):
    proposal_id: str
    service: str
    target_ref: str
    change_class: ChangeClass
    gate_class: ChangeClass
    scope: Scope
    dedup_key: str
    stage: Stage
    status: Status
    summary_text: str
    updated_at: int
    # the verified identity that signed the proposal (`agent:<svc>:<name>` or `service:<svc>`,
    # the registration trailer's `proposer:` ref); absent when unsigned. For readers only:
    # nothing decides on a retained record, the chain says who proposed
    proposer: str | None = None


class TriageDecision(_Out):
    proposal_id: str
    service: str
    verdict: Verdict
    cause: Cause | None
    gate_class: ChangeClass
    rationale: str
    actor: str
    at: int


class ApplyOutcome(_Out):
    proposal_id: str
    service: str
    ok: bool
    applied_id: str
    authority: str
    inverse: Any = None
    rollbackable: bool = False
    error: str | None = None
    revert_proposal_id: str | None = None
    at: int = 0
    # the owning service's claim (ApplyResult.schema_class), copied as it came: for readers only
    schema_class: SchemaClass | None = None


class LearnBack(_Out):
    proposal_id: str
    service: str
    signals_counted: int
    independent: int
    verdict: str
    at: int
    metric: str | None = None
    baseline: float | None = None
    # what asking the owning service at review_after found: held | regressed | unmeasured
    measured: str | None = None
    value: float | None = None  # the value it answered (none when unmeasured)


class ReviewEntry(_Out):
    """An open item of the operator's queue, retained on `improve.review.<svc>.<id>` while the
    proposal is queued (`core.queue.queued`); an empty message with a TTL replaces it when it
    leaves. It only says where to look: a reader rebuilds the record from its chain."""

    proposal_id: str
    service: str
    since: int  # when the decision it waits on was made (ms)
    valid_to: int | None = None  # the proposal's: when it leaves the queue, expired (ms)


class MeasureDue(_Out):
    """A measurement still to make, retained on `improve.due.<svc>.<id>` from the apply of a
    proposal with `metric_snapshot.review_after` until its learn-back verdict (or its
    rollback); an empty message with a TTL replaces it then. A wake-up list for every replica
    and every restart: the pass it leads to decides from the chain."""

    proposal_id: str
    service: str
    review_after: int  # ms


class IndexMarker(_Out):
    """Retained on `improve.review._filled.records` after a complete refill: the records
    stream and the review index of that incarnation (its creation time) and index format are
    whole."""

    records: str  # IMPROVE_RECORDS' creation time, as STREAM.INFO reports it
    index: int  # the format version of the review and measurement indexes


class DedupHead(Struct, kw_only=True, frozen=True):
    """The value of a key of the dedup bucket (`improved_dedup`, `<svc>.<dedup_key>`): the
    newest proposal registered under that dedup_key, by (`created_at`, `proposal_id`)."""

    proposal_id: str
    created_at: int  # ms, the proposal's own


class LedgerEntry(Struct, kw_only=True, frozen=True):
    """The value of a key of the rejection ledger (`improved_ledger`, `<svc>.<dedup_key>`): an
    operator's rejection of the proposal under that dedup_key. A hint only: it names the
    rejected proposal, whose verified chain says whether it was rejected and on what evidence
    (`triage.rejection_of`); the rest is what an operator reading the bucket sees."""

    proposal_id: str
    principal: str  # the operator who rejected it
    reason: str
    at: int  # ms, the rejection's
    evidence: str  # `triage.evidence_digest` of the rejected proposal


class Sentinel(Struct, kw_only=True, frozen=True):
    """The first message of a stream whose messages expire by their own TTLs (core/retention.py),
    written without a TTL: while it is there, no limit has removed anything after it. Only its
    sequence is read."""

    sentinel: str  # the stream's name
    at: int  # ms, when it was written


class Refusal(Struct, kw_only=True, frozen=True):
    """A refused inbound message, as `improved.refused.<svc>` records it (stream
    IMPROVED_REFUSED): where it came and why it was refused, never its payload, so bad input
    stores nothing of itself."""

    subject: str
    code: str  # the WireError code
    field: str | None  # the field it names, if any
    message: str
    size: int  # bytes
    at: int  # ms, when it was refused


# -- apply dispatch -----------------------------------------------------------------------------


class ApplyOrder(_Out):
    """Daemon → `<svc>.improve.apply`. The service must treat a second order for the same
    proposal_id as the first."""

    proposal_id: str
    proposal: Proposal
    authority: str
    attempt: int


class ApplyResult(Struct, omit_defaults=True, kw_only=True):
    """The service's reply to an ApplyOrder (lenient: services may add fields).

    `schema_class`: for a `schema:` change it applied, the class the owning schema store says
    it found against the schema it held (`forward`, `breaking`, `reversal`). A service's claim,
    recorded on the `applied` trailer and in the ApplyOutcome for auditors to read; nothing in
    the loop decides on it. A value outside those makes the reply invalid, like any bad field."""

    ok: bool
    applied_id: str = ""
    inverse: Any = None
    rollbackable: bool = False
    error: str | None = None
    schema_class: SchemaClass | None = None


class ApplyReport(_In):
    """A service that applied asynchronously reports on `improve.applied.<svc>`."""

    proposal_id: ProposalId
    service: ServiceName
    ok: bool
    applied_id: str = ""
    inverse: Any = None
    rollbackable: bool = False
    error: str | None = None
    at: Millis | None = None
    schema_class: SchemaClass | None = None  # as ApplyResult's: a claim, never an input


# -- request/reply bodies -----------------------------------------------------------------------


class TriageRequest(_In):
    proposal_id: ProposalId


class MeasureRequest(_In):
    """Daemon → `<svc>.improve.measure` at `metric_snapshot.review_after`: run `query` (the
    snapshot's, when it has one) and answer the current value of `metric`."""

    proposal_id: ProposalId
    metric: Annotated[str, Meta(min_length=1, max_length=128)]
    query: str | None = None


class MeasureReply(_In):
    """The owning service's answer to a MeasureRequest (strict: anything else, or an error
    reply, leaves the proposal unmeasured)."""

    value: float


class ClassifyRequest(_In):
    """Anyone → `<svc>.improve.classify` (a schema store's extension): the class of the
    `schema:` change `proposal` asks for, against the schema the owning store holds now. Read
    only: what `improved review` and `show` print before an operator approves."""

    proposal: Proposal


class ClassifyReply(_In):
    """The schema store's answer to a ClassifyRequest (strict: anything else, or an error
    reply, and the class is unknown). A claim shown to the operator, never an input."""

    # reversal: the recorded way back of a change the store applied, which it does not classify
    class_: Literal["forward", "backward", "breaking", "reversal"] = msgspec.field(name="class")
    reason: ShortText


class ProposeReply(_Out):
    proposal_id: str
    status: str


class RefineReply(_Out):
    proposal_id: str
    counted: bool
    independent: bool


class ErrorBody(_Out):
    code: str
    message: str
    field: str | None = None


class ErrorReply(_Out):
    error: ErrorBody


# -- audit (DESIGN §6) --------------------------------------------------------------------------


class Trailer(Struct, omit_defaults=True, kw_only=True):
    """One audit trailer: a transition of one proposal, chained to the previous by `prev`."""

    proposal_id: str
    seq: int
    from_stage: Stage
    to_stage: Stage
    gate_class: ChangeClass
    scope: Scope
    actor: str
    observer_type: ObserverType
    reason: str
    refs: list[str] = []
    at: int
    prev: str
    verdict: TrailerVerdict | None = None
    cause: Cause | None = None
    envelope: Envelope | None = None  # the signed act an authority trailer rests on
    hash: str = ""
    sig: str = ""  # the writing daemon's signature over `hash`: `<b64 public key>.<b64 sig>`


class TrailerCommit(Struct, kw_only=True):
    """Several trailers of one chain appended in one message, in order: what one pass of the
    daemon decided together (a registration, its triage decision and the dispatch intent, say).
    Each is hashed, linked and signed as if it had a message of its own; the message is the
    unit of the append, so its expected-last-subject-sequence arbitrates the whole commit."""

    trailers: list[Trailer]


# -- signed operator acts (DESIGN §5.2), payloads of DSSE envelopes ------------------------------


class DsseSignature(_In):
    keyid: str
    sig: str


class Envelope(_In):
    payloadType: str  # noqa: N815 - DSSE field name
    payload: str
    signatures: list[DsseSignature]


class Review(_In):
    proposal_id: ProposalId
    verdict: Literal["approve", "reject", "rollback"]
    principal: Actor
    reason: ShortText
    at: Millis
    # what the operator saw: `authority.will_run_digest` of the proposal (body, last-known-good,
    # reversal); required to approve an L4 that carries its own reversal body
    body_digest: Annotated[str, Meta(pattern=r"^[0-9a-f]{64}\Z")] | None = None


class GrantCommand(_In):
    """An L3 grant (trust on first use, SPEC 09 §3) or its revocation for one skill hash. A
    grant names `proposal_id`: the L2 proposal whose approved, applied definition it trusts —
    the only place TOFU is granted."""

    op: Literal["grant", "revoke"]
    skill: Annotated[str, Meta(pattern=r"^[a-z][a-z0-9_-]{0,62}:[0-9a-f]{64}\Z")]
    principal: Actor
    reason: ShortText
    at: Millis
    expires_at: Millis | None = None
    proposal_id: ProposalId | None = None


class Vote(_In):
    """A quorum vote (SPEC 09 §6), the payload of a DSSE envelope on `improve.quorum`. `read`
    names what the voter read: `proposal:<id>`, `diff:…`, `triage:…`, `spec:…`."""

    proposal_id: ProposalId
    vote: Literal["approve", "dissent"]
    voter: Actor
    session: Annotated[str, Meta(min_length=1, max_length=256)]
    read: Annotated[list[Annotated[str, Meta(min_length=1, max_length=512)]], Meta(max_length=32)]
    at: Millis


class CrisisAct(_In):
    """An operator's signed resolution of a crisis (constitution V.4: no self-absolution)."""

    op: Literal["resolve"]
    crisis: Annotated[str, Meta(min_length=1, max_length=128)]
    principal: Actor
    reason: ShortText
    at: Millis


class Grant(_Out):
    """Retained on `improve.grants.<name>.<sha256>`: active, or revoked."""

    skill: str
    active: bool
    principal: str
    reason: str
    at: int
    expires_at: int | None = None


class QuorumBallot(_Out):
    voter: str
    keyid: str
    session: str
    vote: str
    read: list[str]
    at: int
    sig: str


class QuorumRecord(_Out):
    """Retained and immutable on `improve.quorum.<id>` once the quorum decided: who voted,
    when, from which session, with which signature."""

    proposal_id: str
    service: str
    outcome: str  # approved | deferred (a dissent defers to an operator)
    approvals: int
    dissents: int
    votes: list[QuorumBallot]
    at: int


json_encoder = msgspec.json.Encoder()


def to_json(obj: Any) -> bytes:
    return json_encoder.encode(obj)
