"""The planner: what happens next to a proposal, decided without I/O.

`next_step(record, view, policy, actor)` looks at a proposal's record (rebuilt from its chain)
and at a `View` of the few things outside it that the shell read up front — the clock, the
autonomy chain's state, whether this pass may dispatch, the rejection-ledger entry — and returns
one `Step`: commit a transition, send a rollback, check the last-known-good, send the apply,
measure, finish a rollback, halt, or done. The engine carries out that one step and asks again,
so the order of the loop lives here, in one function, and is tested without a broker.

Three inputs are read only when a step needs them: the grant of an L3 skill (now, and as of
its intent's stream sequence) and the original of a reversal. Until the view holds them the
planner answers `ReadGrant` / `ConfirmGrant` / `ReadOriginal` (as h11 answers NEED_DATA); the
shell reads, fills the view and asks again.

The priority order, first match wins:
  1. triage — untriaged, released from feedback collapse, expired (`valid_to` passed while
     it waited for an operator, was approved or accepted, or was held: never once its order is
     in flight), or held back by the breaker/switch that no longer holds (a reversal first inherits its original's
     approval);
  2. re-hold — an autonomous proposal accepted before the breaker opened or autonomy went off;
  3. the quorum's decision, once its votes add up;
  4. halt — a crisis refuses every dispatch;
  5. an operator's rollback of an applied change (its dispatch recorded first);
  6. the L4 last-known-good check (and the reversal recorded before any order);
  7. the apply: its dispatch recorded on the chain first (the intent, after an L3's grant is
     re-read), then the order — sent again, the same, until its outcome is recorded. An L3's
     intent stands only if its grant was active as of the intent's own stream sequence
     (`ConfirmGrant`); one that does not is withdrawn and its order never sent;
  8. learn-back's measurement at `review_after`: ask the owning service (`AskMeasure`), then
     commit its verdict — held, regressed (which proposes the recorded rollback) or
     unmeasured (`after_measure`);
  9. finishing the original once its rollback (or reversal) applied;
  10. done.
"""

from __future__ import annotations

from typing import Final

import msgspec

from improved.core import apply as apply_stage
from improved.core import learnback, lkg, propose, quorum, triage
from improved.core.audit import Draft
from improved.core.boundary import Answer, Attested, Evidence
from improved.core.breaker import Autonomy
from improved.core.policy import Policy
from improved.core.record import REGRESSED, UNMEASURED, ProposalRecord, expiry_unrecorded
from improved.protocol.model import (
    ApplyOrder,
    Held,
    MeasureRequest,
    Proposal,
    to_json,
)
from improved.protocol.wire import WireError

AUTONOMOUS_CLASSES: Final = frozenset({"L0", "L3"})


class _Unread:
    """Marks a view input the shell has not read (distinct from a read that found nothing)."""

    def __repr__(self) -> str:
        return "UNREAD"


UNREAD: Final = _Unread()
GrantRead = bool | _Unread  # the L3 grant as the view holds it: active or not, or not read yet


class View(msgspec.Struct, frozen=True):
    """What the shell read for one planning pass."""

    now: int
    autonomy: Autonomy = msgspec.field(default_factory=Autonomy)
    dispatch: bool = True  # False: decide, but leave sending orders to the inbound consumer
    # an operator's rejection under the dedup_key, as its chain records it (the ledger only
    # says which chain to read)
    rejected: triage.Rejection | None = None
    grant: GrantRead = UNREAD  # is the L3 skill's grant active
    # (stream sequence of an intent, was the L3 skill's grant active as of it), once read
    grant_at_intent: tuple[int, bool] | None = None
    original: ProposalRecord | None | _Unread = UNREAD  # the record a reversal reverts

    def held(self, record: ProposalRecord) -> Held | None:
        """The cause holding this proposal's autonomous apply back now, if any."""
        if record.proposal.change_class not in AUTONOMOUS_CLASSES:
            return None
        return self.autonomy.blocks(self.now)


# -- steps -----------------------------------------------------------------------------------


class Commit(msgspec.Struct, frozen=True):
    """Append `draft` as the next trailer of the record planned on; the record after it is
    `record.fold(record, audit.seal(draft, record, at), stream_seq)`, as for every trailer."""

    draft: Draft
    why: str  # which rule decided: triage, hold, inherit, quorum, revoked


class ReadGrant(msgspec.Struct, frozen=True):
    skill: str


class ConfirmGrant(msgspec.Struct, frozen=True):
    """Was `skill`'s grant active as of stream sequence `as_of_seq` (only grant-chain trailers
    below it count) and unexpired at `at`: does the intent recorded there stand? Read after
    the intent's append was acknowledged, from the stream leader."""

    skill: str
    as_of_seq: int
    at: int


class ReadOriginal(msgspec.Struct, frozen=True):
    proposal_id: str


class Halt(msgspec.Struct, frozen=True):
    """Nothing may be sent now (a crisis); the proposal stays where it is."""

    reason: str


class SendRollback(msgspec.Struct, frozen=True):
    inverse_id: str
    order: ApplyOrder


class CheckLkg(msgspec.Struct, frozen=True):
    """Ask the owning service for a healthy last-known-good of every artefact (SPEC 09 §7.1)."""


class SendApply(msgspec.Struct, frozen=True):
    """Send the order whose dispatch is on the chain, and commit its outcome."""

    order: ApplyOrder
    authority: str


class AskMeasure(msgspec.Struct, frozen=True):
    """Ask the owning service for the metric at review_after; `after_measure` turns what it
    answered (or that it could not) into the `Measure` step."""

    request: MeasureRequest


class Measure(msgspec.Struct, frozen=True):
    """Learn-back's measurement: publish `rollback` (if any) durably first, then commit."""

    commit: Commit
    rollback: Proposal | None


class FinishRollback(msgspec.Struct, frozen=True):
    """The original this applied rollback (or reversal) undoes is to be marked rolled back."""

    original_id: str


class Done(msgspec.Struct, frozen=True):
    pass


Step = (Commit | ReadGrant | ConfirmGrant | ReadOriginal | Halt | SendRollback | CheckLkg
        | SendApply | AskMeasure | Measure | FinishRollback | Done)

DONE: Final = Done()


# -- the decision ------------------------------------------------------------------------------


def next_step(record: ProposalRecord, view: View, policy: Policy, actor: str) -> Step:
    """The one next step for `record` (see the module docstring for the order)."""
    held = view.held(record)
    if _wants_triage(record, view.now, held):
        return _triage(record, view, policy, actor, held)
    if (held is not None and apply_stage.auto_applies(record)
            and apply_stage.awaiting_dispatch(record)):
        # accepted before the breaker opened (or autonomy went off): hold it back now; it was
        # accepted as autonomous, so the gate sees its grant as it was then
        decision = triage.decide(record, policy, view.now, True, actor, None, held)
        return Commit(triage.transition(record, decision), why="hold")
    decided = quorum.decided(record, actor)
    if decided is not None:
        return Commit(decided, why="quorum")
    return _dispatch(record, view, policy, actor) or _after_apply(record, view, policy, actor)


def _wants_triage(record: ProposalRecord, now: int, held: Held | None) -> bool:
    return (triage.needs_triage(record)
            or expiry_unrecorded(record, now)  # waiting, approved, accepted or held: expired
            or (triage.held_back(record) and held is None))


def _triage(record: ProposalRecord, view: View, policy: Policy, actor: str,
            held: Held | None) -> Step:
    original = lkg.reverts(record.proposal)
    if original is not None and triage.needs_triage(record):
        if isinstance(view.original, _Unread):
            return ReadOriginal(original)
        inherited = lkg.inherit(record, view.original,
                                _own_reversal(record, view.original, policy, view.now, actor))
        if inherited is not None:
            return Commit(inherited, why="inherit")
    grant = False
    # without a skill definition there is no `<name>:<sha256>` a grant could cover
    if record.proposal.change_class == "L3" and record.skill is not None:
        if isinstance(view.grant, _Unread):
            return ReadGrant(record.skill)
        grant = view.grant
    decision = triage.decide(record, policy, view.now, grant, actor, view.rejected, held)
    return Commit(triage.transition(record, decision), why="triage")


def _dispatch(record: ProposalRecord, view: View, policy: Policy, actor: str) -> Step | None:
    """The steps that send something to the owning service, when this pass may: each order's
    dispatch is committed to the chain (the intent) before the order is sent."""
    rollback = apply_stage.needs_rollback(record)
    if not view.dispatch or not (rollback or apply_stage.needs_apply(record)):
        return None
    if view.autonomy.crisis:
        return Halt(f"crisis {view.autonomy.crisis}: applies are refused until an operator "
                    "resolves it")
    if rollback:
        if record.rollback_dispatched_at is None:
            return Commit(apply_stage.dispatch_rollback(record, actor), why="dispatched")
        return SendRollback(*apply_stage.rollback_order(record, 1))
    if lkg.needs_check(record):
        return CheckLkg()
    if not record.in_flight:
        return _intent(record, view, policy, actor)
    if apply_stage.grant_bound(record):
        # always set with dispatched_at; the chain's end, were it not, only counts more acts
        seq = record.dispatched_seq or record.chain.stream_seq
        if view.grant_at_intent is None or view.grant_at_intent[0] != seq:
            return ConfirmGrant(record.skill or "", seq, record.dispatched_at or view.now)
        if not view.grant_at_intent[1]:
            return revoked(record, policy, view.now, actor)
    return SendApply(apply_stage.order(record, policy, 1), apply_stage.authority(record, policy))


def _intent(record: ProposalRecord, view: View, policy: Policy, actor: str) -> Step:
    """Record the dispatch; an L3 auto-apply re-reads its grant first, and a revoked one
    stops it here, before anything is recorded as sent. That read is a hint: a revoke can
    land between it and the intent's append (another chain, so no conflict), which is why the
    intent is judged once more, as of its own stream sequence, before its order is sent."""
    if apply_stage.grant_bound(record):
        if isinstance(view.grant, _Unread):
            return ReadGrant(record.skill or "")
        if not view.grant:
            return revoked(record, policy, view.now, actor)
    return Commit(apply_stage.dispatch(record, policy, actor), why="dispatched")


def _after_apply(record: ProposalRecord, view: View, policy: Policy, actor: str) -> Step:
    request = learnback.due(record, view.now) if view.dispatch else None
    if request is not None:
        return AskMeasure(request)
    undone = apply_stage.rolls_back(record.proposal)
    if undone and record.outcome is not None and record.outcome.ok:
        # idempotent, so a crash between the two trailers is finished by the next pass
        return FinishRollback(undone)
    return DONE


def after_measure(record: ProposalRecord, answer: Answer[learnback.Reading], policy: Policy,
                  actor: str) -> Measure:
    """What the owning service answered at review_after as the learn-back transition: held;
    regressed, with the recorded rollback proposed when there is one to propose; or
    unmeasured (no usable answer), which proposes nothing and is never taken for held. Only an
    attested answer is judged: an unattested one, or attested ones that disagree, are recorded
    unmeasured with what they said, and roll nothing back (core.boundary)."""
    if isinstance(answer, Attested):
        reading = answer.value
        verdict = learnback.judge(record, reading, policy)
    else:
        reading = learnback.unattributed(answer, record.service)
        verdict = UNMEASURED
    rollback = None
    if verdict == REGRESSED and (record.outcome is not None and record.outcome.rollbackable
                                 or record.revert is not None):
        rollback = apply_stage.rollback_proposal(record)
    rollback_id = propose.identify(rollback)[0] if rollback is not None else None
    draft = learnback.measured(record, verdict, reading, rollback_id, actor,
                               apply_stage.answered_by(answer))
    return Measure(Commit(draft, why="measured"), rollback)


def after_lkg(record: ProposalRecord, answer: Evidence[lkg.LkgReport], policy: Policy,
              actor: str, max_message_bytes: int, now: int) -> Commit:
    """The owning service's last-known-good report as a transition: refused (nothing was
    sent, nothing changed), or verified with the reversal generated now, validated as a
    proposal and recorded on the chain before any order goes out (SPEC 09 §7.1)."""
    report = answer.value
    by = apply_stage.authority(record, policy)
    why = lkg.report_problem(record, report)
    if why is None:
        rev = lkg.reversal(record, report)
        rev_id, why = validated_reversal(rev, record.service, policy, now, actor,
                                         max_message_bytes)
        if rev_id is not None:
            return Commit(lkg.verified(record, report, rev, rev_id, actor,
                                       apply_stage.answered_by(answer)), why="lkg_verified")
    return Commit(lkg.refused(record, why or "", by, apply_stage.answered_by(answer)),
                  why="lkg_refused")


def validated_reversal(rev: Proposal, service: str, policy: Policy, now: int, actor: str,
                       max_message_bytes: int) -> tuple[str | None, str | None]:
    """(its id, None) when the reversal decodes as a proposal, is content-addressable and
    triage would not reject it; else (None, why)."""
    try:
        rev_id, rev_dedup = propose.identify(rev)
        propose.validate(to_json(rev), service, max_message_bytes)
    except (WireError, ValueError, msgspec.MsgspecError) as exc:
        return None, f"the reversal is not a valid proposal: {exc}"
    start, _ = propose.register(rev, rev_id, rev_dedup, policy, 0)
    check = triage.decide(start, policy, now, False, actor)
    if check.verdict == "reject":
        return None, f"the reversal would be rejected: {check.cause}: {check.rationale}"
    return rev_id, None


def _own_reversal(record: ProposalRecord, original: ProposalRecord | None, policy: Policy,
                  now: int, actor: str) -> tuple[str, Proposal] | None:
    """A recorded reversal's own reversal, validated like an original's: recorded when it
    inherits, so the reversal, once applied, emits its revert_proposal_id too."""
    rev = None if original is None else lkg.reversal_of_reversal(record, original)
    if rev is None:
        return None
    rev_id, _ = validated_reversal(rev, record.service, policy, now, actor,
                                   lkg.REVERSAL_MESSAGE_BYTES)
    return None if rev_id is None else (rev_id, rev)


def withdrawable(record: ProposalRecord, intended_here: bool, maybe_delivered: bool) -> bool:
    """May the recorded dispatch still be withdrawn? Only when this very pass recorded it and
    no attempt may have reached a service (no timeout): an earlier pass, or a timed-out
    attempt, may have delivered it, so then it stays in flight and is sent again until its
    outcome is recorded."""
    return intended_here and not maybe_delivered and record.in_flight


def recheck_grant(record: ProposalRecord, intended_here: bool, maybe_delivered: bool) -> bool:
    """Before a retry of an L3 auto-apply's order: re-read its grant while the dispatch may
    still be withdrawn, so an order retried after a revocation was recorded is never sent."""
    return apply_stage.grant_bound(record) and withdrawable(record, intended_here,
                                                            maybe_delivered)


def unreachable(record: ProposalRecord, intended_here: bool, maybe_delivered: bool, error: str,
                actor: str) -> Commit | None:
    """The order found no service: its dispatch is withdrawn on the chain when it still may
    be (see `withdrawable`), else it stays in flight."""
    if not withdrawable(record, intended_here, maybe_delivered):
        return None
    return Commit(apply_stage.undelivered(record, error, actor), why="undelivered")


def revoked(record: ProposalRecord, policy: Policy, now: int, actor: str) -> Commit:
    """The grant an L3 auto-apply relied on was not active as of its dispatch's stream
    sequence, was revoked before its dispatch was recorded, or before a retry of an order
    that reached no service: the apply is stopped, a dispatch on the chain is void (its
    order never sent), and the proposal is gated as L2 again."""
    decision = triage.decide(record, policy, now, False, actor)
    return Commit(triage.transition(record, decision), why="revoked")


def with_read(view: View, step: ReadGrant | ConfirmGrant | ReadOriginal,
              value: bool | ProposalRecord | None) -> View:
    """The view after the shell carried out a read step."""
    if isinstance(step, ReadGrant):
        return msgspec.structs.replace(view, grant=bool(value))
    if isinstance(step, ConfirmGrant):
        return msgspec.structs.replace(view, grant_at_intent=(step.as_of_seq, bool(value)))
    return msgspec.structs.replace(view,
                                   original=value if isinstance(value, ProposalRecord) else None)
