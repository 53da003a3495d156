"""A small async SDK for mesh services talking to `improved` (DESIGN §3, the wire contract).

Everything goes through the nats-py Client handed in; nothing is global, so one process can hold
several clients (one per service) side by side. Replies come back as the model Structs; an error
reply `{"error": {...}}` becomes an ImproveError. Transport failures (no responders, timeouts)
are nats-py's own exceptions: they mean "nobody answered", not "the daemon said no".
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import msgspec
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from improved.client import tracing
from improved.core import boundary, signing
from improved.core import propose as propose_stage
from improved.protocol import subjects as S
from improved.protocol import wire
from improved.protocol.model import (
    ApplyOrder,
    ApplyOutcome,
    ApplyReport,
    ApplyResult,
    ErrorBody,
    ErrorReply,
    LearnBack,
    MeasureReply,
    MeasureRequest,
    Proposal,
    ProposalState,
    ProposeReply,
    RefineReply,
    Signal,
    TriageDecision,
    to_json,
)

log = structlog.get_logger("improved.client")

T = TypeVar("T")
ProposalLike = Proposal | dict[str, Any]
SignalLike = Signal | dict[str, Any]
ApplyHandler = Callable[[ApplyOrder], Awaitable[ApplyResult]]
# A measurement: the request's metric (by its query, when it has one) → the current value.
MeasureHandler = Callable[[MeasureRequest], Awaitable[float]]
# The conformance kit's sample: a proposal as the service publishes its own (or its bytes).
SampleMaker = Callable[[], Awaitable[ProposalLike | bytes]]
# What a service does with a triage decision on one of its proposals.
DecisionHandler = Callable[[TriageDecision], Awaitable[None]]

# The daemon's default message limit: checking it here fails fast instead of after a round trip.
MAX_MESSAGE_BYTES = 256 * 1024
ERROR_LIMIT = 500  # characters of an error text in an ApplyResult

# A NATS user name that can name an inbox: one subject token, no wildcard. A dot would make one
# user's inboxes fall under another's grant (`_INBOX_svc.>` covers `_INBOX_svc.x.<id>`).
INBOX_USER_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}\Z")


def inbox_prefix(user: str) -> str:
    """`_INBOX_<user>`, the inbox prefix the NATS user `user` connects with (nats-py
    `nats.connect(..., inbox_prefix=inbox_prefix(user))`): every reply it waits for, JetStream's
    included, comes to `_INBOX_<user>.<id>`, so a deployment lets each user hear its own
    replies only (deploy/accounts.conf grants `_INBOX_<user>.>`). Outside nats-py's default
    `_INBOX.` namespace on purpose: no `_INBOX.>` grant reaches it."""
    if not INBOX_USER_RE.match(user):
        raise ValueError(f"NATS user {user!r} cannot name an inbox: use letters, digits, "
                         "'_' and '-' only, or pass an inbox prefix of its own")
    return f"_INBOX_{user}"


class ImproveError(Exception):
    """The daemon answered with `{"error": {"code", "message", "field"?}}` (or the SDK refused
    the input before sending, with the same shape)."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(f"{code}: {message}" + (f" (field {field})" if field else ""))
        self.code = code
        self.message = message
        self.field = field

    @classmethod
    def from_body(cls, body: Any) -> ImproveError:
        """From the inner object of an error reply; tolerant of a malformed one."""
        if not isinstance(body, dict):
            return cls("invalid_reply", f"error reply is not an object: {body!r}")
        field = body.get("field")
        return cls(str(body.get("code") or "unknown"), str(body.get("message") or ""),
                   field if isinstance(field, str) else None)

    @classmethod
    def from_wire(cls, err: wire.WireError) -> ImproveError:
        return cls(err.code, err.message, err.field)


def encode(obj: Any) -> bytes:
    """A Struct or a plain dict as JSON, as-is (a deliberately bad dict stays bad)."""
    return obj if isinstance(obj, bytes) else to_json(obj)


def checked(reply: dict[str, Any], type_: type[T]) -> T:
    """A reply as `type_`, or the ImproveError it carries."""
    if "error" in reply:
        raise ImproveError.from_body(reply["error"])
    try:
        return msgspec.convert(reply, type=type_)
    except msgspec.ValidationError as exc:
        raise ImproveError("invalid_reply", f"not a {type_.__name__}: {exc}") from None


_order_decoder = msgspec.json.Decoder(ApplyOrder)


def signed(kind: str, message: Any, key: Ed25519PrivateKey | None) -> bytes:
    """The message's bytes, or with `key` a DSSE envelope signing them as `kind` (a
    signing.PAYLOAD_TYPES key: "signal", "proposal")."""
    data = encode(message)
    if key is None:
        return data
    return encode(signing.sign(signing.PAYLOAD_TYPES[kind], data, key))


def decode_order(data: bytes) -> ApplyOrder:
    """An ApplyOrder, or a WireError naming what is wrong with it. Lenient on the order's own
    fields (ApplyOrder is an outbound record), strict on the embedded Proposal."""
    try:
        return _order_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise wire.from_validation(exc) from None
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError) as exc:
        raise wire.WireError(wire.INVALID_JSON, f"not a JSON object: {exc}") from None


def failed(error: str) -> ApplyResult:
    """The ApplyResult of a refused order: final, with the reason (trimmed to the limit)."""
    return ApplyResult(ok=False, error=error[:ERROR_LIMIT])


# A clustered stream answers a publish whose Nats-Msg-Id another publish is storing at that
# moment with 409 / 10158 (JSStreamDuplicateMessageConflict, "duplicate message id is in
# process"), where a single server would acknowledge it as a duplicate. Asked again a moment
# later, the stream knows the message: a duplicate, acknowledged (or stored, if the other
# publish failed after all).
DUPLICATE_IN_PROCESS = 10158
DUPLICATE_RETRIES = 8


async def publish_deduplicated(js: JetStreamContext, subject: str, data: bytes, msg_id: str,
                               stream: str, headers: dict[str, str] | None = None) -> None:
    """Publish into `stream` deduplicated by `msg_id`: the same message published twice, even
    at the same moment on a cluster, is one message and both publishes succeed. `headers`
    (a `traceparent`) go with it."""
    sent = {"Nats-Msg-Id": msg_id} if headers is None else {**headers, "Nats-Msg-Id": msg_id}
    for attempt in range(DUPLICATE_RETRIES):
        try:
            await js.publish(subject, data, headers=sent, stream=stream)
            return
        except APIError as exc:
            if exc.err_code != DUPLICATE_IN_PROCESS or attempt == DUPLICATE_RETRIES - 1:
                raise
            await asyncio.sleep(0.01 * 2 ** attempt)


async def enqueue(js: JetStreamContext, service: str, data: bytes, pid: str,
                  headers: dict[str, str] | None = None) -> None:
    """Put a proposal into the inbound stream, durably (acknowledged by JetStream) and
    deduplicated (`Nats-Msg-Id`, `subjects.message_id`): enqueueing the same message twice is
    one message, and no other message can take its place. `headers`: its `traceparent`."""
    await publish_deduplicated(js, S.inbound_proposal(service), data, S.message_id(pid, data),
                               S.STREAM_INBOUND, headers)


def traced(traceparent: str | None) -> dict[str, str] | None:
    """The headers carrying the caller's trace (`tracing.outgoing`); ImproveError for an
    explicit `traceparent` that is not one."""
    try:
        return tracing.outgoing(traceparent)
    except tracing.BadTraceparent as exc:
        raise ImproveError(wire.INVALID_VALUE, str(exc), "traceparent") from None


def answer_bytes(msg: Msg, body: bytes, key: Ed25519PrivateKey | None) -> bytes:
    """What a service sends back to a request of the daemon's: the reply's JSON, or with
    `key` (the one `[trust.signers]` binds to `service:<svc>`) that JSON signed for this very
    request — its subject and reply inbox — so the daemon can tell it from an answer anyone
    else on the bus could give (`improved.core.boundary`)."""
    if key is None or not msg.reply:
        return body
    return boundary.sign_reply(body, msg.subject, msg.reply, key)


class MeshClient:
    """One mesh service's view of the loop: propose, follow, refine, and serve its applies.

    With `key` — the Ed25519 key the daemon's `[trust.signers]` binds to `service:<svc>` —
    every answer it gives the daemon (ApplyResults, measurements, reports) is signed, so
    the daemon can attribute it to the service: on a bus without accounts, where anyone may
    answer a request first, only a signed measurement can roll a change back, and where a
    key is trusted for the service only its signed answers count at all."""

    def __init__(self, nc: Client, service: str, timeout: float = 10.0,
                 key: Ed25519PrivateKey | None = None):
        if not S.SERVICE_RE.match(service):
            raise ValueError(f"service name {service!r} must match {S.SERVICE_RE.pattern}")
        self.nc = nc
        self.service = service
        self.timeout = timeout
        self.key = key
        self.js = nc.jetstream(timeout=timeout)

    # -- request/reply with the daemon -------------------------------------------------------------

    async def _request(self, subject: str, data: bytes,
                       headers: dict[str, str] | None = None) -> dict[str, Any]:
        msg = await self.nc.request(subject, data, timeout=self.timeout, headers=headers)
        try:
            reply = msgspec.json.decode(msg.data)
        except msgspec.DecodeError as exc:
            raise ImproveError("invalid_reply", f"{subject} answered non-JSON: {exc}") from None
        if not isinstance(reply, dict):
            raise ImproveError("invalid_reply", f"{subject} answered {type(reply).__name__}, "
                               "not an object")
        return reply

    def _target(self, proposal: ProposalLike) -> str:
        """The proposal's own service decides the subject; a dict without one uses ours."""
        svc = proposal.service if isinstance(proposal, Proposal) else proposal.get("service")
        return svc if isinstance(svc, str) and S.SERVICE_RE.match(svc) else self.service

    async def propose(self, proposal: ProposalLike,
                      key: Ed25519PrivateKey | None = None,
                      traceparent: str | None = None) -> ProposeReply:
        """Propose and wait for the daemon to register it: `{proposal_id, status}`. With `key`
        it is signed (a DSSE envelope): the identity that key is bound to in the daemon's
        `[trust.signers]`, `agent:<svc>:<name>` or `service:<svc>` of the proposal's service,
        is then its verified proposer. The id is the proposal's, signed or not. The
        proposal's trace continues `traceparent`, else the current OpenTelemetry span
        (`client.tracing`)."""
        reply = await self.propose_raw(signed("proposal", proposal, key),
                                       self._target(proposal), traceparent)
        return checked(reply, ProposeReply)

    async def propose_raw(self, data: bytes, service: str | None = None,
                          traceparent: str | None = None) -> dict[str, Any]:
        """Send any bytes as a proposal; the decoded reply, error or not, without raising."""
        return await self._request(S.propose_request(service or self.service), data,
                                   traced(traceparent))

    async def triage(self, proposal_id: str, service: str | None = None) -> TriageDecision:
        """Ask for (or re-run, idempotently) the triage of a proposal."""
        body = to_json({"proposal_id": proposal_id})
        return checked(await self._request(S.triage_request(service or self.service), body),
                       TriageDecision)

    async def refine(self, signal: SignalLike, service: str | None = None,
                     key: Ed25519PrivateKey | None = None,
                     traceparent: str | None = None) -> RefineReply:
        """Send a signal about a proposal (the daemon finds its service by the id) and learn
        if it counted, and as independent. It goes on our own subject unless `service` names
        another; with `key` it is signed (a DSSE envelope), and the principal that key is bound
        to in the daemon's trust store — the signal's `actor` — is who verifiably sent it."""
        reply = await self._request(S.refine_request(service or self.service),
                                    signed("signal", signal, key), traced(traceparent))
        return checked(reply, RefineReply)

    # -- durable, fire-and-forget (JetStream) ------------------------------------------------------

    async def publish(self, proposal: ProposalLike,
                      key: Ed25519PrivateKey | None = None,
                      traceparent: str | None = None) -> str:
        """Publish a proposal into the inbound stream, deduplicated by its id; the id. With
        `key` it is signed (see `propose`); a signature that does not verify is refused by
        the daemon, out of sight (on `improved.refused.<svc>`).

        Publishing needs the id, so the proposal is validated here first: a bad one raises
        ImproveError instead of being refused later, out of sight. Its trace continues
        `traceparent`, else the current OpenTelemetry span (`client.tracing`)."""
        try:
            parsed = propose_stage.validate(encode(proposal), None, MAX_MESSAGE_BYTES)
            pid, _ = propose_stage.identify(parsed)
        except wire.WireError as err:
            raise ImproveError.from_wire(err) from None
        await enqueue(self.js, parsed.service, signed("proposal", proposal, key), pid,
                      traced(traceparent))
        return pid

    async def signal(self, signal: SignalLike, service: str | None = None,
                     key: Ed25519PrivateKey | None = None,
                     traceparent: str | None = None) -> str:
        """Publish learn-back evidence about a proposal, on our own subject unless `service`
        names another, signed with `key` if given (see `refine`); returns the signal's digest,
        also in its `Nats-Msg-Id` (`subjects.message_id`), so a retried publish counts once.
        It carries `traceparent`, else the current OpenTelemetry span's (`client.tracing`)."""
        try:
            parsed = wire.decode(encode(signal), Signal, MAX_MESSAGE_BYTES)
        except wire.WireError as err:
            raise ImproveError.from_wire(err) from None
        digest = propose_stage.signal_digest(parsed)
        data = signed("signal", signal, key)
        await publish_deduplicated(self.js, S.inbound_outcome(service or self.service), data,
                                   S.message_id(digest, data), S.STREAM_INBOUND,
                                   traced(traceparent))
        return digest

    async def report(self, report: ApplyReport | dict[str, Any],
                     traceparent: str | None = None) -> None:
        """Report an apply this service made asynchronously (`improve.applied.<svc>`),
        durably; signed with the client's key when it has one (`sign_report`). The daemon
        takes it once, while the proposal awaits its apply. It carries `traceparent`, else
        the current OpenTelemetry span's (`client.tracing`), as `signal` does."""
        headers = traced(traceparent)
        data = encode(report)
        if self.key is not None:
            data = boundary.sign_report(data, self.key)
        await self.js.publish(S.inbound_applied(self.service), data, stream=S.STREAM_INBOUND,
                              headers=headers)

    # -- retained records --------------------------------------------------------------------------

    async def _last(self, subject: str, type_: type[T]) -> T | None:
        """The latest retained record on `subject`, or None when there is none (or no records
        stream yet, which means the same: nothing has been recorded)."""
        try:
            msg = await self.js.get_msg(S.STREAM_RECORDS, subject=subject, direct=True)
        except (NotFoundError, NoRespondersError):
            return None
        if not msg.data:
            return None
        return msgspec.json.decode(msg.data, type=type_)

    async def state(self, proposal_id: str, service: str | None = None) -> ProposalState | None:
        return await self._last(S.proposal_state(service or self.service, proposal_id),
                                ProposalState)

    async def decision(self, proposal_id: str,
                       service: str | None = None) -> TriageDecision | None:
        return await self._last(S.triage_decision(service or self.service, proposal_id),
                                TriageDecision)

    async def outcome(self, proposal_id: str, service: str | None = None) -> ApplyOutcome | None:
        return await self._last(S.apply_outcome(service or self.service, proposal_id),
                                ApplyOutcome)

    async def learn_back(self, proposal_id: str, service: str | None = None) -> LearnBack | None:
        return await self._last(S.learn_back(service or self.service, proposal_id), LearnBack)

    # -- serving applies ---------------------------------------------------------------------------

    async def serve_apply(self, handler: ApplyHandler) -> Subscription:
        """Answer `<svc>.improve.apply` with `handler`; instances share a queue group.

        Every order gets a reply. A bad order, a mis-routed one, or a handler returning junk is
        an ApplyResult `ok=false` with the reason: final. A handler that *raises* (the store was
        briefly unreachable, say) answers the error reply of DESIGN §3.1 instead, which the
        daemon takes as "not now" and retries with backoff. The subscription never dies.
        The handler runs in the order's trace (`client.tracing.handling`)."""

        async def on_order(msg: Msg) -> None:
            with tracing.handling("apply", msg.subject, msg.headers):
                result = await self.answer(msg.data, handler)
            if not msg.reply:
                return
            try:
                await msg.respond(answer_bytes(msg, to_json(result), self.key))
            except Exception as exc:  # the daemon retries; the ledger makes that harmless
                log.warning("could not reply to an apply order", service=self.service,
                            error=str(exc))

        return await self.nc.subscribe(S.apply_request(self.service), queue=self.service,
                                       cb=on_order)

    async def answer(self, data: bytes, handler: ApplyHandler) -> ApplyResult | ErrorReply:
        """One order's bytes → the reply (no exceptions escape)."""
        try:
            order = decode_order(data)
        except wire.WireError as err:
            return failed(f"bad ApplyOrder: {err.message}")
        if order.proposal.service != self.service:
            return failed(f"the proposal targets service {order.proposal.service!r}, "
                          f"not {self.service!r}")
        try:
            result = await handler(order)
        except Exception as exc:
            log.warning("apply handler failed; the daemon will retry", service=self.service,
                        proposal_id=order.proposal_id, error=repr(exc))
            return ErrorReply(error=ErrorBody(code="unavailable", message=(
                f"apply failed for now: {type(exc).__name__}: {exc}")[:500]))
        if isinstance(result, dict):
            try:
                result = msgspec.convert(result, type=ApplyResult)
            except msgspec.ValidationError as exc:
                return failed(f"the apply handler returned a bad result: {exc}")
        if not isinstance(result, ApplyResult):
            return failed(f"the apply handler returned {type(result).__name__}, "
                          "not an ApplyResult")
        return result


    # -- serving measurements (learn-back at review_after) --------------------------------------

    async def serve_measure(self, handler: MeasureHandler) -> Subscription:
        """Answer `<svc>.improve.measure` with `handler`: the daemon asks at a proposal's
        `metric_snapshot.review_after` for the metric's current value. A value is `{"value"}`;
        a bad request, a handler that raises (it cannot measure this metric, say) or returns
        no finite number is the error reply `{"error": {"code", "message"}}`, which the daemon
        records as unmeasured with that message. The subscription never dies. The handler
        runs in the request's trace (`client.tracing.handling`)."""

        async def on_request(msg: Msg) -> None:
            with tracing.handling("measure", msg.subject, msg.headers):
                reply = await self.measure(msg.data, handler)
            if not msg.reply:
                return
            try:
                await msg.respond(answer_bytes(msg, to_json(reply), self.key))
            except Exception as exc:  # the daemon records the proposal unmeasured
                log.warning("could not reply to a measure request", service=self.service,
                            error=str(exc))

        return await self.nc.subscribe(S.measure_request(self.service), queue=self.service,
                                       cb=on_request)

    async def measure(self, data: bytes, handler: MeasureHandler) -> MeasureReply | ErrorReply:
        """One measure request's bytes → the reply (no exceptions escape)."""
        try:
            request = wire.decode(data, MeasureRequest, MAX_MESSAGE_BYTES)
        except wire.WireError as err:
            return ErrorReply(error=ErrorBody(code=err.code, message=err.message,
                                              field=err.field))
        try:
            value = await handler(request)
        except Exception as exc:
            return ErrorReply(error=ErrorBody(code="unmeasurable", message=(
                str(exc) or type(exc).__name__)[:ERROR_LIMIT]))
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value):
            return ErrorReply(error=ErrorBody(code="unmeasurable", message=(
                f"the measure handler returned {value!r}, not a finite number")[:ERROR_LIMIT]))
        return MeasureReply(value=float(value))

    # -- answering the conformance kit -----------------------------------------------------------

    async def serve_conformance(self, sample: SampleMaker,
                                on_decision: DecisionHandler | None = None) -> SpecServer:
        """Answer the conformance kit (`improved conformance`, SPEC 09 §9 L1):
        `<svc>.improve.conformance.propose` with `sample()`, a proposal exactly as this
        service publishes its own, and `<svc>.improve.conformance.triage` by taking the
        TriageDecision it carries through `on_decision`. Nothing reaches the loop: the sample
        is only answered, never published. The subscriptions never die."""
        answers = Conformance(self, sample, on_decision)

        async def on_propose(msg: Msg) -> None:
            await _respond(msg, await answers.sample_bytes(), self.service)

        async def on_triage(msg: Msg) -> None:
            await _respond(msg, to_json(await answers.take(msg.data)), self.service)

        return SpecServer([
            await self.nc.subscribe(S.conformance_propose(self.service), queue=self.service,
                                    cb=on_propose),
            await self.nc.subscribe(S.conformance_triage(self.service), queue=self.service,
                                    cb=on_triage)])


async def _respond(msg: Msg, body: bytes, service: str) -> None:
    if not msg.reply:
        return
    try:
        await msg.respond(body)
    except Exception as exc:  # the kit reports no answer
        log.warning("could not answer the conformance kit", service=service, error=str(exc))


class Conformance:
    """A service's answers to the conformance kit (SPEC 09 §9, L1: it emits valid proposals
    and takes triage decisions), for `MeshClient.serve_conformance`."""

    def __init__(self, client: MeshClient, sample: SampleMaker,
                 on_decision: DecisionHandler | None):
        self.client, self.sample, self.on_decision = client, sample, on_decision

    async def sample_bytes(self) -> bytes:
        """The sample exactly as the service would publish it: bytes as made, a proposal
        signed with the client's key when it has one; a sample that cannot be made is the
        error reply `unavailable`."""
        try:
            made = await self.sample()
        except Exception as exc:
            return to_json(ErrorReply(error=ErrorBody(code="unavailable", message=(
                f"no sample proposal: {type(exc).__name__}: {exc}")[:ERROR_LIMIT])))
        return made if isinstance(made, bytes) else signed("proposal", made, self.client.key)

    async def take(self, data: bytes) -> dict[str, Any] | ErrorReply:
        """One triage decision's bytes → `{"taken": true, "proposal_id", "verdict"}`, or the
        error reply naming what is wrong with it: decoded as `MeshClient.decision` reads a
        retained one, and only for this service's own proposals."""
        try:
            decision = wire.decode(data, TriageDecision, MAX_MESSAGE_BYTES)
        except wire.WireError as err:
            return ErrorReply(error=ErrorBody(code=err.code, message=err.message,
                                              field=err.field))
        if decision.service != self.client.service:
            return ErrorReply(error=ErrorBody(
                code=wire.SUBJECT_MISMATCH, field="service", message=(
                    f"a decision about service {decision.service!r} is not "
                    f"{self.client.service!r}'s to take")[:ERROR_LIMIT]))
        if self.on_decision is not None:
            try:
                await self.on_decision(decision)
            except Exception as exc:
                return ErrorReply(error=ErrorBody(code="unavailable", message=(
                    f"the decision was not taken: {type(exc).__name__}: {exc}")[:ERROR_LIMIT]))
        return {"taken": True, "proposal_id": decision.proposal_id,
                "verdict": decision.verdict}


class Served(Protocol):
    """What a serving call returns: something to drain or unsubscribe when the service stops
    (a nats-py Subscription is one)."""

    async def drain(self) -> None: ...

    async def unsubscribe(self, limit: int = 0) -> None: ...


class SpecServer:
    """The two subscriptions of an advertised spec: `<svc>.spec.get` (queue group = the
    service) and the mesh-wide discovery broadcast (every instance answers); both end
    together."""

    def __init__(self, subs: list[Subscription]):
        self._subs = subs

    async def drain(self) -> None:
        for sub in self._subs:
            # nats-py 2.16 leaves Subscription.drain unannotated (it returns None)
            await sub.drain()  # type: ignore[no-untyped-call]

    async def unsubscribe(self, limit: int = 0) -> None:
        for sub in self._subs:
            await sub.unsubscribe(limit)


async def serve_spec(nc: Client, service: str,
                     capabilities: dict[str, Any] | None = None,
                     key: Ed25519PrivateKey | None = None) -> SpecServer:
    """Answer `<svc>.spec.get` with `capabilities`; without them, advertise their omission
    (`{"improve": false}`) rather than stay silent, so a caller can tell "no" from "down".
    The same answer goes to `improved.spec.discover`, so the mesh can be listed. With `key`
    (the service's, as for `MeshClient`) each answer is signed for its request: the daemon
    honours an advertised omission only when it can tell it is the service's own."""
    body = to_json(capabilities if capabilities is not None
                   else {"service": service, "improve": False})

    async def on_get(msg: Msg) -> None:
        if msg.reply:
            try:
                await msg.respond(answer_bytes(msg, body, key))
            except Exception as exc:
                log.warning("could not answer spec.get", service=service, error=str(exc))

    return SpecServer([await nc.subscribe(S.service_spec(service), queue=service, cb=on_get),
                       await nc.subscribe(S.SPEC_DISCOVER, cb=on_get)])
