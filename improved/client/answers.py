"""Requests to the services that hear every answer, not only the first: the daemon's, and a
command's (`improved review` asking a schema's class).

On a bus without accounts anyone may answer `<svc>.improve.measure` (or `.apply`, `.lkg`,
`spec.get`) before the service does. A request that took the first answer would let that one
decide; so each request here collects its answers as evidence (`core.boundary.attest_reply`:
attributable to the service, or not) until one that can count has come, then returns them
all. Whom a decision believes is `core.boundary`'s to say; this module only listens.

One wildcard subscription serves every request (as nats-py's own request does): each request
has a reply inbox of its own under it, `<inbox prefix>.<nuid>.<n>`, which is also what a
signed answer names, so an answer signed for another request does not count for this one.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from improved.core import boundary
from improved.core.signing import TrustStore

NO_RESPONDERS = "503"  # the status the server answers a request nobody subscribes to

# The daemon's inbox prefix on the embedded open bus (`runtime.open_bus`): no client but the
# daemon may publish or subscribe under it there, so only the server answers on it.
DAEMON_INBOX = "_INBOX_improved_open"


def service_reply_prefix(nc: Client) -> str:
    """A fresh reply prefix a service may answer on: the connection's own inbox, but for the
    daemon on the open bus, whose inboxes no service may publish to — its requests to
    services are answered under the open `_INBOX` (the same nuid), JetStream's on its own."""
    inbox = nc.new_inbox()
    if inbox.startswith(DAEMON_INBOX + "."):
        return "_INBOX" + inbox[len(DAEMON_INBOX):]
    return inbox


class Answers:
    """Requests to the owning services, every answer heard as evidence."""

    def __init__(self, nc: Client, signers: Callable[[], TrustStore], bound: bool):
        self.nc = nc
        self.signers = signers  # the keys trusted now (a trust reload changes them)
        self.bound = bound
        self._prefix = ""
        self._sub: Subscription | None = None
        self._waiting: dict[str, asyncio.Queue[Msg]] = {}
        self._ids = itertools.count()
        self._starting = asyncio.Lock()

    def attestable(self, service: str) -> bool:
        """Whether any answer `service` gives could be attested (`boundary.can_attest`)."""
        return boundary.can_attest(service, self.signers(), self.bound)

    async def _start(self) -> None:
        async with self._starting:
            if self._sub is None:
                self._prefix = service_reply_prefix(self.nc) + "."
                self._sub = await self.nc.subscribe(self._prefix + "*", cb=self._route)

    async def _route(self, msg: Msg) -> None:
        queue = self._waiting.get(msg.subject)
        if queue is not None:
            queue.put_nowait(msg)

    async def ask(self, service: str, subject: str, body: bytes, timeout: float,
                  grace: float = 0.0, headers: dict[str, str] | None = None,
                  first: bool = False) -> list[boundary.Evidence[bytes]]:
        """Send `body` on `subject` and return every answer heard, each as evidence of
        `service`'s: up to the first when nothing `service` says could be attested; else
        until one is attested (and `grace` seconds more, to hear one that disagrees), or the
        timeout. NoRespondersError when nobody serves the subject, nats-py's TimeoutError when
        nothing at all came. `headers` (a `traceparent`) go with the request; `first`: the
        first answer ends the wait (a probe of whether anyone serves the subject)."""
        if self._sub is None:
            await self._start()
        attestable = self.attestable(service) and not first
        inbox = f"{self._prefix}{next(self._ids)}"
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._waiting[inbox] = queue
        heard: list[boundary.Evidence[bytes]] = []
        loop = asyncio.get_running_loop()
        try:
            await self.nc.publish(subject, body, reply=inbox, headers=headers)
            async with asyncio.timeout_at(loop.time() + timeout) as window:  # one timer an ask
                while True:
                    msg = await queue.get()
                    if msg.headers and msg.headers.get("Status") == NO_RESPONDERS \
                            and not msg.data:
                        if heard:
                            break
                        raise NoRespondersError
                    heard.append(boundary.attest_reply(
                        msg.data, service=service, subject=subject, reply_to=inbox,
                        signers=self.signers(), bound=self.bound))
                    if not attestable:
                        break
                    if boundary.settled(heard):
                        window.reschedule(min(window.when() or loop.time(),
                                              loop.time() + grace))
        except TimeoutError:
            pass  # the window closed: what was heard is the answer
        finally:
            del self._waiting[inbox]
        if not heard:
            raise NatsTimeout
        return heard

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
