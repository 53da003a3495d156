"""Stage 5, learn-back: count outcome signals per proposal, each with its independence.

A signal is counted once (by its digest); counting it is a transition with its own trailer, so
the signal set — and with it the feedback-collapse guard — can be rebuilt from the chain.
"""

from __future__ import annotations

from .audit import Draft
from .config import Policy
from .model import LearnBack, Signal
from .propose import count, signal_digest
from .record import SIGNAL, CountedSignal, ProposalRecord, ref


def observe_signal(record: ProposalRecord, signal: Signal, policy: Policy,
                   now: int) -> tuple[ProposalRecord, Draft, CountedSignal] | None:
    """Count `signal` for `record`; None when it was counted before (a redelivery)."""
    digest = signal_digest(signal)
    if any(s.digest == digest for s in record.signals):
        return None
    counted = count(signal, digest, record.proposal, record.applied_at, policy)
    observer = "human" if signal.actor.startswith("operator:") else "rec:agent"
    sign = "positive" if signal.positive else "negative"
    independence = "independent" if counted.independent else "not independent"
    draft = Draft(
        from_stage=record.stage, to_stage="learn-back", actor=signal.actor,
        observer_type=observer, verdict=SIGNAL,
        reason=f"{sign} {signal.kind} signal from {signal.service}, {independence}",
        refs=(ref("signal", digest), ref("kind", signal.kind), ref("service", signal.service),
              ref("positive", signal.positive), ref("independent", counted.independent),
              ref("at", signal.at)),
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
