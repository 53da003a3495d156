"""What each audit trailer says, typed: one Struct per trailer kind, decoded once from the
trailer's `refs` and encoded into them when a draft is made (DESIGN §6, docs/protocol.md
"Audit trailers").

The wire is unchanged: `refs` stay `name:value` strings, in the order written, hashed as they
are. A field's type says how its value is written: a `str` as it is, a `bool` as
`true`/`false`, anything else as JSON with sorted keys (a registration's `proposal:` as the
proposal's own JSON). A field in `MANY` is one ref per item (`keyid:` of a quorum), `index:`
moves (`core.indexes`) come last on any trailer, and `REST` collects every ref no field names
(the policy trailer's changed keys). `verdict` and `cause` are the trailer's own fields, not
refs. Decoding takes the first ref of a name, as readers always have; a ref a field cannot
hold is a `TrailerDataError` (a `ValueError`). A trailer of no kind this version knows is
`Unknown`: its refs kept, nothing read from them.

Adding a trailer kind: a Struct here with its `STAGE` and `verdict`, its row in `VERDICTS`
(which says the status it moves to), and, when it changes a proposal's record, one case in
`core.record.fold` (docs/architecture.md, "The trailer is the only way a record changes").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, ClassVar, Final, Literal, Protocol, TypeVar, cast

import msgspec
from msgspec import Struct

from improved.protocol.model import Cause, Proposal, Stage, Status, TrailerVerdict

D = TypeVar("D", bound="Data")


class TrailerDataError(ValueError):
    """A trailer's refs are not the data of its kind (or it is of no kind known here)."""


class Data(Struct, frozen=True, kw_only=True):
    """What a trailer of one kind says beyond its generic fields."""

    STAGE: ClassVar[Stage]
    MANY: ClassVar[frozenset[str]] = frozenset()  # one ref per item
    REST: ClassVar[str | None] = None  # the field that takes every other ref, by name
    # the trailer's membership moves (`index:+review`), written last by the shell
    index: tuple[str, ...] = ()


class Signed(Data, frozen=True, kw_only=True):
    """A trailer recording a signed act: its envelope digest and the stream sequence the act
    arrived at (a redelivery and a replay are told apart by them, `authority.seen`). Every
    daemon writes both; a chain without them records no act."""

    act: str | None = None
    act_seq: int | None = None


# -- a proposal's chain ----------------------------------------------------------------------


class Registration(Data, frozen=True, kw_only=True):
    """The first trailer: the proposal itself, whose content address is the chain's id."""

    STAGE: ClassVar[Stage] = "propose"
    verdict: None = None
    analyzer: str
    dedup_key: str
    proposal: Proposal
    proposer: str | None = None  # the verified identity that signed it


class Decided(Data, frozen=True, kw_only=True):
    """A triage decision: the guards and the class gate (or a quorum's dissent)."""

    STAGE: ClassVar[Stage] = "triage"
    verdict: Literal["accept", "defer", "reject"]
    cause: Cause | None = None


class Approved(Signed, frozen=True, kw_only=True):
    """An operator's signed approval."""

    STAGE: ClassVar[Stage] = "triage"
    verdict: Literal["approve"] = "approve"
    keyid: str | None = None


class Rejected(Signed, frozen=True, kw_only=True):
    """An operator's signed rejection (a `reject` decision without a cause)."""

    STAGE: ClassVar[Stage] = "triage"
    verdict: Literal["reject"] = "reject"
    keyid: str | None = None


class Refused(Signed, frozen=True, kw_only=True):
    """A signed act that did not count, and why (`code`); on a proposal's or a grant chain."""

    STAGE: ClassVar[Stage] = "triage"
    verdict: Literal["refused"] = "refused"
    code: str
    keyid: str | None = None


class Superseded(Data, frozen=True, kw_only=True):
    STAGE: ClassVar[Stage] = "triage"
    verdict: Literal["superseded"] = "superseded"
    superseded_by: str


class Inherited(Data, frozen=True, kw_only=True):
    """An L4 reversal runs under its original's approval."""

    STAGE: ClassVar[Stage] = "triage"
    verdict: Literal["inherit"] = "inherit"
    inherits: str | None = None
    authority: str | None = None  # written by every daemon; without it, the trailer's actor
    # the reversal's own reversal, generated and validated before it runs (absent before)
    revert_proposal_id: str | None = None
    revert: Proposal | None = None


class Voted(Signed, frozen=True, kw_only=True):
    """A counted quorum vote."""

    STAGE: ClassVar[Stage] = "triage"
    verdict: Literal["vote"] = "vote"
    keyid: str = ""
    session: str = ""
    vote: str = ""
    voted_at: int = 0
    sig: str = ""
    read: tuple[str, ...] = ()


class QuorumReached(Data, frozen=True, kw_only=True):
    """The quorum approved, under `authority`, with the keys of the approving votes."""

    STAGE: ClassVar[Stage] = "triage"
    MANY: ClassVar[frozenset[str]] = frozenset({"keyid"})
    verdict: Literal["quorum"] = "quorum"
    authority: str | None = None  # written by every daemon; without it, the trailer's actor
    keyid: tuple[str, ...] = ()


class LkgVerified(Data, frozen=True, kw_only=True):
    """Every artefact of an L4 has a healthy last-known-good; its reversal, recorded."""

    STAGE: ClassVar[Stage] = "apply"
    verdict: Literal["lkg_verified"] = "lkg_verified"
    lkg: Any = None
    revert_proposal_id: str
    revert: Proposal
    answered_by: str | None = None


class Dispatched(Data, frozen=True, kw_only=True):
    """The intent: an ApplyOrder (`dispatch: apply`) or a rollback order is about to leave."""

    STAGE: ClassVar[Stage] = "apply"
    verdict: Literal["dispatched"] = "dispatched"
    dispatch: str = "apply"
    order: str | None = None
    authority: str | None = None


class Undelivered(Data, frozen=True, kw_only=True):
    """The order just dispatched provably reached no service: the dispatch is void."""

    STAGE: ClassVar[Stage] = "apply"
    verdict: Literal["undelivered"] = "undelivered"
    order: str | None = None
    error: str | None = None


class Applied(Data, frozen=True, kw_only=True):
    """The owning service's answer to the ApplyOrder: applied, or failed."""

    STAGE: ClassVar[Stage] = "apply"
    verdict: Literal["applied", "failed"]
    applied: str = ""
    rollbackable: bool = False
    answered_by: str | None = None
    revert_proposal_id: str | None = None
    schema_class: str | None = None  # the service's claim, for auditors
    inverse: Any = None
    error: str | None = None


class LkgRefused(Data, frozen=True, kw_only=True):
    """A failed apply before any order: no healthy last-known-good (or no valid reversal).
    Written as a service's failure is, with who answered last."""

    STAGE: ClassVar[Stage] = "apply"
    verdict: Literal["failed"] = "failed"
    applied: str = ""
    rollbackable: bool = False
    error: str
    answered_by: str | None = None


class RollbackAsked(Signed, frozen=True, kw_only=True):
    """An operator's signed request for the recorded inverse."""

    STAGE: ClassVar[Stage] = "apply"
    verdict: Literal["rollback"] = "rollback"
    keyid: str | None = None


class RolledBack(Data, frozen=True, kw_only=True):
    """The owning service's answer to a rollback order (or the original of a rollback
    proposal that was applied)."""

    STAGE: ClassVar[Stage] = "apply"
    verdict: Literal["rolled_back", "rollback_failed"]
    applied: str = ""
    inverse_of: str | None = None
    answered_by: str | None = None
    error: str | None = None


class SignalCounted(Data, frozen=True, kw_only=True):
    """A learn-back signal, counted once by its digest, with its independence."""

    STAGE: ClassVar[Stage] = "learn-back"
    verdict: Literal["signal"] = "signal"
    signal: str
    kind: str = ""
    service: str = ""
    positive: bool = False
    independent: bool = False
    at: int | None = None  # the signal's own time (older chains: the trailer's)
    emitter: str = ""
    name: str | None = None
    value: float | None = None


class Measured(Data, frozen=True, kw_only=True):
    """What asking the owning service at review_after found."""

    STAGE: ClassVar[Stage] = "learn-back"
    verdict: Literal["held", "regressed", "unmeasured"]
    metric: str | None = None
    baseline: float | None = None
    measured_by: str | None = None
    query: str | None = None
    # why there was no value: a `cause:` ref, not the trailer's own `cause`
    why: str | None = msgspec.field(default=None, name="cause")
    value: float | None = None
    rollback_proposal: str | None = None
    answered_by: str | None = None


# -- the mesh chains -------------------------------------------------------------------------


class GrantAct(Signed, frozen=True, kw_only=True):
    """A counted grant or revoke of an L3 skill hash, on that hash's grant chain."""

    STAGE: ClassVar[Stage] = "triage"
    verdict: Literal["grant", "revoke"]
    keyid: str | None = None
    skill: str
    l2: str | None = None
    expires_at: int | None = None


class AutonomyState(Data, frozen=True, kw_only=True):
    """A trailer of the autonomy chain: the whole state after it (constitution IV.5, IV.6)."""

    STAGE: ClassVar[Stage] = "learn-back"
    verdict: Literal["rollback", "autonomy_on", "autonomy_off", "crisis", "crisis_resolved"]
    rollbacks: tuple[int, ...] = ()
    paused_until: int = 0
    autonomy: str = "on"
    crisis: str = ""
    proposal: str | None = None  # the autonomous apply rolled back
    act: str | None = None  # a resolution's signed act
    keyid: str | None = None
    resolved: str | None = None  # the crisis a resolution clears


class CheckpointMade(Data, frozen=True, kw_only=True):
    """A signed checkpoint over the audit stream (`core.checkpoint`)."""

    STAGE: ClassVar[Stage] = "learn-back"
    verdict: Literal["checkpoint"] = "checkpoint"
    count: int
    root: str
    last_seq: int
    checkpoint_at: int
    keyid: str
    public: str
    sig: str
    frontier: Any = None
    last_hash: str = ""
    runtime_heads: Any = None
    members: Any = None


class EpochSealed(Data, frozen=True, kw_only=True):
    """The seal of an epoch of the audit stream (`core.epochs`)."""

    STAGE: ClassVar[Stage] = "learn-back"
    verdict: Literal["checkpoint"] = "checkpoint"
    epoch: int
    upto: int
    count: int
    root: str
    removable: int
    checkpoint_at: int
    keyid: str
    public: str
    sig: str
    frontier: tuple[str, ...]
    last_hash: str = ""


class PolicyInForce(Data, frozen=True, kw_only=True):
    """The effective policy a daemon started with: its digest, and each key that differs from
    the default (`<key>:<JSON value>`)."""

    STAGE: ClassVar[Stage] = "learn-back"
    REST: ClassVar[str | None] = "changed"
    verdict: Literal["policy"] = "policy"
    digest: str | None = None
    changed: dict[str, Any] = {}


class TrustInForce(Data, frozen=True, kw_only=True):
    """The operator, voter and signer keys a daemon started with, and what changed."""

    STAGE: ClassVar[Stage] = "learn-back"
    verdict: Literal["trust"] = "trust"
    operators: dict[str, str] = {}
    voters: dict[str, str] = {}
    signers: dict[str, str] = {}
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()


class _ToolTrailer(Data, frozen=True, kw_only=True):
    """What every trailer of a runtime's `_tools` chain names: the runtime, and the ledger
    streams it trusts (`tools.LEDGER_STREAMS`)."""

    STAGE: ClassVar[Stage] = "apply"
    runtime: str = ""


class ToolCall(_ToolTrailer, frozen=True, kw_only=True):
    """A tool call the runtime allowed: what allowed it, and the signed act that did."""

    verdict: Literal["tool_call"] = "tool_call"
    tool: str = ""
    class_: str = msgspec.field(default="", name="class")
    token: str = ""
    args: str = ""
    spent_stream: str | None = None
    revoked_stream: str | None = None
    audit_stream: str | None = None
    session: str | None = None
    via: str | None = None
    act: str | None = None
    act_id: str | None = None
    proof: str | None = None
    proof_at: str | None = None
    proof_nonce: str | None = None
    proof_sig: str | None = None
    session_key: str | None = None


class ToolRefused(_ToolTrailer, frozen=True, kw_only=True):
    """A tool call the runtime refused, and why."""

    verdict: Literal["refused"] = "refused"
    tool: str = ""
    class_: str = msgspec.field(default="", name="class")
    token: str = ""
    args: str = ""
    spent_stream: str | None = None
    revoked_stream: str | None = None
    audit_stream: str | None = None
    session: str | None = None
    refused: str | None = None


class LedgerTrusted(_ToolTrailer, frozen=True, kw_only=True):
    """The ledger streams a runtime trusts from now on."""

    verdict: Literal["ledger"] = "ledger"
    spent_stream: str | None = None
    revoked_stream: str | None = None
    audit_stream: str | None = None


class Unknown(Data, frozen=True, kw_only=True):
    """A trailer of a stage and verdict no kind here has (a chain of another version): its
    refs kept as they are, and nothing read from them."""

    STAGE: ClassVar[Stage] = "observe"
    verdict: str | None = None
    cause: str | None = None
    raw: tuple[str, ...] = ()


TrailerData = (Registration | Decided | Approved | Rejected | Refused | Superseded | Inherited
               | Voted | QuorumReached | LkgVerified | Dispatched | Undelivered | Applied
               | LkgRefused | RollbackAsked | RolledBack | SignalCounted | Measured | GrantAct
               | AutonomyState | CheckpointMade | EpochSealed | PolicyInForce | TrustInForce
               | ToolCall | ToolRefused | LedgerTrusted | Unknown)

# The one table of verdicts: (to_stage, verdict) → the kind of such a trailer and the status it
# moves a proposal to (None: it keeps the status). The few kinds that share a row are told
# apart by their refs (`kind_of`); `status_after` adds three rules: any registration is
# `pending`, a rejection whose cause is `expired` is `expired`, and a supersession takes an
# approval back to `pending`. `record.LIFECYCLE` is which changes a chain may make.
VERDICTS: Final[Mapping[tuple[Stage, str | None], tuple[type[Data], Status | None]]] = {
    ("propose", None): (Registration, "pending"),
    ("triage", "accept"): (Decided, None),
    ("triage", "defer"): (Decided, None),
    ("triage", "reject"): (Decided, "rejected"),  # or Rejected: an operator's, signed
    ("triage", "approve"): (Approved, "approved"),
    ("triage", "refused"): (Refused, None),
    ("triage", "superseded"): (Superseded, None),  # approved → pending
    ("triage", "inherit"): (Inherited, "approved"),
    ("triage", "vote"): (Voted, None),
    ("triage", "quorum"): (QuorumReached, "approved"),
    ("triage", "grant"): (GrantAct, None),
    ("triage", "revoke"): (GrantAct, None),
    ("apply", "lkg_verified"): (LkgVerified, None),
    ("apply", "dispatched"): (Dispatched, None),
    ("apply", "undelivered"): (Undelivered, None),
    ("apply", "applied"): (Applied, "applied"),
    ("apply", "failed"): (Applied, None),  # or LkgRefused: before any order
    ("apply", "rollback"): (RollbackAsked, None),
    ("apply", "rolled_back"): (RolledBack, "rolled_back"),
    ("apply", "rollback_failed"): (RolledBack, None),
    ("apply", "tool_call"): (ToolCall, None),
    ("apply", "refused"): (ToolRefused, None),
    ("apply", "ledger"): (LedgerTrusted, None),
    ("learn-back", "signal"): (SignalCounted, None),
    ("learn-back", "held"): (Measured, None),
    ("learn-back", "regressed"): (Measured, None),
    ("learn-back", "unmeasured"): (Measured, None),
    ("learn-back", "rollback"): (AutonomyState, None),
    ("learn-back", "autonomy_on"): (AutonomyState, None),
    ("learn-back", "autonomy_off"): (AutonomyState, None),
    ("learn-back", "crisis"): (AutonomyState, None),
    ("learn-back", "crisis_resolved"): (AutonomyState, None),
    ("learn-back", "checkpoint"): (CheckpointMade, None),  # or EpochSealed: an epoch's seal
    ("learn-back", "policy"): (PolicyInForce, None),
    ("learn-back", "trust"): (TrustInForce, None),
}
KINDS: Final[Mapping[tuple[Stage, str | None], type[Data]]] = {
    row: kind for row, (kind, _) in VERDICTS.items()}
STATUS: Final[Mapping[tuple[Stage, str | None], Status]] = {
    row: status for row, (_, status) in VERDICTS.items() if status is not None}


class Transition(Protocol):
    """What of a trailer moves the status: a Trailer, or a trailer read only as far."""

    @property
    def to_stage(self) -> str: ...

    @property
    def verdict(self) -> str | None: ...

    @property
    def cause(self) -> str | None: ...


def moves_to(data: Data) -> Status | None:
    """The status a trailer saying `data` moves its proposal to by its kind (STATUS), or
    None: applied, rolled back, approved, rejected (or expired)."""
    return STATUS.get((data.STAGE, verdict_of(data)))


def status_after(status: Status, t: Transition) -> Status:
    """The lifecycle status after one trailer: the whole of how status is derived (VERDICTS)."""
    if t.to_stage == "propose":
        return "pending"  # whatever its verdict says
    if t.to_stage == "triage" and t.verdict == "superseded":
        # an approval never carries to content nobody reviewed
        return "pending" if status == "approved" else status
    after = STATUS.get((cast("Stage", t.to_stage), t.verdict))
    if after == "rejected" and t.cause == "expired":
        return "expired"
    return status if after is None else after


# -- the codec -------------------------------------------------------------------------------


def ref(name: str, value: object, *, as_json: bool = False) -> str:
    """One ref as the wire has it, written by hand (`encode` writes a kind's): `name:value`,
    a value other than a string as JSON (`as_json`: a string too)."""
    if as_json or not isinstance(value, str | bool):
        value = msgspec.json.encode(value, order="sorted").decode()
    elif isinstance(value, bool):
        value = "true" if value else "false"
    return f"{name}:{value}"


class HasRefs(Protocol):
    """Anything that carries a trailer's refs: a Trailer, or a trailer decoded only as far."""

    @property
    def refs(self) -> Sequence[str]: ...


def refs_of(trailer: HasRefs) -> dict[str, str]:
    """A trailer's refs as written, by name (the first of a name wins): what a reader of the
    wire sees, before `decode` says what they mean."""
    out: dict[str, str] = {}
    for r in trailer.refs:
        name, _, value = r.partition(":")
        out.setdefault(name, value)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    name: str  # the attribute
    ref: str  # the ref's name (and the field's encoded name)
    how: Literal["str", "bool", "json", "struct", "many"]
    type: Any
    required: bool


_TOP: Final = frozenset({"verdict", "cause"})  # the trailer's own fields, not refs
INDEX: Final = "index"


@cache
def _fields(cls: type[Data]) -> tuple[_Field, ...]:
    """The ref fields of `cls` in the order they are written (but `index` and `REST`)."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    hints = {f.name: f.type for f in msgspec.structs.fields(cls)}
    skip = _TOP | {INDEX, cls.REST, "raw"}
    return tuple(_Field(f.name, f.encode_name, _how(cls, f.name, f.type), hints[f.name],
                        f.required)
                 for f in info.fields if f.name not in skip)


def _how(cls: type[Data], name: str, t: msgspec.inspect.Type) -> Literal[
        "str", "bool", "json", "struct", "many"]:
    if name in cls.MANY:
        return "many"
    inner = [x for x in (t.types if isinstance(t, msgspec.inspect.UnionType) else (t,))
             if not isinstance(x, msgspec.inspect.NoneType)]
    if len(inner) == 1 and isinstance(inner[0], msgspec.inspect.StrType):
        return "str"
    if len(inner) == 1 and isinstance(inner[0], msgspec.inspect.BoolType):
        return "bool"
    if cls is Registration and name == "proposal":
        return "struct"  # the proposal's own JSON, in its field order (`to_json`)
    return "json"


def _text(how: str, value: Any) -> str:
    if how == "str":
        return str(value)
    if how == "bool":
        return "true" if value else "false"
    if how == "struct":
        return msgspec.json.encode(value).decode()
    return msgspec.json.encode(value, order="sorted").decode()


def encode(data: Data) -> tuple[str, ...]:
    """The refs `data` is written as, in order."""
    if isinstance(data, Unknown):
        return data.raw
    cls = type(data)
    out: list[str] = []
    for f in _fields(cls):
        value = getattr(data, f.name)
        if f.how == "many":
            out += [f"{f.ref}:{v}" for v in value]
        elif value is not None:
            out.append(f"{f.ref}:{_text(f.how, value)}")
    if cls.REST is not None:
        out += [f"{name}:{_text('json', v)}" for name, v in getattr(data, cls.REST).items()]
    out += [f"{INDEX}:{v}" for v in data.index]
    return tuple(out)


class Trailerish(Protocol):
    """Anything with a trailer's kind-deciding fields and its refs."""

    @property
    def to_stage(self) -> str: ...

    @property
    def verdict(self) -> str | None: ...

    @property
    def cause(self) -> str | None: ...

    @property
    def refs(self) -> Sequence[str]: ...


def kind_of(t: Trailerish) -> type[Data]:
    """The kind of trailer `t` is (`Unknown` for one no kind of this version has)."""
    kind = KINDS.get((cast("Stage", t.to_stage), t.verdict), Unknown)
    names = [r.partition(":")[0] for r in t.refs if isinstance(r, str)]
    if kind is Decided and t.verdict == "reject" and "act" in names:
        return Rejected
    if kind is Applied and t.verdict == "failed" and _after(names, "answered_by", "error"):
        return LkgRefused
    if kind is CheckpointMade and "epoch" in names:
        return EpochSealed
    return kind


def _after(names: list[str], later: str, earlier: str) -> bool:
    return later in names and earlier in names and names.index(later) > names.index(earlier)


def decode(t: Trailerish) -> TrailerData:
    """The typed data of trailer `t`, read once from its refs."""
    return cast("TrailerData", decode_as(kind_of(t), t.refs, t.verdict, t.cause))


class _Body(Struct):
    """A raw trailer body read only as far as its kind and refs."""

    to_stage: str = ""
    verdict: str | None = None
    cause: str | None = None
    refs: list[str] = []


def decode_body(body: object, as_: type[D] | None = None) -> D | TrailerData:
    """The typed data of a trailer body as a reader got it (JSON, or its builtins), however
    little of a trailer it is: TrailerDataError when it is none. `as_`: read it as that kind,
    whatever its stage and verdict say (a reader of one mesh chain knows what it holds)."""
    try:
        shape = msgspec.convert(body, _Body)
    except msgspec.ValidationError as exc:
        raise TrailerDataError(f"not a trailer: {exc}") from None
    if as_ is not None:
        return cast(D, decode_as(as_, shape.refs, shape.verdict, shape.cause))
    return decode(shape)


def kind_of_body(body: object) -> type[Data]:
    """The kind of a raw trailer body by its stage, verdict and ref names, reading none of
    its values (`Unknown` for what is no trailer)."""
    try:
        return kind_of(msgspec.convert(body, _Body))
    except msgspec.ValidationError:
        return Unknown


def body_as(cls: type[D], body: object) -> D:
    """`body` read as the data of `cls` (`decode_body`)."""
    return cast(D, decode_body(body, cls))


def decode_as(cls: type[Data], refs: Sequence[str], verdict: str | None = None,
              cause: str | None = None) -> Data:
    """`refs` read as the data of `cls` (with the trailer's `verdict` and `cause`)."""
    if cls is Unknown:
        return Unknown(verdict=verdict, cause=cause, raw=tuple(refs))
    first: dict[str, str] = {}
    every: dict[str, list[str]] = {}
    for r in refs:
        if not isinstance(r, str):
            raise TrailerDataError(f"a ref is not a string: {r!r}")
        name, _, value = r.partition(":")
        first.setdefault(name, value)
        every.setdefault(name, []).append(value)
    values: dict[str, Any] = {INDEX: tuple(every.get(INDEX, ()))}
    for f in _fields(cls):
        if f.how == "many":
            values[f.name] = tuple(every.get(f.ref, ()))
        elif f.ref in first:
            values[f.name] = _parse(cls, f, first[f.ref])
        elif f.required:
            raise TrailerDataError(f"a {cls.__name__} trailer carries no {f.ref}: ref")
    if cls.REST is not None:
        known = {f.ref for f in _fields(cls)} | {INDEX}
        values[cls.REST] = {name: _json(cls, name, value, Any) for name, value in first.items()
                            if name not in known}
    words = _words(cls)
    if "verdict" in words and verdict is not None:
        values["verdict"] = verdict
    if "cause" in words:
        values["cause"] = cause
    for field, value in values.items():
        allowed = words.get(field)
        if allowed is not None and value not in allowed:
            raise TrailerDataError(f"a {cls.__name__} trailer's {field} is not one of "
                                   f"{sorted(map(str, allowed))}: {value!r}")
    try:
        return cls(**values)  # each value is of its field's type: read by that type above
    except TypeError as exc:  # a required verdict the trailer does not carry
        raise TrailerDataError(f"a {cls.__name__} trailer: {exc}") from None


@cache
def _words(cls: type[Data]) -> dict[str, frozenset[object]]:
    """The trailer's own fields of `cls` (`verdict`, `cause`), each with the values its type
    allows (a Literal, or None)."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    out: dict[str, frozenset[object]] = {}
    for f in info.fields:
        if f.name in _TOP:
            types = f.type.types if isinstance(f.type, msgspec.inspect.UnionType) else (f.type,)
            out[f.name] = frozenset(
                v for t in types
                for v in (t.values if isinstance(t, msgspec.inspect.LiteralType)
                          else (None,) if isinstance(t, msgspec.inspect.NoneType) else ()))
    return out


def _parse(cls: type[Data], f: _Field, text: str) -> Any:
    if f.how == "str":
        return text
    if f.how == "bool":
        return text == "true"
    return _json(cls, f.ref, text, f.type)


def _json(cls: type[Data], name: str, text: str, type_: Any) -> Any:
    try:
        return msgspec.json.decode(text, type=type_)
    except msgspec.MsgspecError as exc:
        raise TrailerDataError(f"a {cls.__name__} trailer's {name}: ref: {exc}") from None


def verdict_of(data: Data) -> TrailerVerdict | None:
    return cast("TrailerVerdict | None", getattr(data, "verdict", None))
