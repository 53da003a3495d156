"""Reading the audit chains of one audit stream, as any client of the bus may: a chain by direct
gets, the whole log once through a consumer of its own, pulled a batch at a time (`pulls`),
so a reader of the history holds one batch and never the log. What is read is raw: the caller
verifies it (`improved.core.audit`, `improved.core.evidence`) before believing it. The
daemon's store and the command line read through this same code (`runtime.audit_log` extends
it with the append).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import NotFoundError

from improved.client.pulls import PAUSE_S, Pull, delivery
from improved.core import audit, checkpoint
from improved.protocol import subjects as S

READ_IDLE_S = 5.0  # a read of the audit log that receives nothing this long has ended
FOLLOW_BATCH = 512  # trailers a reader of the log pulls at once


Entry = tuple[int, str, dict[str, Any] | None, dict[str, str]]


async def covering(entries: AsyncIterator[Entry]) -> AsyncIterator[tuple[Entry, bool]]:
    """Each trailer `follow` gives, with whether the next one is a later trailer of the same
    message (same subject and stream sequence): one the commit's last signature vouches for
    (`audit.covering`). A trailer is held until the next one arrives."""
    held: Entry | None = None
    async for entry in entries:
        if held is not None:
            yield held, entry[0] == held[0] and entry[1] == held[1]
        held = entry
    if held is not None:
        yield held, False


def _chain_key(subject: str) -> tuple[str, str]:
    """(service token, chain id) of an audit subject `improve.audit.<svc>.<id>`."""
    return S.token(subject, 2) or "", S.token(subject, 3) or ""


class AuditReader:
    """The reads of the chains on `audit_stream` (the daemon's log, or the tool runtimes')."""

    nc: Client
    js: JetStreamContext
    audit_stream: str

    async def read_chain_at(self, subject: str, start: int = 1
                            ) -> list[tuple[int, dict[str, Any]]]:
        """The trailers on `subject` from stream sequence `start` on, one direct get per
        message (for a chain, or the few trailers of one since a sequence); the trailers of a
        commit share its message's sequence (`audit.trailers_in`)."""
        out: list[tuple[int, dict[str, Any]]] = []
        seq = start
        while True:
            try:
                msg = await self.js.get_msg(self.audit_stream, seq=seq, subject=subject,
                                            next=True, direct=True)
            except NotFoundError:
                return out
            seq = msg.seq or seq
            out.extend((seq, body) for body in audit.trailers_in(
                msgspec.json.decode(msg.data or b"null")))
            seq += 1

    async def chain_head(self, subject: str) -> tuple[int, dict[str, Any] | None]:
        """(stream sequence, body) of the last trailer on a chain; (0, None) when empty."""
        try:
            msg = await self.js.get_msg(self.audit_stream, subject=subject, direct=True)
        except NotFoundError:
            return 0, None
        return msg.seq or 0, audit.trailers_in(msgspec.json.decode(msg.data or b"null"))[-1]

    async def read_chain(self, svc: str, pid: str) -> list[tuple[int, dict[str, Any]]]:
        """Every trailer of one chain as (stream sequence, raw JSON body), in order."""
        return await self.read_chain_at(S.audit(svc, pid))

    async def audit_log(self, pid: str | None = None) -> list[tuple[int, str, dict[str, Any]]]:
        """Every trailer (or one proposal's) as (stream sequence, subject, body), in stream
        order, read once through an ordered consumer (what could not be read is left out:
        `read_audit` names it)."""
        return (await self.read_audit(pid))[0]

    async def read_audit(self, pid: str | None = None,
                         ) -> tuple[list[tuple[int, str, dict[str, Any]]], checkpoint.StreamView]:
        """The trailers as `audit_log` gives them, and what was found of the stream: its
        creation time (None when it does not exist), its last sequence, and — over the whole
        log — the sequences it holds but could not give back (a damaged block: the server
        skips the message, so an ordered consumer would wait for it forever). Bounded: a
        read that stalls ends after READ_IDLE_S."""
        try:
            info = await self.js.stream_info(S.STREAM_AUDIT)
        except NotFoundError:
            return [], checkpoint.StreamView(None)
        state = info.state
        subject = S.audit("*", pid) if pid else S.AUDIT_FILTER
        log: list[tuple[int, str, dict[str, Any]]] = []
        if state.messages and (not pid or await self._holds(subject)):
            log = await self._read_ordered(subject, state.last_seq)
        unreadable: tuple[int, ...] = ()
        seen = {seq for seq, _, _ in log}  # messages read (a commit's trailers share one)
        if not pid and len(seen) < state.messages:
            unreadable = tuple(s for s in range(state.first_seq, state.last_seq + 1)
                               if s not in seen)
        return log, checkpoint.StreamView(str(info.created), state.last_seq, unreadable)

    async def _holds(self, subject: str) -> bool:
        filtered = await self.js.stream_info(S.STREAM_AUDIT, subjects_filter=subject)
        return bool(filtered.state.subjects)

    async def _read_ordered(self, subject: str, last_seq: int
                            ) -> list[tuple[int, str, dict[str, Any]]]:
        """Read `subject` up to stream sequence `last_seq` (or until nothing is pending)."""
        return [(seq, subj, body) async for seq, subj, body, _ in self.follow(subject, 1, last_seq)
                if body is not None]

    async def follow(self, subject: str, start: int, upto: int, *,
                     start_ms: int | None = None,
                     ) -> AsyncIterator[tuple[int, str, dict[str, Any] | None, dict[str, str]]]:
        """(stream sequence, subject, body or None when it is not a JSON object, headers) of
        every trailer on `subject` from stream sequence `start` to `upto`, one at a time, as
        `follow_messages` reads them: the trailers of a commit one after the other, each with
        its message's sequence and headers (`audit.trailers_in`)."""
        async for seq, subj, body, headers in self.follow_messages(subject, start, upto,
                                                                    start_ms=start_ms):
            for trailer in audit.trailers_in(body) if body is not None else [None]:
                yield seq, subj, trailer if isinstance(trailer, dict) else None, headers

    async def follow_messages(self, subject: str, start: int, upto: int, *,
                              start_ms: int | None = None,
                              ) -> AsyncIterator[tuple[int, str, dict[str, Any] | None,
                                                       dict[str, str]]]:
        """(stream sequence, subject, body or None when it is not a JSON object, headers) of
        every message on `subject` from stream sequence `start` to `upto`, one at a time: a
        reader of the whole log holds one batch (FOLLOW_BATCH messages), not the log. One pull
        request is open at a time and the next leaves once the reader took what came
        (`pulls.Pull`), so a slow reader never makes the server push the log into its buffers.
        Ends early when nothing arrives for READ_IDLE_S (a message the server holds but cannot
        read). `start_ms` (epoch ms): from the first trailer the server stored at or after that
        time instead of from `start`. What arrives without a JetStream reply subject is no
        delivery of the server's (a forgery into the inbox; no client may publish with a
        `$JS.ACK` reply, the server refuses it): left out."""
        if upto < start:
            return
        config = jsapi.ConsumerConfig(ack_policy=jsapi.AckPolicy.NONE, filter_subject=subject,
                                      inactive_threshold=READ_IDLE_S * 6, mem_storage=True)
        if start_ms is not None:
            config.deliver_policy = jsapi.DeliverPolicy.BY_START_TIME
            config.opt_start_time = datetime.datetime.fromtimestamp(start_ms / 1000, datetime.UTC)
        else:
            config.deliver_policy = jsapi.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = start
        made = await self.js.add_consumer(self.audit_stream, config)
        pull = Pull(self.nc, self.audit_stream, made.name, batch=FOLLOW_BATCH,
                    refill_at=FOLLOW_BATCH // 2)
        try:
            if made.num_pending == 0:  # nothing there (a purged chain, a window past the end)
                return
            await pull.start()
            async for msg in self._pulled(pull):
                delivered = delivery(msg.reply)
                if delivered is None:
                    continue  # no delivery of the server's
                seq = delivered.seq
                if seq > upto:
                    return
                try:
                    body = msgspec.json.decode(msg.data)
                except msgspec.DecodeError:
                    body = None  # not JSON: counted as unreadable by the caller
                yield seq, msg.subject, body if isinstance(body, dict) else None, \
                    dict(msg.headers or {})
                if delivered.pending == 0 or seq >= upto:
                    return
        finally:
            # a reader that stopped early (its output closed) may finalize this after the
            # connection is gone: nothing is left to unsubscribe then
            with suppress(ConnectionClosedError):
                await pull.stop()
            with suppress(Exception):  # it goes by itself once inactive
                await self.js.delete_consumer(self.audit_stream, made.name)

    @staticmethod
    async def _pulled(pull: Pull) -> AsyncIterator[Msg]:
        """The messages of a log read as they come, until nothing came for READ_IDLE_S. A
        consumer just made on a clustered stream may not answer until its leader is elected
        (the server says "no responders", and the pull asks again after a pause): that wait
        counts as silence too."""
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < READ_IDLE_S:
            msgs = await pull.take(lambda: FOLLOW_BATCH, timeout=PAUSE_S)
            if msgs:
                quiet_since = time.monotonic()
            for msg in msgs:
                yield msg

    async def audit_view(self) -> checkpoint.StreamView:
        """The audit stream as its state says, in O(1): creation time, first and last
        sequence and how many messages it holds (fewer than its sequences: some are gone)."""
        try:
            info = await self.js.stream_info(self.audit_stream)
        except NotFoundError:
            return checkpoint.StreamView(None)
        state = info.state
        return checkpoint.StreamView(str(info.created), state.last_seq,
                                     first_seq=state.first_seq, messages=state.messages)

    async def trailer_at(self, seq: int
                         ) -> tuple[str, dict[str, Any] | None, dict[str, str]] | None:
        """(subject, body or None when not JSON, headers) of the last trailer of the message at
        `seq` of this store's audit stream: the trailer a later append names as its
        predecessor, and where a checkpoint that ends at `seq` ends."""
        try:
            msg = await self.js.get_msg(self.audit_stream, seq=seq, direct=True)
        except NotFoundError:
            return None
        try:
            body = audit.trailers_in(msgspec.json.decode(msg.data or b""))[-1]
        except msgspec.DecodeError:
            body = None
        return (msg.subject or "", body if isinstance(body, dict) else None,
                dict(msg.headers or {}))

    async def all_chains(self, pid: str | None = None
                         ) -> dict[tuple[str, str], list[dict[str, Any]]]:
        """Every chain (or one proposal's), keyed by (service token, chain id), in order."""
        chains: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _, subject, body in await self.audit_log(pid):
            chains.setdefault(_chain_key(subject), []).append(body)
        return chains

    async def sequenced_chains(self
                               ) -> dict[tuple[str, str], list[tuple[int, dict[str, Any]]]]:
        """Every chain as (stream sequence, body) pairs, keyed like `all_chains`."""
        chains: dict[tuple[str, str], list[tuple[int, dict[str, Any]]]] = {}
        for seq, subject, body in await self.audit_log():
            chains.setdefault(_chain_key(subject), []).append((seq, body))
        return chains

    async def service_of(self, pid: str) -> str | None:
        """The service whose chain holds proposal `pid` (a vote names only the proposal)."""
        info = await self.js.stream_info(S.STREAM_AUDIT, subjects_filter=S.audit("*", pid))
        for subject in (info.state.subjects or {}):
            svc = S.token(subject, 2)
            if svc and svc not in S.MESH_CHAINS:
                return svc
        return None
