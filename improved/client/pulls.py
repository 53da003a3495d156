"""Pull requests on a JetStream consumer, answered into one inbox of the connection: the
daemon's inbound consumer, and every read of the audit log (`client.audit_log`).

nats-py's `fetch` sends a request per batch and waits for each message with a timer and a
task of its own (about half the cost of reading a message of the log); under load on the
inbound consumer, with every slot of its `max_ack_pending` in use, each fetch brought one
message. Here one request asks for as many messages as the reader has room for (up to
`batch`) and stays open: its messages are handed over as they arrive (no wait for the batch
to fill), the next request leaves only once the open one is done (filled, or ended by the
server's status) and room for `refill_at` messages has come free, and one deadline serves
each wait, however many messages it brings.

What arrives in the inbox is what the server delivers: on the embedded open bus nobody else
may publish under the daemon's inbox prefix (`runtime.open_bus`), under accounts nobody else
under its user's. A message without a JetStream reply subject is refused by whoever reads it
(`runtime.inbound.InboundConsumer._fetch`, `client.audit_log.AuditReader.follow_messages`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from typing import NamedTuple

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

EXPIRES_S = 2.0  # how long one request stays open on the server when not filled
GRACE_S = 1.0  # past that, a request whose end was not heard of (a status lost) is over here
PAUSE_S = 0.5  # after a request the consumer refused, before the next
BATCH = 256  # at most this many messages per request
REFILL_AT = 64  # room for this many messages before the next request leaves


class _Request(msgspec.Struct, omit_defaults=True):
    batch: int
    expires: int  # nanoseconds


_encode = msgspec.json.Encoder().encode


class Delivery(NamedTuple):
    """What a JetStream delivery's reply subject says of the message."""

    stream: str
    seq: int  # its stream sequence
    pending: int  # messages the consumer still has to deliver after it


def delivery(reply: str | None) -> Delivery | None:
    """The delivery a reply subject names (`$JS.ACK.<stream>.<consumer>.<delivered>.<stream
    seq>.<consumer seq>.<time>.<pending>`, or with a domain and an account hash after `ACK`),
    or None when it is no JetStream delivery's: nats-py's `Msg.metadata`, without the
    timestamp's datetime and the dataclasses (a tenth of a log read's time)."""
    if not reply or not reply.startswith("$JS.ACK."):
        return None
    tokens = reply.split(".")
    try:
        if len(tokens) == 9:
            return Delivery(tokens[2], int(tokens[5]), int(tokens[8]))
        if len(tokens) >= 11:
            return Delivery(tokens[4], int(tokens[7]), int(tokens[10]))
    except ValueError:
        return None
    return None


def is_status(msg: Msg) -> bool:
    """A status message of the pull (no messages, request timeout, a heartbeat...), not a
    delivery: no payload and a `Status` header."""
    return not msg.data and "Status" in (msg.headers or {})


class Pull:
    """One open pull request at a time on `stream`'s `consumer` (the shared durable one, or a
    log read's own), for at most `batch` messages, its deliveries kept until `take`n."""

    def __init__(self, nc: Client, stream: str, consumer: str, batch: int = BATCH,
                 refill_at: int = REFILL_AT):
        self.nc = nc
        self.subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.batch = batch
        self.refill_at = min(refill_at, batch)
        self._inbox = ""
        self._sub: Subscription | None = None
        self._arrived: deque[Msg] = deque()
        self._wake = asyncio.Event()
        self.owed = 0  # messages the open request may still deliver
        self._open_until = 0.0  # monotonic: past it, the open request is taken for over
        self._refused = False  # the last request was refused: none again before _open_until

    async def start(self) -> None:
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(self._inbox, cb=self._deliver)

    async def stop(self) -> list[Msg]:
        """Stop listening; what arrived and was not taken (to be handed back to the server)."""
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        left = list(self._arrived)
        self._arrived.clear()
        self.owed = 0
        return left

    async def _deliver(self, msg: Msg) -> None:
        if is_status(msg):
            status = (msg.headers or {}).get("Status")
            if status != "100":  # a heartbeat: the request is open
                self.owed = 0  # no messages, a timeout, a conflict: that request is over
            self._refused = status not in ("100", "404", "408")
            if self._refused:  # the consumer refused it (gone, too many waiting): not at once
                self._open_until = time.monotonic() + PAUSE_S
        else:
            self._arrived.append(msg)
            self.owed = max(self.owed - 1, 0)
        self._wake.set()

    async def reconnected(self) -> None:
        """The connection came back: the open request died with the old one (the server
        forgets it), so the next `take` asks again at once rather than after its expiry."""
        self.owed = 0
        self._open_until = 0.0
        self._refused = False
        self._wake.set()

    def nudge(self) -> None:
        """Room came free: a `take` waiting for it may ask for more."""
        self._wake.set()

    async def take(self, room: Callable[[], int], timeout: float) -> list[Msg]:
        """Every message delivered and not taken yet; when there is none, the first to arrive
        within `timeout` (none after it). A request leaves first when none is open and there
        is `room()` for `refill_at` messages more than those delivered and not taken: for
        that many."""
        await self._ask(room())
        if not self._arrived:
            with suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    while not self._arrived:
                        self._wake = asyncio.Event()
                        await self._wake.wait()
                        await self._ask(room())
        out = list(self._arrived)
        self._arrived.clear()
        return out

    async def _ask(self, room: int) -> None:
        if time.monotonic() < self._open_until and (self.owed or self._refused):
            return
        want = min(room - len(self._arrived), self.batch)
        if want < self.refill_at:
            return
        self.owed = want
        self._open_until = time.monotonic() + EXPIRES_S + GRACE_S
        await self.nc.publish(self.subject, _encode(_Request(batch=want,
                                                             expires=int(EXPIRES_S * 1e9))),
                              reply=self._inbox)
