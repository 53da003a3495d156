"""Each index read against the last checkpoint this process signed, as a reader reads it: what it
omitted or holds wrongly is rewritten from the chains, and counts the chains do not bear out are
counted again at the next checkpoint. The measurement index read so is also how a restart
remembers every measurement still owed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from improved.client import indexing
from improved.client.config import Config
from improved.core import indexes
from improved.runtime.engine import Engine
from improved.runtime.store import Store

log = structlog.get_logger("improved.daemon")

SETTLE_S = 10.0  # how long an index check waits for the passes in progress to write them


class IndexChecks:
    """The index checks of this daemon; `indexed` is told the `valid_to` of every review entry
    they write again (the expiry sweep's wake-up)."""

    def __init__(self, store: Store, engine: Engine, config: Config,
                 indexed: Callable[[int], None]):
        self.store = store
        self.engine = engine
        self.config = config
        self.indexed = indexed

    async def find_reviews(self) -> None:
        """Remember every measurement still to make: the measurement index read against the
        last checkpoint (`check_index`), so a restart wakes each at the review_after its
        chain says, whoever applied it and however long ago, whatever was done to its entry;
        O(open measurements) while the index holds every one."""
        await self.check_index("due")

    async def check_indexes(self) -> None:
        """Each index read against the last checkpoint this process signed: at start, and
        after every checkpoint (so at most once per checkpoint), once the passes in progress
        here have written what their trailers moved."""
        await self.engine.locks.passes_done(SETTLE_S)
        for name in indexes.INDEXES:
            await self.check_index(name)

    async def check_index(self, name: str) -> None:
        """Read the index `name` as a reader does (`indexing.read`), against the counts of the
        last checkpoint this process signed; what it omitted (or holds wrongly) is rewritten
        from the chains, named in an error; counts the chains do not bear out are counted
        again at the next checkpoint. For the measurement index, every member is remembered
        with the review_after its chain says. Never raises: the next checkpoint tries again."""
        daemons = set(self.engine.trust.chain_trust.daemons)
        counted = self.engine.checkpoints.counted
        try:
            found = await indexing.read(
                self.store, name, counted, "this daemon has signed no checkpoint yet",
                indexing.trust_of(daemons), self.config.policy, int(time.time() * 1000),
                self.store.tombstone_ttl_s, daemons)
            if name == "due":
                for record in found.members:
                    self.engine.expect_review(record)
                if found.members:
                    log.info("measurements to make", count=len(found.members))
            await self._repair(found, counted)
        except Exception as exc:
            log.warning("could not check an index against the chains", index=name,
                        error=f"{type(exc).__name__}: {exc}")

    async def _repair(self, found: indexing.IndexRead, counted: indexing.Counted | None) -> None:
        """Write again the entry of every member whose subject lost it or holds another one,
        unless a pass of this process is on it or the entry came meanwhile; the lost ones
        named in an error. When the chains were read and do not bear out the checkpoint's
        count, the next checkpoint counts from the chains."""
        index = indexes.INDEXES[found.index]
        lost: list[str] = []
        rewritten: list[str] = []
        for record in found.wrong:
            pid = record.proposal_id
            if self.engine.locks.busy(pid):
                continue
            entry = index.entry(record)
            held = await self.store.index_subject(found.index, record.service, pid)
            if held == entry:
                continue
            await self.store.index_entry(found.index, record.service, pid, entry)
            if found.index == "review" and entry.valid_to is not None:
                self.indexed(entry.valid_to)
            (lost if held is None else rewritten).append(pid)
        if found.source == "chains":
            count = counted.members.get(found.index) if counted and counted.members else None
            if count is not None and found.chains_counted is not None \
                    and found.chains_counted != count:
                log.error("an index count is off the chains; counting again at the next "
                          "checkpoint", index=found.index, counted=count,
                          chains=found.chains_counted)
                self.engine.checkpoints.recount()
        why = {"why": found.why} if found.source == "chains" else {}
        if lost:
            log.error("index entries of members lost (tombstoned, purged or never written); "
                      "rewritten from their chains", index=found.index, lost=lost,
                      rewritten=rewritten, shortfall=found.short, **why)
        elif rewritten:
            log.warning("index entries differed from their chains; rewritten",
                        index=found.index, rewritten=rewritten, **why)
        elif found.source == "chains":
            log.warning("an index was read from the audit chains; it lists every member now",
                        index=found.index, shortfall=found.short, **why)
