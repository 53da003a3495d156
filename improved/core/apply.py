"""Stage 4, apply: which proposals may be applied, the order sent to the owning service, and the
transition its result makes (DESIGN §3.4, §4). Pure; the engine does the request and retries.
"""

from __future__ import annotations

from typing import Any

import msgspec

from improved.core import lkg
from improved.core.audit import REASON_LIMIT, Draft, draft_of
from improved.core.boundary import Answer, Attested, Conflict, Evidence
from improved.core.gradient import AUTO_APPLY_CLASSES
from improved.core.policy import Policy
from improved.core.propose import identify
from improved.core.record import REGRESSED, ProposalRecord
from improved.core.trailers import Applied, Dispatched, RolledBack, Undelivered
from improved.protocol import cal, canonical
from improved.protocol.model import (
    AnalyzerRef,
    ApplyOrder,
    ApplyResult,
    ChangeClass,
    ObserverType,
    Origin,
    Proposal,
    Summary,
)
from improved.protocol.wire import WireError

APPROVABLE = frozenset({"L2", "L3", "L4"})  # L1 only surfaces: never applied, even approved


def auto_applies(record: ProposalRecord) -> bool:
    """Accepted at L0, or at L3 under an active grant: the `rec:policy` path."""
    d = record.decision
    return (d is not None and d.verdict == "accept" and d.gate_class in AUTO_APPLY_CLASSES
            and record.status == "pending")


def needs_apply(record: ProposalRecord) -> bool:
    """Gate satisfied and no outcome yet (a failed outcome is final until re-triaged), or the
    dispatch recorded and its outcome not: whatever came in since, that outcome is owed."""
    if record.outcome is not None:
        return False
    if record.in_flight:
        return True
    if record.superseded_by is not None:
        return False
    if lkg.is_charter(record.proposal):
        return False  # a constitution edit is prepared; an operator commits it (SPEC 09 §8)
    return auto_applies(record) or (record.status == "approved"
                                    and record.proposal.change_class in APPROVABLE)


def awaiting_dispatch(record: ProposalRecord) -> bool:
    """May be applied and no order is recorded as sent yet: still open to a new decision
    (expiry, a hold, a review). Once the dispatch is on the chain, only its outcome follows."""
    return needs_apply(record) and not record.in_flight


def grant_bound(record: ProposalRecord) -> bool:
    """An L3 auto-apply: its skill's grant is re-checked right before the dispatch is
    recorded, so a revocation on the chain by then stops it."""
    return record.gate_class == "L3" and record.approved_by is None and record.skill is not None


def dispatch(record: ProposalRecord, policy: Policy, actor: str) -> Draft:
    """The intent: the ApplyOrder is recorded on the chain before it leaves. Whichever lands
    first on the chain, this or an operator's review, wins; a review after it is refused."""
    by = authority(record, policy)
    return draft_of(Dispatched(dispatch="apply", order=record.proposal_id, authority=by),
                    record.stage, actor, "rec:system",
                    f"ApplyOrder dispatched to {record.service} under {by}")


def undelivered(record: ProposalRecord, error: str, actor: str) -> Draft:
    """The dispatch just recorded reached no service (no responder, or a "not now" error
    reply, on every attempt; never a timeout): nothing was applied, so the dispatch is void
    and the proposal is open to a decision again (a review, expiry, new content)."""
    return draft_of(Undelivered(order=record.proposal_id, error=error), record.stage, actor,
                    "rec:system", f"the ApplyOrder reached no service: {error}"[:300])


def dispatch_rollback(record: ProposalRecord, actor: str) -> Draft:
    """The intent of an operator's rollback: its order is recorded before it leaves."""
    inverse_id, order_ = rollback_order(record, 1)
    return draft_of(Dispatched(dispatch="rollback", order=inverse_id, authority=order_.authority),
                    record.stage, actor, "rec:system",
                    f"rollback order {inverse_id} dispatched to {record.service} under "
                    f"{order_.authority}")


def needs_rollback(record: ProposalRecord) -> bool:
    """An operator asked for the inverse of an applied change and it has not run yet."""
    return (record.status == "applied" and record.rollback_by is not None
            and record.rollback_outcome is None)


ROLLBACK_ANALYZER = "improved.rollback/1"


def inverse_proposal(record: ProposalRecord, change_class: ChangeClass | None = None) -> Proposal:
    """The recorded inverse as a proposal of its own (content-addressed, so the owning
    service applies it exactly once). Its body is the inverse the service returned."""
    p = record.proposal
    out = record.outcome
    if out is None:
        raise ValueError(f"{record.proposal_id} has no apply outcome, so no recorded inverse")
    return Proposal(
        service=p.service, target_ref=p.target_ref,
        change_class=change_class or p.change_class, scope=p.scope,
        origin=Origin(actor="improved", service="improved"),
        analyzer=AnalyzerRef(id=ROLLBACK_ANALYZER),
        summary=Summary(template_id="rollback", args={"proposal_id": record.proposal_id}),
        proposal_data=out.inverse if isinstance(out.inverse, dict) else {"inverse": out.inverse},
        derived_from=[f"mg:sha256:{record.proposal_id}"],
        created_at=out.at,
        namespace=p.namespace,
    )


def rollback_proposal(record: ProposalRecord) -> Proposal:
    """What learn-back proposes after a regression: the recorded inverse, at the original's
    class — except that an L3 inverse (it carries no skill to re-execute) asks an operator;
    an L4 change proposes the reversal recorded before its apply."""
    if record.revert is not None:
        return record.revert
    cls = record.proposal.change_class
    return inverse_proposal(record, "L2" if cls == "L3" else cls)


def counts_toward_breaker(original: ProposalRecord, inverse: ProposalRecord) -> bool:
    """Whether an applied rollback of an autonomous apply counts toward the circuit breaker
    (constitution IV.5): only when what caused it is verified — learn-back measured the
    original regressed (an attested answer, `core.boundary`) and this is the very rollback it
    proposed. Anyone may publish a proposal that reverts a change (at an L0's class it is
    applied like any L0), but no such proposal pauses the mesh's autonomy."""
    if original.approved_by is not None or original.measured != REGRESSED:
        return False
    try:
        expected = identify(rollback_proposal(original))[0]
    except (ValueError, WireError):
        return False
    return inverse.proposal_id == expected


def rolls_back(proposal: Proposal) -> str | None:
    """The id of the proposal a rollback (or an L4 reversal) proposal undoes, if it is one."""
    if proposal.analyzer.id not in (ROLLBACK_ANALYZER, lkg.REVERT_ANALYZER):
        return None
    for ref_ in proposal.derived_from or ():
        if ref_.startswith("mg:sha256:"):
            return ref_[len("mg:sha256:"):]
    return None


def rolled_back_by(record: ProposalRecord, inverse: ProposalRecord) -> Draft | None:
    """The original, once its rollback proposal was applied: rolled back."""
    if record.status != "applied" or record.rollback_outcome is not None:
        return None
    out = inverse.outcome
    if out is None:
        raise ValueError(f"rollback {inverse.proposal_id} of {record.proposal_id} has not been "
                         "applied")
    observer: ObserverType = "rec:policy" if inverse.approved_by is None else "human"
    return draft_of(RolledBack(verdict="rolled_back", applied=out.applied_id,
                               inverse_of=inverse.proposal_id),
                    record.stage, out.authority, observer,
                    f"rolled back: its recorded inverse {inverse.proposal_id} was applied")


def rollback_principal(record: ProposalRecord) -> str:
    """The operator who asked for the rollback (`needs_rollback` holds only once one did)."""
    if record.rollback_by is None:
        raise ValueError(f"no rollback of {record.proposal_id} was asked for")
    return record.rollback_by


def rollback_order(record: ProposalRecord, attempt: int) -> tuple[str, ApplyOrder]:
    """(the inverse's id, the order that applies it under the requesting operator)."""
    from improved.core.propose import identify

    by = rollback_principal(record)
    if record.revert is not None:  # L4: the reversal generated and validated before apply
        if record.revert_id is None:  # both come from the one lkg_verified trailer
            raise ValueError(f"{record.proposal_id} records a reversal without its id")
        return record.revert_id, ApplyOrder(proposal_id=record.revert_id, proposal=record.revert,
                                            authority=by, attempt=attempt)
    inverse = inverse_proposal(record)
    pid, _ = identify(inverse)
    return pid, ApplyOrder(proposal_id=pid, proposal=inverse, authority=by, attempt=attempt)


def rollback_transition(record: ProposalRecord, inverse_id: str,
                        answer: Evidence[ApplyResult]) -> Draft:
    """The owning service's answer to a rollback order, with who answered (`answered_by`)."""
    result = answer.value
    reason = (f"rolled back by {record.service}: the recorded inverse applied as "
              f"{result.applied_id or inverse_id}" if result.ok else
              f"{record.service} refused the inverse: {result.error or 'no reason given'}")
    return draft_of(RolledBack(verdict="rolled_back" if result.ok else "rollback_failed",
                               applied=result.applied_id, inverse_of=inverse_id,
                               answered_by=answered_by(answer), error=result.error),
                    record.stage, rollback_principal(record), "human", reason)


def expired(record: ProposalRecord, now: int) -> bool:
    valid_to = record.proposal.valid_to
    return valid_to is not None and valid_to <= now


def authority(record: ProposalRecord, policy: Policy) -> str:
    """The authority recorded with the dispatch, once there is one (the order sent again is
    the same order); before it, the approving principal's; auto-applies run under the
    policy principal configured for the proposal's namespace (OMS rule 8;
    `Policy.principal_for`: `[policy.principals]`, else `policy_principal`). Never the
    analyzer's."""
    return (record.dispatched_by or record.approved_by
            or policy.principal_for(record.proposal.namespace))


def order(record: ProposalRecord, policy: Policy, attempt: int) -> ApplyOrder:
    return ApplyOrder(proposal_id=record.proposal_id, proposal=record.proposal,
                      authority=authority(record, policy), attempt=attempt)


def replayable(inverse: object) -> bool:
    """A rollback can send it: there is an inverse, and a CAL plan names a real grain in
    every step (a `target: null` step says the applier did not tell which grain it wrote)."""
    if inverse is None:
        return False
    if isinstance(inverse, dict) and "cal_inverse" in inverse:
        steps = inverse["cal_inverse"]
        return isinstance(steps, list) and bool(steps) and all(
            isinstance(s, dict) and bool(s.get("target")) for s in steps)
    return True


def derived_inverse(record: ProposalRecord, result: ApplyResult) -> tuple[object, bool]:
    """The inverse to record, and whether a rollback can replay it: the service's own, else —
    for a CAL batch — the plan derived from the batch (OMS §3.6). That fallback cannot know
    the grains the batch wrote, so its targets are null: kept on the chain for the record,
    never marked rollbackable. Only what can actually be replayed is."""
    if not result.ok:
        return result.inverse, False
    inverse = result.inverse
    cal_text = record.proposal.proposal_cal
    if inverse is None and cal_text is not None:
        inverse = {"cal_inverse": cal.inverse(cal.parse(cal_text))}
    return inverse, result.rollbackable and replayable(inverse)


def recordable(result: ApplyResult) -> ApplyResult:
    """The result as the loop can record it: one it cannot encode canonically (an integer
    beyond 64 bits, say, in its inverse) breaks the contract and is a failed apply, recorded
    once, never an outcome that retries forever."""
    try:
        canonical.encode(msgspec.to_builtins(result))
    except (canonical.CanonicalError, OverflowError, TypeError) as exc:
        return ApplyResult(ok=False, error=f"the service's ApplyResult cannot be recorded: "
                                           f"{exc}"[:REASON_LIMIT])
    return result


def answered_by(answer: Answer[Any]) -> str:
    """Who answered the request a transition records (its `answered_by:` ref): the attested
    identity, or `unattested` / `conflict` (core.boundary), so the chain tells an auditor
    what each outcome rests on."""
    if isinstance(answer, Attested):
        return answer.by
    return "conflict" if isinstance(answer, Conflict) else "unattested"


def transition(record: ProposalRecord, answer: Evidence[ApplyResult], by: str) -> Draft:
    """The owning service's ApplyResult as the apply transition, with who answered."""
    result = answer.value
    inverse, rollbackable = derived_inverse(record, result)
    observer: ObserverType = "rec:policy" if auto_applies(record) else "human"
    if result.ok:
        reason = f"applied by {record.service} as {result.applied_id or '(no id)'}" + (
            "" if rollbackable else "; not rollbackable")
    else:
        reason = f"{record.service} refused the apply: {result.error or 'no reason given'}"
    return draft_of(Applied(
        verdict="applied" if result.ok else "failed", applied=result.applied_id,
        rollbackable=rollbackable, answered_by=answered_by(answer),
        revert_proposal_id=record.revert_id if result.ok else None,
        # the service's claim, recorded for auditors only
        schema_class=result.schema_class if result.ok else None,
        inverse=inverse, error=result.error), record.stage, by, observer, reason)
