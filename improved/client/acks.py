"""JetStream publishes whose acknowledgements come back through one reply subscription (and the
message gets of the hot path, answered the same way).

nats-py's `JetStreamContext.publish` is a request: a fresh NUID and random token per publish,
a future, a timer of its own (`asyncio.wait_for`), the ack parsed with `json` into a
dataclass. On the loop's hot path — every chain append and retained record — that is a fair
share of the daemon's CPU for what is one message out and one in. Here one wildcard
subscription receives every ack, a counter names each reply subject, one timer (armed only
while acks are awaited) fails what waited past its deadline, and the ack is decoded by
msgspec. What a caller sees is nats-py's: the same stream sequence, the same `APIError`s (so
`streams.is_conflict` reads them alike), `NoStreamResponseError` when no stream takes the
subject, and nats-py's `TimeoutError` when no ack came.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import time
from collections.abc import Iterable
from contextlib import suppress
from typing import Any, NamedTuple

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError, NoStreamResponseError

ACK_TIMEOUT_S = 5.0  # as long as nats-py waits for an ack
SWEEP_S = 0.5  # how often acks overdue are given up (a deadline is met within this)
NO_RESPONDERS = "503"


class _Ack(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict[str, Any] | None = None


_ack_decoder = msgspec.json.Decoder(_Ack)


class Stored(NamedTuple):
    """A message as a stream holds it: its sequence, payload and headers."""

    seq: int
    data: bytes
    headers: dict[str, str]


class _LastBySubject(msgspec.Struct):
    last_by_subj: str


class _Message(msgspec.Struct):
    seq: int = 0
    data: str | None = None  # base64
    hdrs: str | None = None  # base64 of the NATS/1.0 header block


class _Got(msgspec.Struct):
    message: _Message | None = None
    error: dict[str, Any] | None = None


_get_encoder = msgspec.json.Encoder()
_got_decoder = msgspec.json.Decoder(_Got)


def _headers(block: bytes) -> dict[str, str]:
    """The headers of a stored message's `NATS/1.0` header block."""
    out: dict[str, str] = {}
    for line in block.decode(errors="replace").split("\r\n")[1:]:
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip()] = value.strip()
    return out


class PendingAck:
    """A message sent with a reply subject of `Acks`, its answer still to come: `answer()` is
    the reply as it came, `seq()` the stream sequence of a JetStream ack (its error raised as
    nats-py raises it), `stored()` the message a message get found, `forget()` for one that
    will not be awaited."""

    __slots__ = ("_future", "_reply", "_waiting")

    def __init__(self, waiting: dict[str, tuple[asyncio.Future[Msg], float]], reply: str,
                 future: asyncio.Future[Msg]):
        self._waiting = waiting
        self._reply = reply
        self._future = future

    async def answer(self) -> Msg:
        try:
            return await self._future
        finally:
            self._waiting.pop(self._reply, None)

    async def _from_a_stream(self) -> Msg:
        """The answer, which a stream gave: none taking the subject is no responders."""
        msg = await self.answer()
        if not msg.data and msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            raise NoStreamResponseError
        return msg

    async def seq(self) -> int:
        ack = _ack_decoder.decode((await self._from_a_stream()).data)
        if ack.error is not None:
            APIError.from_error(ack.error)  # raises the error's own class
            raise APIError(**ack.error)
        return ack.seq

    async def stored(self) -> Stored | None:
        """The message a message get (`Acks.send_get`) found; None when there is none."""
        got = _got_decoder.decode((await self._from_a_stream()).data)
        if got.error is not None:
            if got.error.get("code") == 404:
                return None
            APIError.from_error(got.error)
            raise APIError(**got.error)
        if got.message is None:
            return None
        return Stored(got.message.seq, base64.b64decode(got.message.data or ""),
                      _headers(base64.b64decode(got.message.hdrs or "")))

    def forget(self) -> None:
        """Not awaited after all (an earlier one failed): no longer waited for."""
        self._waiting.pop(self._reply, None)
        if not self._future.done():
            self._future.cancel()
        elif not self._future.cancelled():
            self._future.exception()  # a timeout nobody will await is not an error to report


async def settled(pending: list[PendingAck]) -> list[int]:
    """The stream sequences of `pending`, awaited in order; on the first failure the rest are
    forgotten and the failure raised."""
    out: list[int] = []
    try:
        for p in pending:
            out.append(await p.seq())
    except BaseException:
        forget(pending[len(out):])
        raise
    return out


def forget(pending: Iterable[PendingAck]) -> None:
    """`PendingAck.forget` each of `pending`: what was sent before a failure is not awaited."""
    for p in pending:
        p.forget()


class Acks:
    """Publishes to JetStream on `nc`, each awaited for its ack through one subscription."""

    def __init__(self, nc: Client, timeout: float = ACK_TIMEOUT_S):
        self.nc = nc
        self.timeout = timeout
        self._prefix = ""
        self._sub: Subscription | None = None
        self._timer: asyncio.TimerHandle | None = None  # the next sweep, while acks are awaited
        self._ids = itertools.count()
        # reply subject → (the future its ack completes, the monotonic deadline)
        self._waiting: dict[str, tuple[asyncio.Future[Msg], float]] = {}
        self._starting = asyncio.Lock()

    async def _start(self) -> None:
        async with self._starting:
            if self._sub is None:
                self._prefix = self.nc.new_inbox() + "."
                self._sub = await self.nc.subscribe(self._prefix + "*", cb=self._arrived)

    async def _arrived(self, msg: Msg) -> None:
        waiting = self._waiting.pop(msg.subject, None)
        if waiting is not None and not waiting[0].done():
            waiting[0].set_result(msg)

    def _sweep(self) -> None:
        """Give up every ack whose deadline passed; sweep again in SWEEP_S while any waits."""
        self._timer = None
        now = time.monotonic()
        late = [reply for reply, (_, deadline) in self._waiting.items() if deadline <= now]
        for reply in late:
            future, _ = self._waiting.pop(reply)
            if not future.done():
                future.set_exception(NatsTimeout())
        if self._waiting:
            self._timer = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)

    async def _send(self, subject: str, payload: bytes,
                    headers: dict[str, str] | None) -> PendingAck:
        """Send `payload` on `subject` with a reply subject of this subscription's, now; what
        awaits its answer (nats-py's TimeoutError after `timeout`)."""
        if self._sub is None:
            await self._start()
        reply = f"{self._prefix}{next(self._ids)}"
        future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._waiting[reply] = (future, time.monotonic() + self.timeout)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)
        try:
            await self.nc.publish(subject, payload, reply=reply, headers=headers)
        except BaseException:
            self._waiting.pop(reply, None)
            raise
        return PendingAck(self._waiting, reply, future)

    async def send(self, subject: str, payload: bytes, *, stream: str | None = None,
                   headers: dict[str, str] | None = None,
                   ttl_s: int | None = None) -> PendingAck:
        """`publish` in two halves: the message leaves now, its ack is awaited later
        (`PendingAck.seq`). Several sent before any is awaited are pipelined without a task
        each, which is what an `asyncio.gather` of `publish` calls would cost."""
        if stream is not None or ttl_s is not None:
            headers = dict(headers or {})
            if stream is not None:
                headers["Nats-Expected-Stream"] = stream
            if ttl_s is not None:
                headers["Nats-TTL"] = str(int(ttl_s))
        return await self._send(subject, payload, headers)

    async def publish(self, subject: str, payload: bytes, *, stream: str | None = None,
                      headers: dict[str, str] | None = None, ttl_s: int | None = None) -> int:
        """Publish `payload` to JetStream and wait for its ack; the stream sequence it was
        stored at. `stream`: the stream that must take it (Nats-Expected-Stream); `ttl_s`: its
        per-message TTL (Nats-TTL)."""
        pending = await self.send(subject, payload, stream=stream, headers=headers, ttl_s=ttl_s)
        return await pending.seq()

    async def last(self, stream: str, subject: str) -> Stored | None:
        """The last message on `subject` of `stream`, read from the stream's leader (a message
        get); None when there is none."""
        return await (await self.send_get(stream, subject)).stored()

    async def send_get(self, stream: str, subject: str) -> PendingAck:
        """`last` in two halves: the get leaves now, its answer is awaited later
        (`PendingAck.stored`)."""
        return await self._send(f"$JS.API.STREAM.MSG.GET.{stream}",
                                _get_encoder.encode(_LastBySubject(last_by_subj=subject)), None)

    async def close(self) -> None:
        """Stop listening; what still waits fails as timed out."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        for future, _ in self._waiting.values():
            if not future.done():
                future.set_exception(NatsTimeout())
        self._waiting.clear()
