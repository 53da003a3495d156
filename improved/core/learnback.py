"""Stage 5, learn-back: count outcome signals per proposal, each with its independence.

A signal is counted once (by its digest); counting it is a transition with its own trailer, so
the signal set — and with it the feedback-collapse guard — can be rebuilt from the chain.
"""

from __future__ import annotations

from typing import Literal

from improved.core import identity
from improved.core.audit import Draft
from improved.core.policy import Policy
from improved.core.propose import count, signal_digest
from improved.core.record import HELD, REGRESSED, SIGNAL, CountedSignal, ProposalRecord, ref
from improved.protocol.model import Envelope, LearnBack, ObserverType, Signal

Measured = Literal["held", "regressed"]  # what learn-back found at review_after


def observe_signal(record: ProposalRecord, signal: Signal, policy: Policy, now: int,
                   emitter: str = identity.UNVERIFIED, envelope: Envelope | None = None,
                   ) -> tuple[ProposalRecord, Draft, CountedSignal] | None:
    """Count `signal` for `record`; None when it was counted before (a redelivery).
    `emitter` is who verifiably sent it (a signature, or a bound subject); a signed signal's
    envelope goes on the trailer so the chain proves it."""
    digest = signal_digest(signal)
    if any(s.digest == digest for s in record.signals):
        return None
    counted = count(signal, digest, record.proposal, record.applied_at, policy, emitter)
    observer: ObserverType = ("human" if envelope is not None and emitter.startswith("operator:")
                              else "rec:agent")
    sign = "positive" if signal.positive else "negative"
    independence = "independent" if counted.independent else "not independent"
    source = f"verified as {emitter}" if emitter else "unverified"
    draft = Draft(
        from_stage=record.stage, to_stage="learn-back", actor=signal.actor,
        observer_type=observer, verdict=SIGNAL, envelope=envelope,
        reason=f"{sign} {signal.kind} signal from {signal.service} ({source}), {independence}",
        refs=(ref("signal", digest), ref("kind", signal.kind), ref("service", signal.service),
              ref("positive", signal.positive), ref("independent", counted.independent),
              ref("at", signal.at), ref("emitter", emitter))
        + ((ref("name", signal.name),) if signal.name is not None else ())
        + ((ref("value", signal.value),) if signal.value is not None else ()),
    )
    return record.replace(signals=(*record.signals, counted), updated_at=now), draft, counted


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
    )


# -- measurement at review_after (DESIGN §4) -----------------------------------------------------


def measurement(record: ProposalRecord, policy: Policy,
                now: int) -> tuple[Measured, float] | None:
    """Once `metric_snapshot.review_after` has passed on an applied proposal: compare the latest
    verified reading of the metric (a `metric` signal named like it, after the apply, from the
    owning service or a signed check: `identity.measures`) with
    the baseline. (`regressed` | `held`, value), or None while there is nothing to measure."""
    snap = record.proposal.metric_snapshot
    applied_at = record.applied_at
    if (snap is None or snap.review_after is None or applied_at is None
            or record.status != "applied" or record.measured is not None
            or now < snap.review_after):
        return None
    readings = [(s.at, s.value) for s in record.signals if s.kind == "metric"
                and identity.measures(s.emitter, record.service)
                and s.name == snap.metric and s.value is not None and s.at >= applied_at]
    if not readings:
        return None
    _, value = max(readings, key=lambda r: r[0])  # the latest (the first of equals)
    scale = abs(snap.baseline) or 1.0
    change = (value - snap.baseline) / scale
    lower_is_better = policy.metric_direction.get(snap.metric, "higher") == "lower"
    worse = change > policy.regression_tolerance if lower_is_better \
        else change < -policy.regression_tolerance
    return (REGRESSED if worse else HELD), value


def measured(record: ProposalRecord, verdict: Measured, value: float, rollback_id: str | None,
             actor: str, now: int) -> tuple[ProposalRecord, Draft]:
    snap = record.proposal.metric_snapshot
    if snap is None:  # `measurement` measured nothing without one
        raise ValueError(f"{record.proposal_id} has no metric_snapshot to measure against")
    refs = [ref("metric", snap.metric), ref("value", value), ref("baseline", snap.baseline)]
    if rollback_id:
        refs.append(ref("rollback_proposal", rollback_id))
    reason = (f"{snap.metric} {value} against baseline {snap.baseline}: "
              + ("a regression beyond the tolerance; its recorded rollback is proposed as "
                 f"{rollback_id}" if verdict == REGRESSED else "held"))
    draft = Draft(from_stage=record.stage, to_stage="learn-back", actor=actor,
                  observer_type="rec:system", verdict=verdict, reason=reason, refs=tuple(refs))
    return record.replace(measured=verdict, updated_at=now), draft
