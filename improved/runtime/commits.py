"""What one pass of the engine decides, appended as one commit: the trailers it seals in a
row (a registration, its triage decision and the dispatch intent, say), each folded into the
record as it is decided, then appended together in one message before anything leaves the
pass. One message, one fsync and one compare-and-set for what was decided together; each
trailer still hashed and linked on its own, the last one signed for the commit
(docs/protocol.md, "Audit trailers" and "Authenticated chains").
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from improved.core import indexes, observe
from improved.core.audit import Draft
from improved.core.record import PENDING_SEQ, ProposalRecord, settle
from improved.core.trailers import TrailerData
from improved.protocol.model import Trailer
from improved.runtime.metrics import Metrics
from improved.runtime.store import Store
from improved.runtime.telemetry import Tracing

log = structlog.get_logger("improved.engine")


@dataclass
class _Commit:
    """The trailers a pass decided since its last append, to go in one message, with their
    typed data; `expected` is the stream sequence the chain ended at before them."""

    expected: int
    trailers: list[tuple[Trailer, TrailerData | None]]
    # with tracing on: when each trailer's stage began and decided (ns since the epoch)
    spans: list[tuple[int, int]] = field(default_factory=list)


class Commits:
    """The commits of the passes in progress, by proposal id (one pass per proposal at a time:
    `ProposalLocks`), and what follows each appended trailer."""

    def __init__(self, store: Store, metrics: Metrics, tracing: Tracing | None = None):
        self.store = store
        self.metrics = metrics
        self.tracing = tracing or Tracing()
        # observe's learn-back, once per appended trailer: (analyzer id, accepted, its hash)
        self.learn: Callable[[str, bool, str], Awaitable[None]] | None = None
        self._pending: dict[str, _Commit] = {}
        self._moved: dict[str, set[str]] = {}  # the indexes the pass's trailers moved
        self._started: dict[str, float] = {}  # when the pass began (the stage metric)
        self._marks: dict[str, int] = {}  # tracing: when the pass's last stage decided (ns)

    def begin(self, pid: str) -> None:
        self._started[pid] = time.perf_counter()
        if self.tracing.on:
            self._marks[pid] = time.time_ns()

    def discard(self, pid: str) -> None:
        """The pass starts over (its chain moved): what it decided was not appended."""
        self._pending.pop(pid, None)
        self._moved.pop(pid, None)

    def end(self, pid: str) -> None:
        self.discard(pid)
        self._started.pop(pid, None)
        self._marks.pop(pid, None)

    def pending(self, record: ProposalRecord) -> bool:
        """Whether the pass on `record` holds trailers not appended yet."""
        return record.proposal_id in self._pending

    def moved(self, pid: str) -> set[str]:
        """The indexes the pass's appended trailers moved (asked once, after the pass)."""
        return self._moved.pop(pid, set())

    def add(self, before: ProposalRecord | None, record: ProposalRecord, draft: Draft,
            at: int) -> ProposalRecord:
        """Seal `draft` at `at` (the instant the stage decided) onto `record` and add it to the
        pass's commit: the record after it is the fold of the trailer (`record.fold`), as a
        rebuild makes it, at PENDING_SEQ until `append`. `before` is the record at the chain's
        end (None: the chain begins, and `record` is the registration's new record); the
        trailer says which indexes it moves (`indexes.sealed`)."""
        trailer, data, after = indexes.sealed(before, record, draft, at, PENDING_SEQ)
        pid = record.proposal_id
        pending = self._pending.get(pid)
        if pending is None:
            pending = self._pending[pid] = _Commit(record.chain.stream_seq, [])
        pending.trailers.append((trailer, data))
        if self.tracing.on:  # the stage ran from the pass's last decision to this one
            now = time.time_ns()
            pending.spans.append((self._marks.get(pid, now), now))
            self._marks[pid] = now
        moved = indexes.moves(trailer.refs)
        if moved:  # what this pass moved, for the engine's index writes
            self._moved.setdefault(pid, set()).update(moved)
        return after

    async def append(self, record: ProposalRecord) -> ProposalRecord:
        """Append the pass's commit, if it has one, in one message — the commit point, with
        the expected last sequence it was decided on (`ChainConflict` when the chain moved) —
        and `record` settled at the message's stream sequence (`record.settle`). Each trailer
        is then logged, counted and learnt from."""
        pending = self._pending.pop(record.proposal_id, None)
        if pending is None:
            return record
        seq = await self.store.append(record.service, record.proposal_id,
                                      [t for t, _ in pending.trailers], pending.expected)
        record = settle(record, seq)
        for trailer, data in pending.trailers:
            await self._appended(record, trailer, data)
        if self.tracing.on:  # only what the chain holds is traced: a conflict traces nothing
            for (trailer, _), (began, decided) in zip(pending.trailers, pending.spans,
                                                      strict=True):
                self.tracing.transition(record, trailer, began, decided)
        return record

    async def _appended(self, record: ProposalRecord, trailer: Trailer,
                        data: TrailerData | None) -> None:
        """What follows one appended trailer: its log line, its metrics, observe's lesson."""
        log.info("transition", proposal_id=record.proposal_id, stage=trailer.to_stage,
                 **{"class": record.gate_class}, verdict=trailer.verdict, cause=trailer.cause,
                 seq=trailer.seq)
        self.metrics.transition(trailer.to_stage, trailer.verdict, trailer.cause,
                                record.gate_class)
        started = self._started.get(record.proposal_id)
        if started is not None:  # from the message's arrival to this transition
            self.metrics.observe_stage(trailer.to_stage, time.perf_counter() - started)
        if trailer.to_stage == "apply" and trailer.verdict in ("applied", "failed",
                                                               "rolled_back"):
            self.metrics.apply_result("ok" if trailer.verdict == "applied"
                                      else trailer.verdict)
        self.metrics.decided(trailer.verdict, record.gate_class)  # triage decisions, rollbacks
        if trailer.verdict in ("applied", "failed") and record.dispatched_at is not None:
            self.metrics.observe_apply("ok" if trailer.verdict == "applied" else "failed",
                                       (trailer.at - record.dispatched_at) / 1000)
        if self.learn is not None and (accepted := observe.lesson(trailer, data)) is not None:
            await self.learn(record.proposal.analyzer.id, accepted, trailer.hash)
