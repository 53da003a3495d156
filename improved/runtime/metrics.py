"""Prometheus metrics and the HTTP health endpoints of the daemon.

An operator scrapes `GET /metrics` for what the loop is doing: transitions per stage, verdict,
cause and change class; triage decisions by class and verdict; time spent per stage; refused
inputs; apply results and how long an apply took from its dispatch to its answer; rollbacks;
the operator's queue and when its oldest entry began waiting; the autonomy state (on,
circuit_open, autonomy_off), the breaker and the crisis; the checkpoints (their result, when the
last one verified the log, their interval); work in flight; and whether the daemon is ready
and connected to NATS. Every label is bounded by the protocol (stage, class, verdict, cause,
result), never a proposal id or a service, and every bounded label set of the new families is
made at 0 from the start, so `rate()` and the dashboards see the first event
(deploy/grafana, deploy/prometheus).

`/readyz` answers 200 once the daemon is ready: its JetStream streams and consumers are bound,
so it consumes. `/healthz` answers 200 while the consumer tasks are alive; it is what a
supervisor restarts on. A broker outage is deliberately not unhealthy — a restart would not
cure it — and shows as `improved_nats_connected 0` instead.

`Metrics` keeps its own registry, so several daemons in one process (as in the tests) do not
collide, and the daemon only calls plain methods; `serve` is a minimal asyncio HTTP/1.1 server
(one request per connection, no threads, no framework) so the endpoints add no dependency
beyond prometheus_client.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = structlog.get_logger("improved.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXT = "text/plain; charset=utf-8"

AUTONOMY_STATES = ("on", "circuit_open", "autonomy_off")
APPLY_RESULTS = ("ok", "failed", "unreachable", "rolled_back")
CLASSES = ("L0", "L1", "L2", "L3", "L4")
TRIAGE_VERDICTS = ("accept", "defer", "reject")
DISPATCHED_RESULTS = ("ok", "failed")  # an order the chain records as sent, answered
ROLLBACK_RESULTS = ("rolled_back", "rollback_failed")
CHECKPOINT_RESULTS = ("verified", "broken", "failed")
# 1 ms to 30 s, roughly 1-2.5-5 per decade: a stage is a KV read or a bounded request.
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                 1.0, 2.5, 5.0, 10.0, 30.0)
# 10 ms to an hour: an apply is one request, or several on the slow retry of a late service.
APPLY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 300.0, 900.0, 3600.0)


class Metrics:
    """The daemon's metrics, on a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}  # `_child`
        self._transitions = Counter(
            "improved_transitions", "Stage transitions of proposals.",
            ("stage", "verdict", "cause", "class"), registry=r)
        self._stage_seconds = Histogram(
            "improved_stage_seconds", "Time spent in one stage of the loop.", ("stage",),
            buckets=STAGE_BUCKETS, registry=r)
        self._refused = Counter(
            "improved_refused", "Inbound messages refused, by refusal code.", ("code",),
            registry=r)
        self._applies = Counter(
            "improved_applies", "Apply requests to owning services, by result.", ("result",),
            registry=r)
        self._pending_reviews = Gauge(
            "improved_pending_reviews", "Proposals waiting for an operator review.", registry=r)
        self._autonomy = Gauge(
            "improved_autonomy", "Autonomy state: exactly one state is 1.", ("state",),
            registry=r)
        self._in_flight = Gauge(
            "improved_in_flight", "Inbound messages being handled now.", registry=r)
        self._ready = Gauge(
            "improved_ready", "1 once streams and consumers are bound.", registry=r)
        self._connected = Gauge(
            "improved_nats_connected", "1 while connected to the NATS server.", registry=r)
        for result in APPLY_RESULTS:  # present at 0 from the start, so rate() sees the first
            self._applies.labels(result)
        self.set_autonomy("on")  # the state of an empty autonomy chain
        self._decisions()
        self._brakes()
        self._checkpoints()

    def _decisions(self) -> None:
        """What the loop decided and how long applies took, every bounded label set at 0."""
        r = self.registry
        triaged = Counter(
            "improved_proposals_triaged", "Triage decisions on proposals, by change class "
            "(L0-L4) and verdict (accept, defer, reject); a proposal decided again after a "
            "hold counts again.", ("class", "verdict"), registry=r)
        rollbacks = Counter(
            "improved_rollbacks", "Rollbacks of applied proposals recorded on their chains, "
            "by change class and result (rolled_back, or rollback_failed: the owning service "
            "refused the inverse).", ("class", "result"), registry=r)
        # one dict lookup per appended trailer finds the child its verdict counts on, if any
        self._by_verdict: dict[tuple[str, str], Any] = {}
        for cls in CLASSES:
            for verdict in TRIAGE_VERDICTS:
                self._by_verdict[(cls, verdict)] = triaged.labels(cls, verdict)
            for result in ROLLBACK_RESULTS:
                self._by_verdict[(cls, result)] = rollbacks.labels(cls, result)
        apply_seconds = Histogram(
            "improved_apply_seconds", "Seconds from an apply's dispatch, as the chain records "
            "it, to the owning service's answer recorded (ok or failed), retries included.",
            ("result",), buckets=APPLY_BUCKETS, registry=r)
        self._apply_seconds = {result: apply_seconds.labels(result)
                               for result in DISPATCHED_RESULTS}
        self._oldest_review = Gauge(
            "improved_review_oldest_waiting_timestamp_seconds", "Unix time the oldest "
            "proposal in the operator's queue began waiting (its review index entry's since), "
            "as of the last recount of the index; 0 when none waits.", registry=r)

    def _brakes(self) -> None:
        """The breaker and the crisis, as the autonomy chain last read says."""
        r = self.registry
        self._paused_until = Gauge(
            "improved_breaker_paused_until_timestamp_seconds", "Unix time until which the "
            "circuit breaker holds autonomous applies back; in the past (or 0) when it is "
            "closed.", registry=r)
        self._breaker_rollbacks = Gauge(
            "improved_breaker_rollbacks", "Rollbacks of autonomous applies inside the "
            "breaker's window: it trips at improved_breaker_threshold.", registry=r)
        self._breaker_threshold = Gauge(
            "improved_breaker_threshold", "Autonomous rollbacks within the window that trip "
            "the breaker (policy.breaker_threshold).", registry=r)
        self._crisis = Gauge(
            "improved_crisis_open", "1 while a crisis is open (a broken audit log): no apply "
            "at all until an operator resolves it, signed.", registry=r)

    def _checkpoints(self) -> None:
        """The checkpoints: each result, and when the last one verified the log."""
        r = self.registry
        results = Counter(
            "improved_checkpoints", "Checkpoints attempted, by result: verified (the log "
            "verified and the checkpoint signed), broken (a break found: crisis), failed (it "
            "could not run, e.g. a broker outage).", ("result",), registry=r)
        self._checkpoint_results = {result: results.labels(result)
                                    for result in CHECKPOINT_RESULTS}
        self._checkpoint_verified = Gauge(
            "improved_checkpoint_verified", "1 when the last checkpoint that ran verified the "
            "audit log and was signed; 0 when it found a break, or before the first.",
            registry=r)
        self._checkpoint_at = Gauge(
            "improved_checkpoint_last_timestamp_seconds", "Unix time of the last checkpoint "
            "this daemon verified and signed; 0 before the first.", registry=r)
        self._checkpoint_interval = Gauge(
            "improved_checkpoint_interval_seconds", "How often the daemon signs a checkpoint "
            "(checkpoint_interval_s; 0: only at start and stop).", registry=r)

    def _child(self, metric: Counter | Histogram, *values: str) -> Any:
        """`metric.labels(*values)`, kept: prometheus_client takes a lock and checks the
        labels at every call, and this is called for every trailer. The values are the loop's
        own few (stages, verdicts, causes, classes), so what is kept stays small."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def transition(self, stage: str, verdict: str | None, cause: str | None,
                   change_class: str) -> None:
        self._child(self._transitions, stage, verdict or "", cause or "", change_class).inc()

    def decided(self, verdict: str | None, change_class: str) -> None:
        """An appended trailer's verdict: a triage decision or a rollback counts by class;
        any other verdict counts nothing here."""
        child = self._by_verdict.get((change_class, verdict or ""))
        if child is not None:
            child.inc()

    def observe_apply(self, result: str, seconds: float) -> None:
        self._apply_seconds[result].observe(max(seconds, 0.0))

    def observe_stage(self, stage: str, seconds: float) -> None:
        self._child(self._stage_seconds, stage).observe(seconds)

    def refused(self, code: str) -> None:
        self._refused.labels(code).inc()

    def apply_result(self, result: str) -> None:
        if result not in APPLY_RESULTS:
            raise ValueError(f"unknown apply result {result!r}; expected one of {APPLY_RESULTS}")
        self._child(self._applies, result).inc()

    def set_pending_reviews(self, n: int) -> None:
        self._pending_reviews.set(n)

    def set_oldest_review(self, since_ms: int | None) -> None:
        """When the oldest entry of the review index began waiting (None: the queue is
        empty)."""
        self._oldest_review.set(since_ms / 1000 if since_ms is not None else 0)

    def set_autonomy(self, state: str) -> None:
        if state not in AUTONOMY_STATES:
            raise ValueError(f"unknown autonomy state {state!r}; expected one of "
                             f"{AUTONOMY_STATES}")
        for s in AUTONOMY_STATES:
            self._autonomy.labels(s).set(1 if s == state else 0)

    def set_breaker(self, paused_until_ms: int, rollbacks: int, threshold: int) -> None:
        self._paused_until.set(paused_until_ms / 1000)
        self._breaker_rollbacks.set(rollbacks)
        self._breaker_threshold.set(threshold)

    def set_crisis(self, open_: bool) -> None:
        self._crisis.set(1 if open_ else 0)

    def checkpoint(self, result: str, at_ms: int | None = None) -> None:
        """A checkpoint ran: `verified` (signed at `at_ms`), `broken` or `failed`; a failed
        one says nothing of the log, so the last verdict stands."""
        if result not in CHECKPOINT_RESULTS:
            raise ValueError(f"unknown checkpoint result {result!r}; expected one of "
                             f"{CHECKPOINT_RESULTS}")
        self._checkpoint_results[result].inc()
        if result == "verified" and at_ms is not None:
            self._checkpoint_verified.set(1)
            self._checkpoint_at.set(at_ms / 1000)
        elif result == "broken":
            self._checkpoint_verified.set(0)

    def set_checkpoint_interval(self, seconds: float) -> None:
        self._checkpoint_interval.set(seconds)

    def set_in_flight(self, n: int) -> None:
        self._in_flight.set(n)

    def set_ready(self, ready: bool) -> None:
        self._ready.set(1 if ready else 0)

    def set_connected(self, connected: bool) -> None:
        self._connected.set(1 if connected else 0)

    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4) of this registry."""
        return generate_latest(self.registry)


# --- HTTP ------------------------------------------------------------------------------------

LINE_LIMIT = 8192  # bytes in the request line or one header line
MAX_HEADERS = 100
LINGER_S = 1.0  # after answering, how long to drain what the client still sends

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 500: "Internal Server Error", 503: "Service Unavailable"}
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(r"HTTP/\d\.\d")


class _BadRequest(Exception):
    pass


class EndpointError(RuntimeError):
    """The endpoint cannot be served (its port is taken): one line naming it and the fix."""


async def serve(metrics: Metrics, host: str, port: int, *, ready: Callable[[], bool],
                healthy: Callable[[], bool],
                read_timeout: float = 5.0) -> asyncio.base_events.Server:
    """Start the endpoint server on host:port (port 0: any free port, see server.sockets).

    One request per connection, answered with Content-Length and `Connection: close`; a client
    that does not send a full request head within `read_timeout` seconds gets 408. A port it
    cannot bind is an EndpointError: the daemon binds it before it says it is ready."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                async with asyncio.timeout(read_timeout):
                    method, path = await _read_head(reader)
                status, ctype, body = _route(method, path, metrics, ready, healthy)
            except _BadRequest:
                status, ctype, body = 400, TEXT, b"bad request"
            except TimeoutError:
                status, ctype, body = 408, TEXT, b"request timeout"
            extra = "Allow: GET\r\n" if status == 405 else ""
            head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
                    f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n")
            writer.write(head.encode("ascii") + body)
            async with asyncio.timeout(read_timeout):
                await writer.drain()
            await _linger(reader, writer)
        except (ConnectionError, TimeoutError):
            pass  # the client went away or stopped reading
        except Exception:
            log.exception("metrics endpoint failed")
        finally:
            writer.close()
            with suppress(Exception):
                await writer.wait_closed()

    try:
        return await asyncio.start_server(handle, host, port, limit=LINE_LIMIT)
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise EndpointError(f"metrics port {port} on {host} cannot be served ({why}): give "
                            "another --metrics-port (or metrics_port in the config), or leave "
                            "it out") from None


async def _read_line(reader: asyncio.StreamReader) -> bytes:
    try:
        line = await reader.readline()
    except ValueError:  # longer than the stream limit
        raise _BadRequest from None
    if not line.endswith(b"\n"):  # EOF before the head ended
        raise _BadRequest
    return line.rstrip(b"\r\n")


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, str]:
    """The method and path of the request; reads (and checks) every header line."""
    line = await _read_line(reader)
    if not line:  # RFC 9112 §2.2: a server should ignore an empty line before the request
        line = await _read_line(reader)
    try:
        method, target, version = line.decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        raise _BadRequest from None
    if (not _TOKEN.fullmatch(method) or not _VERSION.fullmatch(version)
            or not target or not target.isprintable()):
        raise _BadRequest
    for _ in range(MAX_HEADERS + 1):
        header = await _read_line(reader)
        if not header:
            return method, target.split("?", 1)[0]
        name, colon, _value = header.partition(b":")
        if not colon or not _TOKEN.fullmatch(name.decode("latin-1")):
            raise _BadRequest
    raise _BadRequest  # too many headers


def _route(method: str, path: str, metrics: Metrics, ready: Callable[[], bool],
           healthy: Callable[[], bool]) -> tuple[int, str, bytes]:
    if path not in ("/metrics", "/healthz", "/readyz"):
        return 404, TEXT, b"not found"
    if method != "GET":
        return 405, TEXT, b"method not allowed"
    if path == "/metrics":
        try:
            return 200, CONTENT_TYPE, metrics.render()
        except Exception:
            log.exception("rendering metrics failed")
            return 500, TEXT, b"internal error"
    if path == "/healthz":
        return (200, TEXT, b"ok") if _ask(healthy) else (503, TEXT, b"unhealthy")
    return (200, TEXT, b"ready") if _ask(ready) else (503, TEXT, b"not ready")


def _ask(probe: Callable[[], bool]) -> bool:
    """A probe that raises answers no."""
    try:
        return bool(probe())
    except Exception:
        log.exception("health probe failed")
        return False


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Half-close, then discard what the client still sends until it closes (or LINGER_S):
    closing with unread input makes the kernel reset the connection, which can destroy the
    answer before the client reads it."""
    if writer.can_write_eof():
        writer.write_eof()
    with suppress(TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while await reader.read(65536):
                pass

