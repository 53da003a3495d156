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
from improved.protocol.model import MeasureDue, ProposalState, ReviewEntry

# How long an index tombstone (an item that left the index) stays before its subject is gone,
# with checkpoints every 300 s (`indexes.tombstone_ttl_s`; the daemon sets its own from its
# checkpoint interval): past the next two checkpoints, so a reader finds every member of the
# last one among the subjects, and short enough that tombstones do not pile up with the history.
TOMBSTONE_TTL_S = indexes.tombstone_ttl_s(300)
review_entry_decoder = msgspec.json.Decoder(ReviewEntry)
due_entry_decoder = msgspec.json.Decoder(MeasureDue)
state_decoder = msgspec.json.Decoder(ProposalState)

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

    async def read_states(self, svc: str | None = None) -> list[ProposalState]:
        """The retained state of every proposal (of `svc` alone, given) as the daemon last
        published it. Cost: one message per retained state — the open proposals and those
        closed within `records_ttl_days` (their records carry that TTL) — read once through
        an ordered consumer; never the history before, nor a chain. A state whose service or
        id is not its subject's, or that is no state, is left out. What a state says is a
        hint (anyone who may publish on the records stream can write one): a proposal's
        chain says what it is."""
        out: list[ProposalState] = []
        for subject, data, _ in await self._last_per_subject(
                S.proposal_state(svc, "*") if svc else f"{S.PROPOSALS}.*.*"):
            try:
                state = state_decoder.decode(data) if data else None
            except msgspec.MsgspecError:
                continue
            if state is not None and (state.service, state.proposal_id) == \
                    (S.token(subject, 2), S.token(subject, 3)):
                out.append(state)
        return out

    async def _read_named(self, subjects: str, decoder: IndexDecoder) -> list[indexes.Named]:
        """What each subject on `subjects` (`improve.<index>.<svc>.<id>`) names: the last
        message per subject (O(open items and recent tombstones), never the history); its
        entry when it holds one for its own service and id, else None (a tombstone, or
        anything else)."""
        out: list[indexes.Named] = []
        for subject, data, at in await self._last_per_subject(subjects):
            svc, pid = S.token(subject, 2) or "", S.token(subject, 3) or ""
            if S.SERVICE_RE.match(svc) and S.ID_RE.match(pid):
                try:
                    entry = decoder.decode(data) if data else None
                except msgspec.MsgspecError:
                    entry = None
                if entry is not None and (entry.service, entry.proposal_id) != (svc, pid):
                    entry = None
                out.append(indexes.Named(svc, pid, entry, at))
        return out

    async def _last_per_subject(self, subjects: str) -> list[tuple[str, bytes, int]]:
        """(subject, data, its time in ms) of the last message on each subject `subjects`
        matches, read once through an ordered consumer: as many messages as subjects."""
        config = jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.LAST_PER_SUBJECT)
        sub = await self.js.subscribe(subjects, ordered_consumer=True,
                                      stream=S.STREAM_RECORDS, config=config)
        out: list[tuple[str, bytes, int]] = []
        try:
            info = await sub.consumer_info()
            if info.num_pending == 0 and not (info.delivered and info.delivered.consumer_seq):
                return out  # nothing to deliver: do not wait for it
            while True:
                try:
                    msg = await sub.next_msg(timeout=READ_IDLE_S)
                except TimeoutError:  # nats-py raises its own or asyncio's, by timing
                    return out
                out.append((msg.subject, msg.data,
                            int(msg.metadata.timestamp.timestamp() * 1000)))
                if msg.metadata.num_pending == 0:
                    return out
        finally:
            await sub.unsubscribe()
