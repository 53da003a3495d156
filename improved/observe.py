"""Stage 1, observe: analyzers turn signals that name no proposal into candidate proposals.

An analyzer is anything with an `id` and `observe(svc, signal) -> list[Candidate]`. Candidates are
ranked by score; those at or above the threshold are proposed through the bus like any other
proposal, so they meet the same guards. Candidates are deterministic in their inputs (no clock, no
instance id), so two replicas that see the same signals propose the same id.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from . import gradient
from .guards import session_of
from .model import AnalyzerRef, Origin, Proposal, Signal, Summary


@dataclass(frozen=True)
class Candidate:
    proposal: Proposal
    score: float


class Analyzer(Protocol):
    id: str

    def observe(self, svc: str, signal: Signal) -> list[Candidate]: ...


@dataclass
class RegressionAnalyzer:
    """Negative metric or world signals about one target, from `threshold` distinct sessions
    within `window_ms`, become an L1 proposal to investigate: surfaced, never applied."""

    id: str = "improved.metric_regression/1"
    threshold: int = 3
    window_ms: int = 3600 * 1000
    _seen: dict[tuple[str, str], list[Signal]] = field(default_factory=lambda: defaultdict(list))

    def observe(self, svc: str, signal: Signal) -> list[Candidate]:
        if signal.positive or signal.kind not in ("metric", "world") or not signal.target_ref:
            return []
        key = (svc, signal.target_ref)
        window = [s for s in self._seen[key] if s.at > signal.at - self.window_ms]
        if signal not in window:
            window.append(signal)
        self._seen[key] = window
        sessions = {session_of(s.actor) for s in window}
        if len(sessions) < self.threshold:
            return []
        del self._seen[key]
        evidence = sorted(window, key=lambda s: (s.at, s.actor))
        metric = signal.name or signal.kind
        proposal = Proposal(
            service=svc,
            target_ref=signal.target_ref,
            change_class="L1",
            scope=gradient.implied_scope(gradient.scheme_of(signal.target_ref)),
            origin=Origin(actor="improved", service="improved"),
            analyzer=AnalyzerRef(id=self.id, params={"threshold": self.threshold,
                                                     "window_ms": self.window_ms}),
            summary=Summary(template_id="investigate_regression",
                            args={"count": len(evidence), "metric": metric,
                                  "target": signal.target_ref}),
            proposal_data={"investigate": signal.target_ref, "metric": metric},
            created_at=max(s.at for s in evidence),
            signals=evidence,
        )
        return [Candidate(proposal, score=float(len(sessions)))]


@dataclass
class Observer:
    analyzers: list[Analyzer]
    threshold: float = 0.0

    def observe(self, svc: str, signal: Signal) -> list[Proposal]:
        """Every analyzer's candidates for this signal, best first, above the threshold."""
        candidates = [c for a in self.analyzers for c in a.observe(svc, signal)]
        candidates.sort(key=lambda c: -c.score)
        return [c.proposal for c in candidates if c.score >= self.threshold]
