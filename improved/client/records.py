"""The retained records in IMPROVE_RECORDS as any client reads them, one message per subject (the
current state): a proposal's records, and the indexes — the review index and the measurement
index, one entry per member, an item that leaves overwritten by a tombstone with a per-message
TTL. An index is a hint: a reader confirms it from the chains (`improved.client.indexing`); the
daemon writes it (`runtime.retained`, which extends these reads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import NotFoundError

from improved.client.audit_log import READ_IDLE_S
from improved.core import indexes
from improved.protocol import subjects as S
from improved.protocol.model import MeasureDue, ReviewEntry

# How long an index tombstone (an item that left the index) stays before its subject is gone,
# with checkpoints every 300 s (`indexes.tombstone_ttl_s`; the daemon sets its own from its
# checkpoint interval): past the next two checkpoints, so a reader finds every member of the
# last one among the subjects, and short enough that tombstones do not pile up with the history.
TOMBSTONE_TTL_S = indexes.tombstone_ttl_s(300)
review_entry_decoder = msgspec.json.Decoder(ReviewEntry)
due_entry_decoder = msgspec.json.Decoder(MeasureDue)

# what a subject of an index holds (core.indexes.INDEXES), and its decoder
IndexEntry = ReviewEntry | MeasureDue
IndexDecoder = msgspec.json.Decoder[ReviewEntry] | msgspec.json.Decoder[MeasureDue]
E = TypeVar("E", ReviewEntry, MeasureDue)

# index name (core.indexes.INDEXES) → (its subjects, an entry's subject, its entries' decoder)
INDEX_SUBJECTS: dict[str, tuple[str, Callable[[str, str], str], IndexDecoder]] = {
    "review": (S.REVIEW_FILTER, S.review_entry, review_entry_decoder),
    "due": (S.DUE_FILTER, S.due_entry, due_entry_decoder),
}


class RecordReads:
    """The records stream read one subject at a time, and its indexes read whole."""

    js: JetStreamContext

    async def last(self, subject: str) -> bytes | None:
        try:
            msg = await self.js.get_msg(S.STREAM_RECORDS, subject=subject, direct=True)
        except NotFoundError:
            return None
        return msg.data

    async def index_subject(self, index: str, svc: str, pid: str) -> IndexEntry | None:
        """The entry the subject of `pid` in the index named `index` holds: None when there
        is none, a tombstone, or anything that is no entry of its own."""
        _, subject, decoder = INDEX_SUBJECTS[index]
        data = await self.last(subject(svc, pid))
        try:
            entry = decoder.decode(data) if data else None
        except msgspec.MsgspecError:
            return None
        return entry if entry is not None and (entry.service, entry.proposal_id) == (svc, pid) \
            else None

    async def read_index(self) -> list[ReviewEntry]:
        """Every entry of the review index, tombstones and anything malformed left out."""
        return await self._read_entries(S.REVIEW_FILTER, review_entry_decoder)

    async def read_due(self) -> list[MeasureDue]:
        """Every entry of the measurement index, tombstones and anything malformed left out."""
        return await self._read_entries(S.DUE_FILTER, due_entry_decoder)

    async def _read_entries(self, subjects: str, decoder: msgspec.json.Decoder[E]) -> list[E]:
        """The entries on `subjects` (`improve.<index>.<svc>.<id>`) whose service and id are
        their subject's (`_read_named`, tombstones left out). An entry only says where to
        look."""
        return [n.entry for n in await self._read_named(subjects, decoder)
                if n.entry is not None]

    async def read_named(self, index: str) -> list[indexes.Named]:
        """Every subject of the index named `index` (core.indexes), tombstones included: a
        tombstone still names the proposal that left."""
        subjects, _, decoder = INDEX_SUBJECTS[index]
        return await self._read_named(subjects, decoder)

    async def _read_named(self, subjects: str, decoder: IndexDecoder) -> list[indexes.Named]:
        """What each subject on `subjects` (`improve.<index>.<svc>.<id>`) names: the last
        message per subject, read once through an ordered consumer (O(open items and recent
        tombstones), never the history); its entry when it holds one for its own service and
        id, else None (a tombstone, or anything else)."""
        config = jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.LAST_PER_SUBJECT)
        sub = await self.js.subscribe(subjects, ordered_consumer=True,
                                      stream=S.STREAM_RECORDS, config=config)
        out: list[indexes.Named] = []
        try:
            info = await sub.consumer_info()
            if info.num_pending == 0 and not (info.delivered and info.delivered.consumer_seq):
                return out  # nothing to deliver: do not wait for it
            while True:
                try:
                    msg = await sub.next_msg(timeout=READ_IDLE_S)
                except TimeoutError:  # nats-py raises its own or asyncio's, by timing
                    return out
                svc, pid = S.token(msg.subject, 2) or "", S.token(msg.subject, 3) or ""
                if S.SERVICE_RE.match(svc) and S.ID_RE.match(pid):
                    try:
                        entry = decoder.decode(msg.data) if msg.data else None
                    except msgspec.MsgspecError:
                        entry = None
                    if entry is not None and (entry.service, entry.proposal_id) != (svc, pid):
                        entry = None
                    out.append(indexes.Named(svc, pid, entry,
                                             int(msg.metadata.timestamp.timestamp() * 1000)))
                if msg.metadata.num_pending == 0:
                    return out
        finally:
            await sub.unsubscribe()
