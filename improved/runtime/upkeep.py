"""What the daemon keeps doing besides its inbound work: wake each applied proposal for its
measurement at review_after, sweep expired proposals out of the review index at their
`valid_to`, recount the operator's queue, and refill the retained records and the indexes
from the chains when the broker lost them. Every pass decides from the chain: what these read
only says where to look.
"""

from __future__ import annotations

import time

import anyio
import structlog
from nats.aio.client import Client

from improved.client.indexing import chains_start
from improved.core import queue
from improved.protocol.model import (
    ReviewEntry,
)
from improved.runtime.engine import Engine
from improved.runtime.records import ChainBroken
from improved.runtime.store import Store

log = structlog.get_logger("improved.daemon")

CACHE_CHECK_S = 5.0  # how often the records are checked for a loss and the queue recounted
REVIEW_TICK_S = 1.0  # the longest the review_after wake-up sleeps before looking again
REVIEW_RETRY_S = 5.0  # a measurement pass that failed (an outage) is tried again after this


class Upkeep:
    """The periodic passes of a started daemon, until `stopping` is set."""

    def __init__(self, nc: Client, store: Store, engine: Engine, stopping: anyio.Event):
        self.nc = nc
        self.store = store
        self.engine = engine
        self._stopping = stopping
        self._refill = anyio.Lock()  # one refill of the records and the index at a time
        # the expiry sweep: the earliest valid_to ahead among the review index's entries (as
        # last read, lowered by this process's own index writes), and a wake-up when it drops
        self._next_expiry: int | None = None
        self._told: int | None = None  # the earliest valid_to `indexed` was told, to come
        self._expiry_wake = anyio.Event()
        self._sweeping = anyio.Lock()

    def wake(self) -> None:
        """Wake the expiry sweep now (a stop: it then ends)."""
        self._expiry_wake.set()

    async def pause(self, seconds: float) -> None:
        """Sleep `seconds`, or less when the daemon is stopping."""
        with anyio.move_on_after(seconds):
            await self._stopping.wait()

    async def reviews(self) -> None:
        """Learn-back at review_after: when an applied proposal's `metric_snapshot.review_after`
        comes, make a pass over it, which asks the owning service for the metric
        (`<svc>.improve.measure`) and records held, regressed or unmeasured."""
        while not self._stopping.is_set():
            now = int(time.time() * 1000)
            upcoming = [at for at, _ in self.engine.reviews.values()]
            wait = min([REVIEW_TICK_S, *((at - now) / 1000 for at in upcoming)])
            if wait > 0:
                await self.pause(wait)
                continue
            async with anyio.create_task_group() as tg:
                for svc, pid in self.engine.due_reviews(now):
                    tg.start_soon(self._review_due, svc, pid)

    async def _review_due(self, svc: str, pid: str) -> None:
        try:
            await self.engine.advance(svc, pid)
        except ChainBroken as exc:  # the crisis is open; nothing is decided on this chain
            log.error("measurement skipped: its chain does not verify", proposal_id=pid,
                      problem=str(exc))
        except Exception as exc:  # a broker outage: try again a little later
            log.warning("learn-back measurement failed; trying again", proposal_id=pid,
                        error=f"{type(exc).__name__}: {exc}")
            self.engine.reviews[pid] = (int(time.time() * 1000 + REVIEW_RETRY_S * 1000), svc)

    async def recount(self) -> None:
        """Read the review index once, in O(open items): set the pending-reviews metric to its
        entries (what `review` lists, the same on every replica) and the oldest one's wait,
        and record the expiry of each whose `valid_to` has passed, so it leaves the queue
        (`_sweep`)."""
        try:
            entries = await self.store.read_index()
        except Exception as exc:  # a metric and a sweep: never worth stopping the daemon for
            log.warning("could not count the proposals waiting for review",
                        error=f"{type(exc).__name__}: {exc}")
            return
        self.engine.set_queue_size(len(entries))
        self.engine.metrics.set_oldest_review(min((e.since for e in entries), default=None))
        await self._sweep(entries)

    async def _sweep(self, entries: list[ReviewEntry]) -> None:
        """Carry on every indexed proposal whose `valid_to` has passed: the pass records its
        expiry on the chain (the planner decides, from the chain: an entry only says where to
        look) and takes it out of the index; then note when the next is due. Its cost follows
        the open items, never the history; every replica may sweep, and the chain append lets
        one expiry through."""
        async with self._sweeping:
            now = int(time.time() * 1000)
            due, ahead = queue.due(entries, now)
            for entry in due:
                if self._stopping.is_set():
                    return
                try:
                    await self.engine.advance(entry.service, entry.proposal_id)
                except Exception as exc:  # the next sweep tries again
                    log.warning("expiry not recorded yet", proposal_id=entry.proposal_id,
                                error=f"{type(exc).__name__}: {exc}")
            # an entry this process wrote may be missing from what was read (its publish was
            # still in flight): what `indexed` was told stands until its valid_to has passed
            told = self._told
            if told is not None and told <= now:
                self._told = told = None
            self._next_expiry = ahead if told is None or (ahead is not None and ahead < told) \
                else told

    def indexed(self, valid_to: int) -> None:
        """This process wrote an index entry that expires at `valid_to`: wake the sweep when
        that is earlier than what it waits for."""
        if self._told is None or valid_to < self._told:
            self._told = valid_to  # a sweep may read the index before this entry is in it
        if self._next_expiry is None or valid_to < self._next_expiry:
            self._next_expiry = valid_to
            self._expiry_wake.set()

    async def expiries(self) -> None:
        """Sweep the review index as soon as the earliest `valid_to` in it has passed, so an
        expired proposal leaves the queue at its `valid_to`, not at the next records check
        (which sweeps too, every CACHE_CHECK_S: entries other replicas wrote, or written before
        a restart)."""
        while not self._stopping.is_set():
            self._expiry_wake = anyio.Event()
            wait = CACHE_CHECK_S
            if self._next_expiry is not None:
                wait = min(wait, max(0.0, self._next_expiry / 1000 - time.time()))
            with anyio.move_on_after(wait):
                await self._expiry_wake.wait()
            if self._stopping.is_set():
                return
            if self._next_expiry is not None and self._next_expiry <= time.time() * 1000 \
                    and self.nc.is_connected:
                await self.recount()

    async def republish_if_lost(self) -> bool:
        """When the retained records or the review index were lost — records in memory storage
        across a broker restart, a purge, or an upgrade from a version without the index —
        republish them from the chains, so `review`, the metric and late joiners read the
        truth again; True when it did. A broker restart over file storage loses neither.

        A loss is told by the marker a complete refill leaves in the records stream
        (`Store.filled`), never by an empty stream: a proposal that arrives during the
        reconnect lands in a new stream first, and one record must not pass for all of them.
        The marker names the stream as it was when the refill began, so a refill cut short by
        another restart, or outrun by one, leaves no valid marker behind and the next check
        refills again."""
        async with self._refill:
            seen = await self.store.incarnation()
            if await self.store.filled(seen):
                return False
            if await self.store.has_chains():
                started = time.perf_counter()
                start, where = await chains_start(self.store, set(
                    self.engine.trust.chain_trust.daemons))
                count = await self.engine.publisher.republish_all(start)
                # a new data directory has only the daemon's own chains: nothing was lost;
                # records in memory storage are lost by every broker restart, as expected
                expected = not count or self.store.records_storage == "memory"
                say = log.info if expected else log.warning
                say("retained records and the review index refilled from the audit chains",
                    chains=count, read=where, seconds=round(time.perf_counter() - started, 2))
            await self.store.mark_filled(seen)
            return True

    async def reconnected(self) -> None:
        self.engine.metrics.set_connected(True)
        await self.restore(ensure=True)
        await self.engine.republish_unpublished()
        await self.recount()

    async def restore(self, ensure: bool) -> bool:
        """Bring the streams and buckets back and refill what the broker lost, retried until it
        holds: a single failed attempt (JetStream still recovering, a second restart) must not
        leave the records half-filled until some later reconnect. Whether it refilled; never
        raises."""
        delay = 0.2
        while not self._stopping.is_set():
            try:
                if ensure:
                    await self.store.ensure()
                return await self.republish_if_lost()
            except Exception as exc:
                log.warning("could not restore the retained records yet; trying again",
                            error=f"{type(exc).__name__}: {exc}", retry_in_s=delay)
            ensure = True  # the bucket may be gone without a reconnect having told us
            await self.pause(delay)
            delay = min(delay * 2, 5.0)
        return False

    async def watch_records(self) -> None:
        """Every few seconds, check the records' marker — a loss no reconnect announced (a
        purge, the replicas of a memory stream all restarted) is refilled too — publish again
        the records a broker outage kept from being published, and recount the queue from the
        index, so every replica's metric says what the index says."""
        while not self._stopping.is_set():
            await self.pause(CACHE_CHECK_S)
            if self._stopping.is_set() or not self.nc.is_connected:
                continue
            await self.restore(ensure=False)
            await self.engine.republish_unpublished()
            await self.recount()
