"""What each service advertises on `<svc>.spec.get` (SPEC 09 §9), asked when a proposal for it
arrives and remembered for a while, so a service that advertised its omission of the loop
(`"improve": false`) gets no proposals accepted for it (`core.propose.surface_problem`).

Silence proves nothing — no responders, a timeout: the service may be down, and a proposal for
it is taken and applied when it is back — so it is remembered only briefly. Concurrent asks for
one service share one request. The answer only ever refuses (an output of what the service said,
never authority): who may answer `<svc>.spec.get` is the deployment's NATS permissions' to say
(deploy/accounts.conf: the service's own user).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.errors import NoRespondersError

from improved.protocol import subjects as S

ASK_TIMEOUT_S = 0.5  # a service slower than this to say what it is counts as silent
ANSWER_TTL_S = 60.0  # how long an answer stands (a change of surface takes this long)
SILENT_TTL_S = 5.0  # how long silence stands before the service is asked again


class Surfaces:
    def __init__(self, nc: Client, timeout_s: float = ASK_TIMEOUT_S,
                 answer_ttl_s: float = ANSWER_TTL_S, silent_ttl_s: float = SILENT_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.nc = nc
        self.timeout_s, self.answer_ttl_s, self.silent_ttl_s = (timeout_s, answer_ttl_s,
                                                                silent_ttl_s)
        self.clock = clock
        self._known: dict[str, tuple[float, Any]] = {}  # service → (good until, spec or None)
        self._asking: dict[str, asyncio.Future[Any]] = {}

    async def spec(self, service: str) -> Any:
        """What `service` advertises (the decoded JSON), or None when it did not answer."""
        known = self._known.get(service)
        if known is not None and known[0] > self.clock():
            return known[1]
        pending = self._asking.get(service)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._asking[service] = future
        try:
            spec = await self._ask(service)
            ttl = self.answer_ttl_s if spec is not None else self.silent_ttl_s
            self._known[service] = (self.clock() + ttl, spec)
            future.set_result(spec)
            return spec
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a waiter that left is not an unhandled error
            raise
        finally:
            del self._asking[service]

    async def _ask(self, service: str) -> Any:
        try:
            msg = await self.nc.request(S.service_spec(service), b"{}", timeout=self.timeout_s)
        except (NoRespondersError, TimeoutError):
            return None
        try:
            return msgspec.json.decode(msg.data)
        except msgspec.DecodeError:
            return None
