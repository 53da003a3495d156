"""The daemon's request/reply capabilities: `<svc>.improve.propose`, `.triage` and `.refine`, and
`improved.spec.get`. Every request gets a reply: a record, or the error reply of DESIGN §3.1.
A proposal and a refine signal are made durable on the inbound stream before the reply, so
the inbound consumer, which has the message too, carries any apply they release.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from improved.client.config import Config
from improved.client.sdk import enqueue, publish_deduplicated
from improved.core import propose
from improved.core.capabilities import capabilities
from improved.core.inbound import (
    proposal_of,
    signal_of,
)
from improved.core.record import status_at
from improved.protocol import subjects as S
from improved.protocol import wire
from improved.protocol.model import (
    ProposeReply,
    RefineReply,
    TriageRequest,
    to_json,
)
from improved.protocol.tracecontext import TRACEPARENT, of_headers
from improved.runtime.admission import Admission, ProposalUnknown
from improved.runtime.engine import Engine
from improved.runtime.intake import Intake
from improved.runtime.records import ChainBroken
from improved.runtime.service_requests import ServiceUnreachable
from improved.runtime.store import Store
from improved.runtime.telemetry import incoming

log = structlog.get_logger("improved.daemon")


class RequestReply:
    """The handlers of the request subjects, subscribed in the daemon's queue group."""

    def __init__(self, nc: Client, store: Store, config: Config, engine: Engine, intake: Intake,
                 admission: Admission):
        self.nc = nc
        self.store = store
        self.config = config
        self.engine = engine
        self.intake = intake
        self.admission = admission
        self._subs: list[Subscription] = []

    async def subscribe(self) -> None:
        """Answer every request subject, shared with the other replicas (S.QUEUE_GROUP)."""
        for subject, handler in (
            (S.PROPOSE_REQUESTS, self.on_propose),
            (S.TRIAGE_REQUESTS, self.on_triage),
            (S.REFINE_REQUESTS, self.on_refine),
            (S.SPEC_GET, self.on_spec),
        ):
            self._subs.append(await self.nc.subscribe(subject, queue=S.QUEUE_GROUP,
                                                      cb=self._guarded(handler)))

    async def unsubscribe(self) -> None:
        """Take no more requests (the first step of a stop)."""
        for sub in self._subs:
            await sub.unsubscribe()

    def _guarded(self, handler: Callable[[str, Msg], Awaitable[bytes]]
                 ) -> Callable[[Msg], Awaitable[None]]:
        """Every request gets a reply: a record, or the error reply of DESIGN §3.1."""

        async def run(msg: Msg) -> None:
            svc = S.token(msg.subject, 0) or "_"
            traced = incoming.set(of_headers(msg.headers)) if self.engine.tracing.on else None
            try:
                if msg.subject != S.SPEC_GET and not S.SERVICE_RE.match(svc):
                    raise wire.WireError(wire.INVALID_VALUE, f"bad service token {svc!r}")
                reply = await handler(svc, msg)
            except wire.WireError as err:
                await self.admission.refuse(svc, msg.subject, err, len(msg.data))
                reply = err.reply()
            except ProposalUnknown as exc:
                reply = wire.WireError(wire.NOT_FOUND, str(exc), "proposal_id").reply()
            except ChainBroken as exc:
                reply = wire.WireError(wire.CHAIN_BROKEN, f"the chain does not verify, nothing "
                                       f"is decided on it: {exc}", "proposal_id").reply()
            except Exception:
                log.exception("request failed", subject=msg.subject)
                reply = wire.WireError(wire.INTERNAL, "internal error; see the daemon log").reply()
            if msg.reply:
                try:
                    await msg.respond(reply)
                except Exception as exc:
                    log.warning("could not reply", subject=msg.subject, error=str(exc))
            if traced is not None:
                incoming.reset(traced)

        return run

    def _trace(self, msg: Msg) -> dict[str, str] | None:
        """The request's `traceparent`, carried onto the inbound copy made of it (traced)."""
        found = of_headers(msg.headers) if self.engine.tracing.on else None
        return {TRACEPARENT: found} if found is not None else None

    async def on_propose(self, svc: str, msg: Msg) -> bytes:
        proposal, env = proposal_of(msg.data, svc, self.config.max_message_bytes)
        pid, dedup = propose.identify(proposal)
        await self.admission.check_surface(svc, pid, proposal)
        async with self.engine.trust.acting():
            # a signed proposal that does not verify is refused before anything is kept
            proposer = self.engine.trust.verified_proposer(proposal, env)
            # Durable first: once the stream has it, a crash cannot lose it.
            await enqueue(self.store.js, svc, msg.data, pid, self._trace(msg))
            # Register and triage now, so the reply carries the status; the inbound consumer,
            # which has the message too, carries the apply with its retries.
            handled = await self.intake.submit(proposal, pid, dedup, dispatch=False,
                                               fresh=True, proposer=proposer, envelope=env)
        status = (status_at(handled.record, int(time.time() * 1000)) if handled.record
                  else "pending")
        return to_json(ProposeReply(proposal_id=pid, status=status))

    async def on_triage(self, svc: str, msg: Msg) -> bytes:
        req = wire.decode(msg.data, TriageRequest, self.config.max_message_bytes)
        try:
            handled = await self.engine.advance(svc, req.proposal_id, republish=True)
            record = handled.record
        except ServiceUnreachable:  # what was decided stands: the record as committed
            record = await self.engine.records.truth(svc, req.proposal_id)
        if record is None:
            raise ProposalUnknown(f"no proposal {req.proposal_id} for service {svc}")
        if record.decision is None:
            raise wire.WireError(wire.NOT_FOUND, "the proposal has no decision yet",
                                 "proposal_id")
        return to_json(record.decision)

    async def on_refine(self, svc: str, msg: Msg) -> bytes:
        sig, env = signal_of(msg.data, self.config.max_message_bytes)
        if sig.proposal_id is None:
            raise wire.WireError(wire.MISSING_FIELD, "a refine signal names its proposal_id",
                                 "proposal_id")
        # Durable first, like a proposal: the inbound consumer carries any apply it releases.
        await publish_deduplicated(self.store.js, S.inbound_outcome(svc), msg.data,
                                   S.message_id(propose.signal_digest(sig), msg.data),
                                   S.STREAM_INBOUND, self._trace(msg))
        handled = await self.admission.count(svc, sig, env, fresh=True, dispatch=False)
        counted = handled.counted
        if handled is not None and handled.record is None:
            raise ProposalUnknown(f"no proposal {sig.proposal_id} for service {svc}")
        return to_json(RefineReply(proposal_id=sig.proposal_id, counted=counted is not None,
                                   independent=bool(counted and counted.independent)))

    async def on_spec(self, svc: str, msg: Msg) -> bytes:
        return msgspec.json.encode(capabilities(self.config.policy.quorum))
