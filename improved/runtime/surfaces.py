"""What each service advertises on `<svc>.spec.get` (SPEC 09 §9), asked when a proposal for it
arrives and remembered for a while, so a service that advertised its omission of the loop
(`"improve": false`) gets no proposals accepted for it (`core.propose.surface_problem`).

Only the service's own answer refuses: one attested (`core.boundary`: signed by the key
`[trust.signers]` binds to `service:<svc>`, or under accounts that bind its subjects), so an
impostor answering first on an open bus refuses nothing. A service none of whose answers could
be attested is not asked at all. Silence proves nothing — no responders, a timeout: the service
may be down, and a proposal for it is taken and applied when it is back — so it is remembered
only briefly. Concurrent asks for one service share one request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from improved.client.answers import Answers
from improved.core import boundary
from improved.protocol import subjects as S

ASK_TIMEOUT_S = 0.5  # a service slower than this to say what it is counts as silent
ANSWER_TTL_S = 60.0  # how long an answer stands (a change of surface takes this long)
SILENT_TTL_S = 5.0  # how long silence stands before the service is asked again
GRACE_S = 0.1  # after the first attested answer, how long to hear one that disagrees
Spec = boundary.Answer[Any]  # what a service advertised, and who said it


class Surfaces:
    def __init__(self, answers: Answers, timeout_s: float = ASK_TIMEOUT_S,
                 answer_ttl_s: float = ANSWER_TTL_S, silent_ttl_s: float = SILENT_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.answers = answers
        self.timeout_s, self.answer_ttl_s, self.silent_ttl_s = (timeout_s, answer_ttl_s,
                                                                silent_ttl_s)
        self.clock = clock
        # service → (good until, what it said, or None)
        self._known: dict[str, tuple[float, Spec | None]] = {}
        self._asking: dict[str, asyncio.Future[Spec | None]] = {}

    async def spec(self, service: str) -> Spec | None:
        """What `service` advertises (the decoded JSON) with who said it, or None when it did
        not answer (or could not have said anything that counts)."""
        if not self.answers.attestable(service):
            return None
        known = self._known.get(service)
        if known is not None and known[0] > self.clock():
            return known[1]
        pending = self._asking.get(service)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Spec | None] = asyncio.get_running_loop().create_future()
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

    async def _ask(self, service: str) -> Spec | None:
        try:
            heard = await self.answers.ask(service, S.service_spec(service), b"{}",
                                           self.timeout_s, GRACE_S)
        except (NoRespondersError, NatsTimeout, TimeoutError):
            return None
        return boundary.choose(boundary.present([e.map(_decoded) for e in heard]))


def _decoded(data: bytes) -> Any:
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
