"""JetStream publishes whose acknowledgements come back through one reply subscription.

nats-py's `JetStreamContext.publish` is a request: a fresh NUID and random token per publish,
a future, a timer of its own (`asyncio.wait_for`), the ack parsed with `json` into a
dataclass. On the loop's hot path — every chain append and retained record — that is a fair
share of the daemon's CPU for what is one message out and one in. Here one wildcard
subscription receives every ack, a counter names each reply subject, one timer (armed only
while acks are awaited) fails what waited past its deadline, and the ack is decoded by
msgspec. What a caller sees is
nats-py's: the same `PubAck` sequence, the same `APIError`s (so `streams.is_conflict` reads
them alike), `NoStreamResponseError` when no stream takes the subject, and nats-py's
`TimeoutError` when no ack came.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from contextlib import suppress
from typing import Any

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

    async def publish(self, subject: str, payload: bytes, *, stream: str | None = None,
                      headers: dict[str, str] | None = None, ttl_s: int | None = None) -> int:
        """Publish `payload` to JetStream and wait for its ack; the stream sequence it was
        stored at. `stream`: the stream that must take it (Nats-Expected-Stream); `ttl_s`: its
        per-message TTL (Nats-TTL)."""
        if self._sub is None:
            await self._start()
        if stream is not None or ttl_s is not None:
            headers = dict(headers or {})
            if stream is not None:
                headers["Nats-Expected-Stream"] = stream
            if ttl_s is not None:
                headers["Nats-TTL"] = str(int(ttl_s))
        reply = f"{self._prefix}{next(self._ids)}"
        future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._waiting[reply] = (future, time.monotonic() + self.timeout)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)
        try:
            await self.nc.publish(subject, payload, reply=reply, headers=headers)
            msg = await future
        finally:
            self._waiting.pop(reply, None)
        if not msg.data and msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            raise NoStreamResponseError
        ack = _ack_decoder.decode(msg.data)
        if ack.error is not None:
            APIError.from_error(ack.error)  # raises the error's own class
            raise APIError(**ack.error)
        return ack.seq

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
