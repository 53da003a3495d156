"""Stage 1, observe: analyzers turn signals that name no proposal into candidate proposals.

An analyzer is anything with an `id` and `observe(svc, signal) -> list[Candidate]`. Candidates are
ranked by score; those at or above the threshold are proposed through the bus like any other
proposal, so they meet the same guards. Candidates are deterministic in their inputs (no clock, no
instance id), so two replicas that see the same signals propose the same id.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Final, Protocol

from improved.core import gradient
from improved.core.guards import session_of
from improved.protocol.model import AnalyzerRef, Origin, Proposal, Signal, Summary

MAX_TRACKED: Final = 10_000  # targets an analyzer remembers; the least recently seen go first
MAX_PER_TARGET: Final = 256  # signals kept per target (the newest)


class Bounded(OrderedDict[tuple[str, str], list[Signal]]):
    """Per-target signal lists whose memory stays flat however many distinct targets and
    signals arrive (a bus participant can send a million): at most MAX_TRACKED targets, the
    least recently seen dropped first, and at most MAX_PER_TARGET signals each."""

    def take(self, key: tuple[str, str]) -> list[Signal]:
        seen = self.pop(key, [])
        self[key] = seen
        while len(self) > MAX_TRACKED:
            self.popitem(last=False)
        return seen

    def keep(self, key: tuple[str, str], signals: list[Signal]) -> None:
        self[key] = signals[-MAX_PER_TARGET:]


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
    _seen: Bounded = field(default_factory=Bounded)

    def observe(self, svc: str, signal: Signal) -> list[Candidate]:
        if signal.positive or signal.kind not in ("metric", "world") or not signal.target_ref:
            return []
        key = (svc, signal.target_ref)
        window = [s for s in self._seen.take(key) if s.at > signal.at - self.window_ms]
        if signal not in window:
            window.append(signal)
        self._seen.keep(key, window)
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
class StaleSkillAnalyzer:
    """A skill whose outcomes have turned negative — `threshold` negative refine or check
    signals from distinct sessions since its last positive one — becomes an L2 proposal to
    archive it (an operator decides; archival is not undone by itself)."""

    id: str = "improved.stale_skill/1"
    threshold: int = 3
    _negatives: Bounded = field(default_factory=Bounded)

    def observe(self, svc: str, signal: Signal) -> list[Candidate]:
        ref = signal.target_ref
        if not ref or not ref.startswith("skill:") or signal.kind not in ("refine", "check"):
            return []
        key = (svc, ref)
        if signal.positive:
            self._negatives.pop(key, None)  # a success: the skill is not stale
            return []
        seen = self._negatives.take(key)
        if signal not in seen:
            seen.append(signal)
        self._negatives.keep(key, seen)
        seen = self._negatives[key]
        sessions = {session_of(s.actor) for s in seen}
        if len(sessions) < self.threshold:
            return []
        del self._negatives[key]
        name = ref.split(":", 1)[1]
        evidence = sorted(seen, key=lambda s: (s.at, s.actor))
        proposal = Proposal(
            service=svc, target_ref=ref, change_class="L2", scope="knowledge",
            origin=Origin(actor="improved", service="improved"),
            analyzer=AnalyzerRef(id=self.id, params={"threshold": self.threshold}),
            summary=Summary(template_id="archive_skill",
                            args={"name": name, "count": len(evidence)}),
            proposal_data={"archive": name},
            created_at=max(s.at for s in evidence),
            signals=evidence,
        )
        return [Candidate(proposal, score=float(len(sessions)))]


@dataclass
class Observer:
    """Ranks every analyzer's candidates by score times the analyzer's learned weight: the
    share of its proposals operators accepted (Laplace-smoothed, so a new analyzer starts at
    one half). Candidates below the threshold are not proposed."""

    analyzers: list[Analyzer]
    threshold: float = 1.0
    history: dict[str, list[int]] = field(default_factory=dict)  # id → [accepted, rejected]

    def weight(self, analyzer_id: str) -> float:
        accepted, rejected = self.history.get(analyzer_id, [0, 0])
        return (accepted + 1) / (accepted + rejected + 2)

    def learn(self, analyzer_id: str, accepted: bool) -> None:
        """Learn-back: an operator (or the policy) accepted or rejected one of its proposals."""
        if analyzer_id not in {a.id for a in self.analyzers}:
            return
        counts = self.history.setdefault(analyzer_id, [0, 0])
        counts[0 if accepted else 1] += 1

    def observe(self, svc: str, signal: Signal) -> list[Proposal]:
        """Every analyzer's candidates for this signal, best first, above the threshold."""
        ranked = [(c.score * self.weight(a.id), c.proposal)
                  for a in self.analyzers for c in a.observe(svc, signal)]
        ranked.sort(key=lambda rc: -rc[0])
        return [p for score, p in ranked if score >= self.threshold]
