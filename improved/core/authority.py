"""Operator authority: what a signed review does to a proposal (DESIGN §5.2, §4).

Pure: (record, the act as received, the verdict of the signature check, the clock) → a
transition. Every act that reaches a known proposal leaves a trailer — an approval or a
rejection that counts, or a refusal that says why — and only the counting ones move the status.
A JetStream redelivery (same envelope, same stream sequence) is recognised and changes nothing;
the same envelope offered again under a new sequence is a replay and is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, overload

import msgspec

from improved.core.audit import REASON_LIMIT, Draft, draft_of
from improved.core.record import ProposalRecord, status_at
from improved.core.signing import ActRefused, TrustStore, Verified
from improved.core.trailers import (
    KINDS,
    Approved,
    GrantAct,
    Refused,
    Rejected,
    RollbackAsked,
    Signed,
    decode,
)
from improved.protocol import canonical
from improved.protocol.model import (
    Envelope,
    Grant,
    GrantCommand,
    Proposal,
    Review,
    Trailer,
)

CLOCK_SKEW_MS = 5 * 60 * 1000
REVIEWABLE_CAUSES = frozenset({"awaiting_operator", "no_grant", "awaiting_quorum",
                               "quorum_dissent"})  # an operator may always decide instead


def is_waiting(record: ProposalRecord | None, now: int | None = None) -> bool:
    """Waiting for an operator (or a quorum): pending, not superseded, its last decision a
    defer with a reviewable cause — and, as of `now` when given, not expired
    (`record.status_at`). The one definition of it: what an approval needs, and (with
    surfaced L1 proposals) the operator's queue, `core.queue.queued`."""
    if record is None or record.status != "pending" or record.superseded_by is not None:
        return False
    if now is not None and status_at(record, now) != "pending":
        return False
    d = record.decision
    return d is not None and d.verdict == "defer" and d.cause in REVIEWABLE_CAUSES


def will_run(p: Proposal) -> dict[str, Any]:
    """What an approval lets run, as the operator (or a voter) must see it: the body (CAL,
    edit or data), the last-known-good artefacts, and the reversal an L4 will run later under
    the same approval — the proposer's own, or (None) one derived from the last-known-good."""
    return {"cal": p.proposal_cal, "edit": msgspec.to_builtins(p.proposal_edit),
            "data": p.proposal_data, "lkg": p.lkg, "revert": p.revert}


def will_run_digest(p: Proposal) -> str:
    """The digest an approval (`Review.body_digest`) and a vote (`diff:`) name."""
    return canonical.digest(will_run(p))


@dataclass(frozen=True)
class Act:
    """A signed act as received: its digest and where the stream put it."""

    digest: str
    stream_seq: int


class SignedBody(Protocol):
    """The payload of a signed act: it says when it was signed."""

    @property
    def at(self) -> int: ...


class PrincipalBody(SignedBody, Protocol):
    """A signed act that names the principal it speaks for (a review, a grant, a crisis act)."""

    @property
    def principal(self) -> str: ...


B = TypeVar("B", bound=SignedBody)
P = TypeVar("P", bound=PrincipalBody)


@overload
def check_signed(trust: TrustStore, env: Envelope, payload_type: str, decode_as: type[P],
                 now: int, max_age_ms: int) -> tuple[Verified, P]: ...


@overload
def check_signed(trust: TrustStore, env: Envelope, payload_type: str, decode_as: type[B],
                 now: int, max_age_ms: int, principal_of: Callable[[B], str]
                 ) -> tuple[Verified, B]: ...


def check_signed(trust: TrustStore, env: Envelope, payload_type: str, decode_as: type[B],
                 now: int, max_age_ms: int, principal_of: Callable[[B], str] | None = None
                 ) -> tuple[Verified, B]:
    """Verify signature, payload, principal binding and freshness; raise ActRefused.
    `principal_of` says whom the act speaks for; by default its `principal` field."""
    verified = trust.verify(env, payload_type)
    try:
        act = msgspec.json.decode(verified.payload, type=decode_as)
    except msgspec.MsgspecError as exc:
        raise ActRefused("malformed", f"the signed payload is not a valid act: {exc}") from None
    claimed = principal_of(act) if principal_of is not None else _named_principal(act)
    if claimed != verified.principal:
        raise ActRefused("principal_mismatch", f"signed by the key of {verified.principal}, "
                         f"but speaks for {claimed}")
    if act.at < now - max_age_ms or act.at > now + CLOCK_SKEW_MS:
        raise ActRefused("expired", f"signed at {act.at}, outside the accepted window")
    return verified, act


def _named_principal(act: SignedBody) -> str:
    """The `principal` field of an act; an act type without one needs a `principal_of`."""
    principal = getattr(act, "principal", None)
    if not isinstance(principal, str):
        raise TypeError(f"{type(act).__name__} names no principal: pass principal_of")
    return principal


def seen(record: ProposalRecord, act: Act) -> str | None:
    """`redelivery` when this very message was handled, `replay` when the envelope was."""
    if (act.digest, act.stream_seq) in record.acts:
        return "redelivery"
    if any(d == act.digest for d, _ in record.acts):
        return "replay"
    return None


MAX_REFUSED_ACTS = 32  # refusals of unverified acts one chain records; later ones are only logged


def unrecorded(record: ProposalRecord, act: Act, verified: bool) -> str | None:
    """Why a refusal of `act` is not worth a trailer (it is logged instead), or None. Anyone
    can replay a captured envelope or publish junk naming a proposal: a replay is recorded
    once per envelope, and a chain records at most MAX_REFUSED_ACTS unverified acts, so no
    sender can grow a victim's chain without bound."""
    if sum(1 for d, _ in record.acts if d == act.digest) >= 2:
        return "this envelope's replay is already on the chain"
    if not verified and len(record.acts) >= MAX_REFUSED_ACTS:
        return f"the chain already records {MAX_REFUSED_ACTS} acts"
    return None


def refusal(record: ProposalRecord, act: Act, code: str, why: str, actor: str,
            keyid: str | None = None) -> Draft:
    """A signed act that does not count: recorded with why, so it is seen once (`seen`)."""
    return draft_of(Refused(act=act.digest, act_seq=act.stream_seq, code=code,
                            keyid=keyid or None),
                    record.stage, actor, "rec:system",
                    f"signed act refused ({code}): {why}"[:REASON_LIMIT])


def review(record: ProposalRecord, act: Act, verified: Verified, rv: Review, superseded: bool,
           actor: str, now: int) -> Draft:
    """The transition a verified review makes: approve, reject, or a refusal with its reason."""
    if rv.proposal_id != record.proposal_id:
        return refusal(record, act, "wrong_proposal", f"the review is for {rv.proposal_id}",
                       actor, verified.keyid)
    if rv.verdict == "rollback":
        if record.status != "applied" or record.rollback_by is not None:
            return refusal(record, act, "not_applied", f"nothing to roll back (status "
                           f"{record.status})", actor, verified.keyid)
        if not (record.outcome and (record.outcome.rollbackable or record.revert_id)):
            return refusal(record, act, "not_rollbackable", "the apply was recorded as not "
                           "rollbackable: it has no inverse", actor, verified.keyid)
        return draft_of(RollbackAsked(act=act.digest, act_seq=act.stream_seq,
                                      keyid=verified.keyid),
                        record.stage, rv.principal, "human",
                        f"rollback asked by {rv.principal}: {rv.reason}"[:REASON_LIMIT],
                        verified.envelope)
    if record.in_flight:
        return refusal(record, act, "apply_in_flight", f"the ApplyOrder under "
                       f"{record.dispatched_by} was dispatched at {record.dispatched_at}; its "
                       "outcome will be recorded", actor, verified.keyid)
    if superseded or record.superseded_by is not None:
        return refusal(record, act, "superseded", "the proposal was superseded by new content; "
                       "an approval never carries over", actor, verified.keyid)
    d = record.decision
    if status_at(record, now) == "expired" and record.status != "expired":  # not on the chain yet
        return refusal(record, act, "not_awaiting_review", f"status expired: valid_to "
                       f"{record.proposal.valid_to} passed (now {now}); an expired proposal "
                       "is never approved or applied", actor, verified.keyid)
    unseen = _unseen(record, rv)
    if unseen is not None:
        return refusal(record, act, "unseen_body", unseen, actor, verified.keyid)
    if rv.verdict == "approve" and not is_waiting(record, now):
        why = (f"status {record.status}" if record.status != "pending"
               else f"triage said {d.verdict}/{d.cause}" if d else "not triaged yet")
        return refusal(record, act, "not_awaiting_review", f"nothing to approve ({why})",
                       actor, verified.keyid)
    if rv.verdict == "reject" and record.status == "approved":
        # OMS §8.12: approved → applied | expired; rollback, once applied, is the way back
        return refusal(record, act, "not_awaiting_review", f"status approved by "
                       f"{record.approved_by}: an approved proposal is applied or expires, it "
                       "is not rejected (OMS); once applied, a rollback undoes it", actor,
                       verified.keyid)
    if rv.verdict == "reject" and record.status != "pending":
        return refusal(record, act, "not_awaiting_review", f"status {record.status}", actor,
                       verified.keyid)
    # the trailer's words (hash-chained as written: chains that say "rejectd" still verify)
    done = "approved" if rv.verdict == "approve" else "rejected"
    data = (Approved if rv.verdict == "approve" else Rejected)(
        act=act.digest, act_seq=act.stream_seq, keyid=verified.keyid)
    return draft_of(data, record.stage, rv.principal, "human",
                    f"{done} by {rv.principal}: {rv.reason}"[:REASON_LIMIT], verified.envelope)


def _unseen(record: ProposalRecord, rv: Review) -> str | None:
    """Why an approval does not show its signer saw what will run: a digest of something else,
    or none where the proposer chose the reversal an L4 runs later under this approval."""
    if rv.verdict != "approve":
        return None
    digest = will_run_digest(record.proposal)
    if rv.body_digest is not None and rv.body_digest != digest:
        return (f"the approval signs body digest {rv.body_digest[:16]}…, but what will run "
                f"(body, last-known-good, reversal) digests to {digest[:16]}…")
    if rv.body_digest is None and record.proposal.revert is not None:
        return ("this L4 carries its own reversal body, which runs later under this approval: "
                "the approval must sign the digest of what it saw (`improved approve` does)")
    return None


# -- grants (DESIGN §5.3): chained per skill hash on `improve.audit._grants.<sha256>` ---------


def tofu_problem(cmd: GrantCommand, l2: ProposalRecord | None) -> ActRefused | None:
    """SPEC 09 §3: L2 → L3 is the only place trust on first use is granted. A grant holds only
    for the definition of the L2 proposal it names (`l2`, rebuilt from its verified chain), and
    only once an operator's approval of it was applied. A revocation needs nothing."""
    if cmd.op == "revoke":
        return None
    if cmd.proposal_id is None:
        return ActRefused("not_applied_at_l2", "a grant names the L2 proposal that approved and "
                                               "applied this definition (proposal_id)")
    if l2 is None:
        return ActRefused("not_applied_at_l2", f"no proposal {cmd.proposal_id} on the chain")
    if l2.skill != cmd.skill:
        return ActRefused("not_applied_at_l2", f"proposal {cmd.proposal_id} is the skill "
                                               f"{l2.skill}, not {cmd.skill}")
    if l2.gate_class != "L2" or l2.status != "applied" or l2.approved_by is None:
        return ActRefused("not_applied_at_l2", f"proposal {cmd.proposal_id} is {l2.status} at "
                                               f"{l2.gate_class}; a grant needs it approved by an "
                                               f"operator and applied at L2")
    return None


def grant_act(acts: list[tuple[str, int]], act: Act, verified: Verified | None,
              cmd: GrantCommand | None, refused: ActRefused | None, actor: str) -> Draft | None:
    """The trailer a grant or revoke act adds to its skill's grant chain; None on redelivery.
    Either `refused` says why the act did not verify, or `verified` and `cmd` are both set."""
    if (act.digest, act.stream_seq) in acts:
        return None
    if refused is None and any(d == act.digest for d, _ in acts):
        refused = ActRefused("replayed", "this signed act was already used")
    if refused is not None:
        seen = sum(1 for d, _ in acts if d == act.digest)
        if seen >= 2 or len(acts) >= MAX_REFUSED_ACTS:  # see `unrecorded`: only logged
            return None
        return draft_of(Refused(act=act.digest, act_seq=act.stream_seq, code=refused.code),
                        "triage", actor, "rec:system",
                        f"signed act refused ({refused.code}): {refused.reason}"[:REASON_LIMIT])
    if verified is None or cmd is None:
        raise ValueError("grant_act: an act that was not refused needs its verification and "
                         "its command")
    return draft_of(GrantAct(verdict=cmd.op, act=act.digest, act_seq=act.stream_seq,
                             keyid=verified.keyid, skill=cmd.skill, l2=cmd.proposal_id,
                             expires_at=cmd.expires_at),
                    "triage", cmd.principal, "human",
                    f"{cmd.op} {cmd.skill} by {cmd.principal}: {cmd.reason}"[:REASON_LIMIT],
                    verified.envelope)


def chain_acts(trailers: Sequence[Trailer]) -> list[tuple[str, int]]:
    """(envelope digest, stream sequence) of every signed act a grant chain records, counted
    or refused: what `grant_act` tells a redelivery and a replay by."""
    out = []
    for t in trailers:
        data = decode(t)
        if isinstance(data, Signed) and data.act is not None and data.act_seq is not None:
            out.append((data.act, data.act_seq))
    return out


def grant_state(trailers: list[Trailer]) -> Grant | None:
    """The current grant of a skill hash: its last counted grant or revoke act."""
    for t in reversed(trailers):
        grant = _grant_of(t)
        if grant is not None:
            return grant
    return None


GrantActs = tuple[tuple[int, Grant], ...]


def grant_acts(trailers: Sequence[Trailer], stream_seqs: Sequence[int]) -> GrantActs:
    """Each counted grant or revoke act of a verified grant chain with its stream sequence,
    oldest first: what the grant was as of any sequence of the audit stream (`grant_as_of`)."""
    return tuple((seq, grant) for t, seq in zip(trailers, stream_seqs, strict=True)
                 if (grant := _grant_of(t)) is not None)


def grant_as_of(acts: GrantActs, seq: int | None = None) -> Grant | None:
    """The grant as of stream sequence `seq`: the last act recorded below it, so an act at or
    after `seq` does not count (all of them when `seq` is None); None before the first."""
    for at, grant in reversed(acts):
        if seq is None or at < seq:
            return grant
    return None


def _grant_of(t: Trailer) -> Grant | None:
    """The grant a counted grant or revoke trailer records; None for any other trailer."""
    if KINDS.get((t.to_stage, t.verdict)) is not GrantAct:
        return None
    act = decode(t)
    assert isinstance(act, GrantAct)
    return Grant(skill=act.skill, active=act.verdict == "grant", principal=t.actor,
                 reason=t.reason, at=t.at, expires_at=act.expires_at)


def grant_covers(grant: Grant, identity: str, now: int) -> bool:
    """The one rule of an L3 grant: active, for exactly `<name>:<sha256>` (never by name), and
    not expired at `now`."""
    return (grant.active and grant.skill == identity
            and (grant.expires_at is None or grant.expires_at > now))
