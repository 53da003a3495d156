"""Stage 5, learn-back: count outcome signals per proposal, each with its independence.

A signal is counted once (by its digest); counting it is a transition with its own trailer, so
the signal set — and with it the feedback-collapse guard — can be rebuilt from the chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

from improved.core import identity, trailers
from improved.core.audit import Draft, draft_of
from improved.core.boundary import Conflict, Unattested
from improved.core.policy import Policy
from improved.core.propose import count, signal_digest
from improved.core.record import HELD, REGRESSED, UNMEASURED, CountedSignal, ProposalRecord
from improved.core.trailers import SignalCounted
from improved.protocol.model import (
    Envelope,
    LearnBack,
    MeasureDue,
    MeasureRequest,
    ObserverType,
    Signal,
)

Measured = Literal["held", "regressed", "unmeasured"]  # what learn-back found at review_after
MAX_CAUSE: Final = 300  # characters of why a measurement failed, on the trailer
MAX_QUERY_REF: Final = 200  # characters of the query, on the trailer


def observe_signal(record: ProposalRecord, signal: Signal, policy: Policy, now: int,
                   emitter: str = identity.UNVERIFIED, envelope: Envelope | None = None,
                   ) -> tuple[Draft, CountedSignal] | None:
    """Count `signal` for `record`; None when it was counted before (a redelivery).
    `emitter` is who verifiably sent it (a signature, or a bound subject); a signed signal's
    envelope goes on the trailer so the chain proves it."""
    digest = signal_digest(signal)
    if any(s.digest == digest for s in record.signals):
        return None
    counted = count(signal, digest, record.proposal, record.applied_at, policy, emitter,
                    record.proposer)
    observer: ObserverType = ("human" if envelope is not None and emitter.startswith("operator:")
                              else "rec:agent")
    sign = "positive" if signal.positive else "negative"
    independence = "independent" if counted.independent else "not independent"
    source = f"verified as {emitter}" if emitter else "unverified"
    data = SignalCounted(signal=digest, kind=signal.kind, service=signal.service,
                         positive=signal.positive, independent=counted.independent,
                         at=signal.at, emitter=emitter, name=signal.name, value=signal.value)
    return draft_of(data, record.stage, signal.actor, observer,
                    f"{sign} {signal.kind} signal from {signal.service} ({source}), "
                    f"{independence}", envelope), counted


def verdict(record: ProposalRecord) -> str:
    """`confirmed`: independent positive evidence and no independent negative; `disputed`: an
    independent negative; `self_only`: positives, all from the proposer; `none` otherwise."""
    independent = [s for s in record.signals if s.independent]
    if any(not s.positive for s in independent):
        return "disputed"
    if any(s.positive for s in independent):
        return "confirmed"
    if record.positives:
        return "self_only"
    return "none"


def summary(record: ProposalRecord, now: int) -> LearnBack:
    snap = record.proposal.metric_snapshot
    return LearnBack(
        proposal_id=record.proposal_id, service=record.service,
        signals_counted=len(record.signals),
        independent=sum(1 for s in record.signals if s.independent),
        verdict=verdict(record), at=now,
        metric=snap.metric if snap else None, baseline=snap.baseline if snap else None,
        measured=record.measured, value=record.measured_value,
    )


# -- measurement at review_after (DESIGN §4): the daemon asks the owning service -------------


@dataclass(frozen=True)
class Reading:
    """What asking the owning service at review_after gave: a value, or why there is none
    (no responders, a timeout, an error reply, a malformed or non-finite answer)."""

    value: float | None = None
    cause: str | None = None


def unattributed(answer: Unattested[Reading] | Conflict[Reading], service: str) -> Reading:
    """The reading of an answer no decision may take (core.boundary): no value, and as its
    cause what was said and why it does not count — recorded, never judged."""
    if isinstance(answer, Conflict):
        said = ", ".join(sorted({_said(a.value) for a in answer.answers}))
        return Reading(cause=f"attested answers disagree ({said}): none is taken")
    if answer.value.value is None:  # no value to take anyway: its own cause says why
        return answer.value
    return Reading(cause=f"the answer {_said(answer.value)} is not attributable to "
                         f"service:{service} ({answer.why}): recorded, it decides nothing")


def _said(reading: Reading) -> str:
    return f"{reading.value!r}" if reading.value is not None else (reading.cause or "nothing")


def awaiting(record: ProposalRecord) -> int | None:
    """When an applied, not yet measured proposal is due for its measurement (its
    `metric_snapshot.review_after`), or None when there is none to make."""
    snap = record.proposal.metric_snapshot
    if (snap is None or snap.review_after is None or record.applied_at is None
            or record.status != "applied" or record.measured is not None):
        return None
    return snap.review_after


def due_entry(record: ProposalRecord | None) -> MeasureDue | None:
    """The measurement index entry `record` should have: None when no measurement is to
    make (docs/protocol.md "The measurement index")."""
    at = awaiting(record) if record is not None else None
    if record is None or at is None:
        return None
    return MeasureDue(proposal_id=record.proposal_id, service=record.service, review_after=at)


@dataclass(frozen=True)
class DueWrite:
    """One write to the measurement index: the entry, or None for a tombstone."""

    entry: MeasureDue | None


def due_change(before: ProposalRecord | None, after: ProposalRecord,
               republish: bool, moved: bool = False) -> DueWrite | None:
    """What to write to the measurement index after a pass took `before` to `after`: the
    entry when a measurement fell due (the apply), a tombstone when it stopped being due (its
    verdict, a rollback), nothing otherwise; on a republish the entry again, or the tombstone
    for a proposal that was due once (in case the earlier write was lost). A proposal without
    `review_after` never costs a write. `moved`: a trailer of the pass moved the proposal in
    or out of the index (`core.indexes`), so one measured in the pass that applied it gets its
    tombstone too (a reader counting the members of the last checkpoint looks for it)."""
    new = due_entry(after)
    if new != due_entry(before) or (moved and new is None):
        return DueWrite(new)
    snap = after.proposal.metric_snapshot
    was_due = snap is not None and snap.review_after is not None and after.applied_at is not None
    if republish and (new is not None or was_due):
        return DueWrite(new)
    return None


def due(record: ProposalRecord, now: int) -> MeasureRequest | None:
    """The request to send to `<svc>.improve.measure` once review_after has passed on an
    applied proposal not measured yet; None otherwise (a verdict on the chain: never twice)."""
    at = awaiting(record)
    snap = record.proposal.metric_snapshot
    if at is None or snap is None or now < at:
        return None
    return MeasureRequest(proposal_id=record.proposal_id, metric=snap.metric, query=snap.query)


def compare(baseline: float, value: float, lower_is_better: bool, tolerance: float) -> Measured:
    """`regressed` when `value` is worse than `baseline` by more than `tolerance`, relative to
    the baseline's magnitude (1 when the baseline is 0); `held` otherwise."""
    change = (value - baseline) / (abs(baseline) or 1.0)
    worse = change > tolerance if lower_is_better else change < -tolerance
    return REGRESSED if worse else HELD


def judge(record: ProposalRecord, reading: Reading, policy: Policy) -> Measured:
    """The verdict of a measurement: `unmeasured` whenever there is no finite value to compare
    (never `held` by default), else `compare` under the policy's direction and tolerance."""
    snap = record.proposal.metric_snapshot
    if snap is None or reading.value is None or not math.isfinite(reading.value):
        return UNMEASURED
    lower = policy.metric_direction.get(snap.metric, "higher") == "lower"
    return compare(snap.baseline, reading.value, lower, policy.regression_tolerance)


def unmeasurable(reading: Reading) -> str:
    """Why a reading measured nothing, in one line."""
    if reading.value is not None and not math.isfinite(reading.value):
        return f"the answer {reading.value} is not a finite number"
    return reading.cause or "no value"


def measured(record: ProposalRecord, verdict: Measured, reading: Reading,
             rollback_id: str | None, actor: str, answered_by: str | None = None) -> Draft:
    """The learn-back trailer recording what asking the owning service found."""
    snap = record.proposal.metric_snapshot
    if snap is None:  # `due` asks nothing without one
        raise ValueError(f"{record.proposal_id} has no metric_snapshot to measure against")
    how = f"asked {record.service}"
    value = cause = None
    if verdict == UNMEASURED:
        cause = unmeasurable(reading)[:MAX_CAUSE]
        reason = (f"{snap.metric} unmeasured ({how}): {cause}; whether the change held is "
                  "unknown")
    else:
        value = reading.value
        reason = (f"{snap.metric} {value} against baseline {snap.baseline} ({how}): "
                  + ("a regression beyond the tolerance; its recorded rollback is proposed as "
                     f"{rollback_id}" if verdict == REGRESSED and rollback_id
                     else "a regression beyond the tolerance; nothing recorded to roll back"
                     if verdict == REGRESSED else "held"))
    return draft_of(trailers.Measured(
        verdict=verdict, metric=snap.metric, baseline=snap.baseline, measured_by=how,
        query=snap.query[:MAX_QUERY_REF] if snap.query is not None else None, why=cause,
        value=value, rollback_proposal=rollback_id or None, answered_by=answered_by),
        record.stage, actor, "rec:system", reason[:500])
