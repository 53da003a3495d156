"""The retained records in IMPROVE_RECORDS, one message per subject (the current state): a
proposal's records, the immutable quorum records, and the indexes — the review index and the
measurement index, one entry per member, an item that leaves overwritten by a tombstone with a
per-message TTL — and the marker a complete refill leaves, naming the stream's incarnation and
the index format, which lives and dies with what it vouches for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import (
    APIError,
    NotFoundError,
)

from improved.client.streams import is_conflict
from improved.core import indexes, queue
from improved.protocol import subjects as S
from improved.protocol.model import (
    IndexMarker,
    MeasureDue,
    ReviewEntry,
    to_json,
)
from improved.runtime.audit_log import READ_IDLE_S

PUBLISH_ACK_TIMEOUT_S = 10.0

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


class Retained:
    """Publishes and reads of the records stream; `tombstone_ttl_s` is how long a tombstone
    stays before its subject is gone."""

    js: JetStreamContext
    _probe: JetStreamContext
    tombstone_ttl_s: int

    async def publish(self, subject: str, record: msgspec.Struct | None,
                      ttl_s: int | None = None) -> None:
        """Publish a retained record, pipelined: sent at once, acknowledged when awaited. With
        `ttl_s` it carries that TTL (Nats-TTL): the server removes it then, with its subject;
        a None record is an empty message (a tombstone)."""
        ack = await self.js.publish_async(subject, b"" if record is None else to_json(record),
                                          stream=S.STREAM_RECORDS, msg_ttl=ttl_s)
        # an ack lost in a broker restart must not wedge the job: time out, nak, retry
        await asyncio.wait_for(ack, timeout=PUBLISH_ACK_TIMEOUT_S)

    async def index(self, svc: str, pid: str, entry: ReviewEntry | None) -> None:
        """Put `pid` in the review index (`entry`), or take it out (None)."""
        await self._retain(S.review_entry(svc, pid), entry)

    async def mark_due(self, svc: str, pid: str, entry: MeasureDue | None) -> None:
        """Put `pid` in the measurement index (`entry`), or take it out (None)."""
        await self._retain(S.due_entry(svc, pid), entry)

    async def _retain(self, subject: str, entry: IndexEntry | None) -> None:
        """An index entry, or for None a tombstone that replaces it and, after
        `tombstone_ttl_s`, leaves the stream with its subject."""
        if entry is not None:
            await self.publish(subject, entry)
        else:
            await self.publish(subject, None, ttl_s=self.tombstone_ttl_s)

    async def index_entry(self, index: str, svc: str, pid: str,
                          entry: IndexEntry | None) -> None:
        """Put `pid` in the index named `index` (`entry`), or take it out (None)."""
        await self._retain(INDEX_SUBJECTS[index][1](svc, pid), entry)

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

    async def publish_once(self, subject: str, record: msgspec.Struct) -> None:
        """Publish an immutable record: only if the subject holds nothing yet."""
        try:
            await self.js.publish(subject, to_json(record), stream=S.STREAM_RECORDS,
                                  headers={"Nats-Expected-Last-Subject-Sequence": "0"})
        except APIError as exc:
            if not is_conflict(exc):
                raise

    async def last(self, subject: str) -> bytes | None:
        try:
            msg = await self.js.get_msg(S.STREAM_RECORDS, subject=subject, direct=True)
        except NotFoundError:
            return None
        return msg.data

    async def incarnation(self) -> IndexMarker:
        """What a complete refill vouches for: the records stream as it is now (its creation
        time: a re-created stream is a new one) and the index format of this version."""
        records = await self._probe.stream_info(S.STREAM_RECORDS)
        return IndexMarker(records=str(records.created), index=queue.INDEX_VERSION)

    async def filled(self, seen: IndexMarker | None = None) -> bool:
        """True when the retained records and the review index are complete: the marker a
        refill leaves is in the records stream and names this very stream and index format.
        A purge or a re-created stream takes the marker with it; an upgrade from a version
        without the index finds none."""
        try:
            seen = seen or await self.incarnation()
            data = await self.last(S.FILLED_MARKER)
        except NotFoundError:  # no records stream at all
            return False
        try:
            return data is not None and msgspec.json.decode(data, type=IndexMarker) == seen
        except msgspec.MsgspecError:
            return False

    async def mark_filled(self, seen: IndexMarker) -> None:
        """Record that the records and the index of incarnation `seen` are complete."""
        await self.publish(S.FILLED_MARKER, seen)
