"""The retained records in IMPROVE_RECORDS, one message per subject (the current state): a
proposal's records, the immutable quorum records, and the indexes — the review index and the
measurement index, one entry per member, an item that leaves overwritten by a tombstone with a
per-message TTL — and the marker a complete refill leaves, naming the stream's incarnation and
the index format, which lives and dies with what it vouches for.
"""

from __future__ import annotations

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import (
    APIError,
    NotFoundError,
)

from improved.client.acks import Acks, PendingAck
from improved.client.records import INDEX_SUBJECTS, IndexEntry, RecordReads
from improved.client.streams import is_conflict
from improved.core import queue
from improved.protocol import subjects as S
from improved.protocol.model import (
    IndexMarker,
    MeasureDue,
    ReviewEntry,
    to_json,
)


class Retained(RecordReads):
    """Publishes and reads of the records stream; `tombstone_ttl_s` is how long a tombstone
    stays before its subject is gone."""

    js: JetStreamContext
    _probe: JetStreamContext
    record_acks: Acks  # its own reply subscription: the appends' acks do not wait behind these
    tombstone_ttl_s: int

    async def publish(self, subject: str, record: msgspec.Struct | None,
                      ttl_s: int | None = None) -> None:
        """Publish a retained record and wait for its acknowledgement. With
        `ttl_s` it carries that TTL (Nats-TTL): the server removes it then, with its subject;
        a None record is an empty message (a tombstone)."""
        # an ack lost in a broker restart must not wedge the job: it times out (`Acks`)
        await (await self.send_record(subject, record, ttl_s)).seq()

    async def send_record(self, subject: str, record: msgspec.Struct | None,
                          ttl_s: int | None = None) -> PendingAck:
        """`publish`, its acknowledgement awaited later (`acks.settled`): several records
        of one pass leave together."""
        return await self.record_acks.send(subject, b"" if record is None else to_json(record),
                                           stream=S.STREAM_RECORDS, ttl_s=ttl_s)

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

    async def publish_once(self, subject: str, record: msgspec.Struct) -> None:
        """Publish an immutable record: only if the subject holds nothing yet."""
        try:
            await self.js.publish(subject, to_json(record), stream=S.STREAM_RECORDS,
                                  headers={"Nats-Expected-Last-Subject-Sequence": "0"})
        except APIError as exc:
            if not is_conflict(exc):
                raise

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
