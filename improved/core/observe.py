"""Stage 1, observe: analyzers turn signals that name no proposal into candidate proposals.

Pure (sans-IO). An analyzer says which of its windows a signal concerns (`target`), and folds the
signal into that window (`step(svc, window, signal) -> (new window, candidates)`); the shell
(`runtime.observing`) reads the window from where the replicas share it, lets the analyzer step,
and writes the new window back only if no one wrote it meanwhile, stepping again on the window
it finds otherwise. So each replica of the daemon, seeing only part of the signals, folds them
into one window, and two replicas that see the same signals propose the same id: a candidate is
a function of its evidence (no clock, no instance id, no arrival order).

Candidates whose score (their evidence) reaches the threshold are proposed through the bus like
any other proposal, so they meet every guard, ranked by score times the analyzer's learned
weight (`Observer.rank`): the weight orders them, never keeps one back. A window is an output of signals anyone can send: it may only ever lead to a *proposal*,
never to authority — nothing but the proposal it makes reads it, and that proposal is triaged,
gated and reviewed like one a service sent. The same holds for the learned weights (`Counts`):
they decide whether a candidate is surfaced, never whether anything is applied.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar

import msgspec
from msgspec import Struct

from improved.core import gradient, trailers
from improved.core.guards import session_of
from improved.protocol.model import AnalyzerRef, Origin, Proposal, Signal, Summary, Trailer

MAX_TRACKED: Final = 10_000  # windows an analyzer keeps (the shell's store drops the oldest)
MAX_PER_TARGET: Final = 256  # signals kept per window (the newest)
# ... and at most this many bytes of them, encoded (the newest): a window is one stored value,
# and the evidence of the candidate it made is kept beside it, so a stored window stays below
# twice this (and the broker's 1 MiB message limit) whatever the signals carry.
MAX_WINDOW_BYTES: Final = 256 * 1024
MAX_COUNTED: Final = 64  # trailer hashes a weight remembers, to count a retried one once


class Window(Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """One analyzer's memory of one target: the signals that may still add up to a candidate
    (arrival order, newest last), and the evidence of the candidate it made last, so that a
    redelivery of any of that evidence makes the same candidate again (the shell may have
    written the window and then failed before its proposal was on the bus)."""

    signals: tuple[Signal, ...] = ()
    proposed: tuple[Signal, ...] = ()


EMPTY: Final = Window()
_encoder = msgspec.json.Encoder()
Stored = TypeVar("Stored", "Window", "Counts")


def decode(data: bytes | None, default: Stored) -> Stored:
    """A stored window or counts, of the type of `default`; an absent or unreadable value is
    `default` (an empty window, no counts): a hint toward a proposal, never worth refusing a
    signal or a transition over."""
    if not data:
        return default
    try:
        return msgspec.json.decode(data, type=type(default))
    except msgspec.MsgspecError:
        return default


def encode(value: Window | Counts) -> bytes:
    return _encoder.encode(value)


def bounded(signals: Sequence[Signal]) -> tuple[Signal, ...]:
    """The newest signals that fit a window: at most MAX_PER_TARGET, MAX_WINDOW_BYTES in all
    (a signal larger than that on its own is never kept)."""
    kept: list[Signal] = []
    size = 0
    for s in reversed(signals[-MAX_PER_TARGET:]):
        size += len(_encoder.encode(s)) + 1  # and its comma
        if size > MAX_WINDOW_BYTES:
            break
        kept.append(s)
    return tuple(reversed(kept))


def _added(window: Window, signal: Signal, keep: Iterable[Signal] | None = None) -> list[Signal]:
    seen = list(window.signals if keep is None else keep)
    if signal not in seen:
        seen.append(signal)
    return seen


def _evidence(signals: Iterable[Signal]) -> tuple[Signal, ...]:
    return tuple(sorted(signals, key=lambda s: (s.at, s.actor)))


@dataclass(frozen=True)
class Candidate:
    proposal: Proposal
    score: float


class Analyzer(Protocol):
    id: str

    def target(self, svc: str, signal: Signal) -> str | None:
        """The target whose window `signal` may change; None when it is not for this analyzer."""
        ...

    def step(self, svc: str, window: Window, signal: Signal
             ) -> tuple[Window, list[Candidate]]:
        """Fold `signal` into `window` (the one its target names): the new window (`window`
        itself when nothing changed) and the candidates it completes."""
        ...


@dataclass
class RegressionAnalyzer:
    """Negative metric or world signals about one target, from `threshold` distinct sessions
    within `window_ms`, become an L1 proposal to investigate: surfaced, never applied."""

    id: str = "improved.metric_regression/1"
    threshold: int = 3
    window_ms: int = 3600 * 1000

    def target(self, svc: str, signal: Signal) -> str | None:
        if signal.positive or signal.kind not in ("metric", "world"):
            return None
        return signal.target_ref or None

    def step(self, svc: str, window: Window, signal: Signal
             ) -> tuple[Window, list[Candidate]]:
        if signal in window.proposed:  # a redelivery: the candidate it completed, again
            return window, [self._candidate(svc, window.proposed)]
        recent = (s for s in window.signals if s.at > signal.at - self.window_ms)
        kept = bounded(_added(window, signal, recent))
        if len({session_of(s.actor) for s in kept}) < self.threshold:
            return Window(kept, window.proposed), []
        evidence = _evidence(kept)
        return Window((), evidence), [self._candidate(svc, evidence)]

    def _candidate(self, svc: str, evidence: tuple[Signal, ...]) -> Candidate:
        newest = evidence[-1]
        target = newest.target_ref or ""
        metric = newest.name or newest.kind
        proposal = Proposal(
            service=svc,
            target_ref=target,
            change_class="L1",
            scope=gradient.implied_scope(gradient.scheme_of(target)),
            origin=Origin(actor="improved", service="improved"),
            analyzer=AnalyzerRef(id=self.id, params={"threshold": self.threshold,
                                                     "window_ms": self.window_ms}),
            summary=Summary(template_id="investigate_regression",
                            args={"count": len(evidence), "metric": metric, "target": target}),
            proposal_data={"investigate": target, "metric": metric},
            created_at=newest.at,
            signals=list(evidence),
        )
        return Candidate(proposal, score=float(len({session_of(s.actor) for s in evidence})))


@dataclass
class StaleSkillAnalyzer:
    """A skill whose outcomes have turned negative — `threshold` negative refine or check
    signals from distinct sessions since its last positive one — becomes an L2 proposal to
    archive it (an operator decides; archival is not undone by itself)."""

    id: str = "improved.stale_skill/1"
    threshold: int = 3

    def target(self, svc: str, signal: Signal) -> str | None:
        ref = signal.target_ref
        if not ref or not ref.startswith("skill:") or signal.kind not in ("refine", "check"):
            return None
        return ref

    def step(self, svc: str, window: Window, signal: Signal
             ) -> tuple[Window, list[Candidate]]:
        if signal.positive:  # a success: the skill is not stale
            return (Window((), window.proposed) if window.signals else window), []
        if signal in window.proposed:
            return window, [self._candidate(svc, window.proposed)]
        seen = bounded(_added(window, signal))
        if len({session_of(s.actor) for s in seen}) < self.threshold:
            return Window(seen, window.proposed), []
        evidence = _evidence(seen)
        return Window((), evidence), [self._candidate(svc, evidence)]

    def _candidate(self, svc: str, evidence: tuple[Signal, ...]) -> Candidate:
        ref = evidence[-1].target_ref or ""
        name = ref.split(":", 1)[1]
        proposal = Proposal(
            service=svc, target_ref=ref, change_class="L2", scope="knowledge",
            origin=Origin(actor="improved", service="improved"),
            analyzer=AnalyzerRef(id=self.id, params={"threshold": self.threshold}),
            summary=Summary(template_id="archive_skill",
                            args={"name": name, "count": len(evidence)}),
            proposal_data={"archive": name},
            created_at=evidence[-1].at,
            signals=list(evidence),
        )
        return Candidate(proposal, score=float(len({session_of(s.actor) for s in evidence})))


# -- learned weights -------------------------------------------------------------------------------


class Counts(Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """What operators (or the policy) made of one analyzer's proposals: how many were accepted
    and rejected, each counted once for the trailer that recorded it. `counted` holds the
    hashes of the last MAX_COUNTED trailers counted, newest last: a count retried after its
    write was in doubt (a lost acknowledgement) finds its hash there and counts nothing. A
    trailer is committed once (the chain append is exclusive), so only a retry of that one
    write can repeat it, within moments; the hashes also name, for an auditor, trailers on the
    audit chain that the counts came from."""

    accepted: int = 0
    rejected: int = 0
    counted: tuple[str, ...] = ()


NO_COUNTS: Final = Counts()


def lesson(trailer: Trailer, data: trailers.TrailerData | None = None) -> bool | None:
    """What a committed trailer teaches the analyzer of its proposal: accepted (an operator's
    approval, or an automatic apply under the policy), rejected (an operator's rejection), or
    nothing (None). `data`: what the trailer says, when the caller decoded it already."""
    if data is None:
        try:
            data = trailers.decode(trailer)
        except trailers.TrailerDataError:
            return None
    after = trailers.moves_to(data)
    if isinstance(data, trailers.Approved) or (after == "applied" and trailer.observer_type == "rec:policy"):
        return True
    if after == "rejected" and trailer.observer_type == "human":
        return False
    return None


def counted(counts: Counts, trailer_hash: str, accepted: bool) -> Counts | None:
    """`counts` with the trailer `trailer_hash` counted; None when it already is."""
    if trailer_hash in counts.counted:
        return None
    return Counts(accepted=counts.accepted + accepted, rejected=counts.rejected + (not accepted),
                  counted=(*counts.counted, trailer_hash)[-MAX_COUNTED:])


def weight(counts: Counts) -> float:
    """The share of an analyzer's proposals operators accepted, Laplace-smoothed (a new
    analyzer starts at one half)."""
    return (counts.accepted + 1) / (counts.accepted + counts.rejected + 2)


@dataclass(frozen=True)
class Observer:
    """The analyzers of stage 1 and the threshold their candidates' weighted scores must
    reach to be proposed."""

    analyzers: Sequence[Analyzer]
    threshold: float = 1.0

    def knows(self, analyzer_id: str) -> bool:
        return any(a.id == analyzer_id for a in self.analyzers)

    def rank(self, found: Iterable[tuple[str, Candidate]],
             counts: Mapping[str, Counts]) -> list[Proposal]:
        """The candidates `found` (analyzer id, candidate) whose own evidence reaches the
        threshold, best first by score times the analyzer's learned weight. The weight only
        orders: the counts live in a bucket any bus participant could rewrite, and what the
        evidence calls for is proposed whatever they say (a proposal meets every guard)."""
        kept = [(c.score * weight(counts.get(aid, NO_COUNTS)), c.proposal) for aid, c in found
                if c.score >= self.threshold]
        kept.sort(key=lambda rc: -rc[0])
        return [p for _, p in kept]
