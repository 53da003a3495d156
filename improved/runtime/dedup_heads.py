"""The dedup heads this process claimed, from the claim to the close: whether each carries a
closed proposal's TTL already (a lease its claim gave it), and the one write, if any, that the
end of a pass owes it. A proposal that closes in the pass that claimed its key owes nothing
more; one left open waiting takes the lease off; one that closes later gets the TTL then
(docs/protocol.md, "How long a dedup key stays"). The bucket is a hint: every write here is a
compare-and-set, and a failure is logged, never raised.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any

import structlog

from improved.core import apply as apply_stage
from improved.core import propose
from improved.core.record import ProposalRecord, closed
from improved.protocol.model import DedupHead
from improved.runtime.records import CACHE_SIZE
from improved.runtime.store import Store

log = structlog.get_logger("improved.engine")


class DedupHeads:
    """`records_ttl_s` (0: kept for good) is the TTL a closed proposal's head carries."""

    def __init__(self, store: Store, records_ttl_s: int):
        self.store = store
        self.records_ttl_s = records_ttl_s
        # proposal id → (revision, head, leased) of the head this process wrote or found
        self._held: OrderedDict[str, tuple[int, DedupHead, bool]] = OrderedDict()

    @property
    def lease_s(self) -> int:
        """The TTL a claim's create gives a dedup head (`Buckets.claim_dedup_head`): a closed
        proposal's, when heads take TTLs at all; else none."""
        return self.records_ttl_s if self.store.dedup_ttl else 0

    def claimed(self, pid: str, revision: int, head: DedupHead, leased: bool = False) -> None:
        """`head` (naming `pid`) stands at `revision`, written by this process or found
        leased: its close may give it its TTL by a compare-and-set from there, without reading
        the key, or, `leased`, needs no write at all; a pass that leaves the proposal open
        takes a lease off."""
        if revision:
            self._held[pid] = (revision, head, leased)
            self._held.move_to_end(pid)
            while len(self._held) > CACHE_SIZE:
                self._held.popitem(last=False)

    def after_pass(self, record: ProposalRecord, before: ProposalRecord | None,
                   republish: bool, waiting: bool) -> Coroutine[Any, Any, None] | None:
        """The write the end of a pass owes `record`'s head, if any: its TTL at the close
        (or a republish of it closed), or the lease off when the pass leaves it open waiting
        for anything but its own apply (an operator, a quorum, a measurement; `waiting`: the
        service was unreachable)."""
        if self.records_ttl_s and self.store.dedup_ttl and closed(record) and (
                republish or before is None or not closed(before)):
            held = self._held.pop(record.proposal_id, None)
            if held is not None and held[2] and propose.head_may_expire(record, held[1]):
                return None  # leased at its claim (an L0 closed in one pass): it has the TTL
            return self._expire(record, held)
        held = self._held.get(record.proposal_id)
        if held is not None and held[2] and not closed(record) and (
                waiting or not apply_stage.needs_apply(record)):
            return self._keep(record)
        return None

    async def _expire(self, record: ProposalRecord,
                      held: tuple[int, DedupHead, bool] | None) -> None:
        """At the close of `record`, give its dedup head the TTL its retained records carry,
        if the head still names it (`propose.head_may_expire`; `Store.expire_dedup_head`
        writes it compare-and-set from `held`, where this process last saw it, if known).
        Nothing is lost when this fails: the head stays as it was, kept for good as before."""
        try:
            await self.store.expire_dedup_head(
                record.service, record.dedup_key, self.records_ttl_s,
                lambda head: propose.head_may_expire(record, head),
                held[:2] if held is not None else None)
        except Exception as exc:
            log.info("dedup head kept without a TTL", proposal_id=record.proposal_id,
                     error=f"{type(exc).__name__}: {exc}")

    async def _keep(self, record: ProposalRecord) -> None:
        """Write the leased head of `record`, left open, again without a TTL, so it stays while
        the proposal is open: compare-and-set from where the lease put it; a key written
        meanwhile is a newer claim's, left alone. A failure is logged and left for the
        proposal's next pass (it stays leased here)."""
        pid = record.proposal_id
        revision, head, _ = self._held[pid]
        try:
            kept = await self.store.keep_dedup_head(record.service, record.dedup_key, head,
                                                    revision)
        except Exception as exc:
            log.info("dedup head still carries its lease", proposal_id=pid,
                     error=f"{type(exc).__name__}: {exc}")
            return
        if kept:
            self._held[pid] = (kept, head, False)
        else:
            self._held.pop(pid, None)
