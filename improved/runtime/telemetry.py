"""The daemon's OpenTelemetry traces: a span per stage transition it commits (propose, triage,
apply with its dispatch and outcome, learn-back, rollback) and one per request it makes of the
owning service (the ApplyOrder, the LKG check, the measurement), whose `traceparent` header
carries the trace on to that service.

Off unless asked for, by the standard OTEL_* variables or the `[telemetry]` table (`settings`:
the environment wins): then nothing of OpenTelemetry is imported, and each hook of the hot
path is one boolean check (`Tracing.on`). On, it needs the `otel` extra.

A proposal's trace: one published or requested with a `traceparent` header continues the
caller's trace (the header is read where the message comes in: `incoming`), one without gets
its own, begun by the span of its registration. The context is kept beside the proposal's
record in memory (`ChainRecords.trace_of`), never on its audit chain, so later stages in this
process (its outcome, a learn-back signal, an approval minutes later) join it; after a restart
the first span begins a new trace, found by its `improved.proposal_id`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from improved.client.config import TelemetrySettings
from improved.client.connection import ConfigError
from improved.core.record import ProposalRecord
from improved.protocol import tracecontext
from improved.protocol.model import Trailer
from improved.protocol.tracecontext import TRACEPARENT, TraceParent

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Link, Span, Tracer

# The `traceparent` header of the message the running job came in with (unparsed), set by
# the inbound consumer and the request handlers, only while tracing is on.
incoming: ContextVar[str | None] = ContextVar("improved_traceparent", default=None)

PROTOCOLS = ("http/protobuf", "grpc")
EXPORTERS = ("otlp", "console")
ROLLBACK_VERDICTS = ("rollback", "rolled_back", "rollback_failed")


@dataclass(frozen=True)
class TraceSettings:
    """What the daemon's traces are made with. None where the SDK reads the variable itself
    (the endpoint, the service name, the sampler): the environment wins over the table."""

    exporters: tuple[str, ...]
    protocol: str
    endpoint: str | None
    service_name: str | None
    sampler: str | None
    sampler_arg: float


def _env(environ: Mapping[str, str], *names: str) -> str | None:
    """The first of `names` the environment sets to something (OTEL_* empty means unset)."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def settings(table: TelemetrySettings, environ: Mapping[str, str]) -> TraceSettings | None:
    """Whether and how the daemon traces, from the `[telemetry]` table and the environment
    (which wins); None when it does not: OTEL_SDK_DISABLED=true, OTEL_TRACES_EXPORTER=none,
    or neither an endpoint (OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, `endpoint`) nor an exporter
    (OTEL_TRACES_EXPORTER) asked for. ConfigError, one line, for a value it cannot use."""
    if (_env(environ, "OTEL_SDK_DISABLED") or "").lower() == "true":
        return None
    named = _env(environ, "OTEL_TRACES_EXPORTER")
    env_endpoint = _env(environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                        "OTEL_EXPORTER_OTLP_ENDPOINT")
    if named is None and env_endpoint is None and table.endpoint is None:
        return None
    exporters = tuple(e.strip().lower() for e in (named or "otlp").split(",") if e.strip())
    if "none" in exporters:
        return None
    unknown = [e for e in exporters if e not in EXPORTERS]
    if unknown:
        raise ConfigError(f"OTEL_TRACES_EXPORTER: expected otlp, console or none, got "
                          f"{unknown[0]!r}")
    protocol = _env(environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                    "OTEL_EXPORTER_OTLP_PROTOCOL") or table.protocol
    if protocol not in PROTOCOLS:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL: expected http/protobuf or grpc, got "
                          f"{protocol!r}")
    endpoint = None  # the exporter reads the variables itself (adding /v1/traces over HTTP)
    if env_endpoint is None and table.endpoint is not None:
        endpoint = table.endpoint.rstrip("/") + ("/v1/traces" if protocol != "grpc" else "")
    named_service = _env(environ, "OTEL_SERVICE_NAME") or (
        "service.name=" in environ.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    return TraceSettings(
        exporters=exporters, protocol=protocol, endpoint=endpoint,
        service_name=None if named_service else table.service_name,
        sampler=None if _env(environ, "OTEL_TRACES_SAMPLER") else table.sampler,
        sampler_arg=table.sampler_arg)


def traceparent_of(span: Span) -> str:
    """A span's context as a `traceparent` value."""
    ctx = span.get_span_context()
    return tracecontext.format_traceparent(
        TraceParent(f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", int(ctx.trace_flags)))


def stage_span_name(trailer: Trailer) -> str:
    """`improved.<stage>` of a transition; an operator's rollback and its outcome are
    `improved.rollback`."""
    if trailer.to_stage == "apply" and trailer.verdict in ROLLBACK_VERDICTS:
        return "improved.rollback"
    return f"improved.{trailer.to_stage}"


class Tracing:
    """The daemon's spans, or (`Tracing()`, `on` false) none: every hook then returns at its
    first check. `trace_of`/`keep_trace`: where each proposal's context is kept (the
    engine's records)."""

    on = False

    def __init__(self, tracer: Tracer | None = None, provider: TracerProvider | None = None):
        self._tracer = tracer
        self._provider = provider
        self.on = tracer is not None
        self.trace_of: Callable[[str], str | None] = lambda pid: None
        self.keep_trace: Callable[[str, str], None] = lambda pid, traceparent: None

    def shutdown(self) -> None:
        """Export what is still buffered and stop (at the daemon's stop)."""
        if self._provider is not None:
            self._provider.shutdown()

    def _parent(self, pid: str) -> tuple[Context | None, list[Link], bool]:
        """The context a span of `pid` continues — its kept one, else the incoming message's
        (then kept), else none: a new trace — the incoming one as a link when it is another
        trace, and whether the span's own context is to be kept (it begins the trace)."""
        from opentelemetry import trace
        from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, TraceFlags

        kept = tracecontext.parse(self.trace_of(pid))
        arrived = tracecontext.parse(incoming.get())
        links: list[Link] = []
        if kept is None and arrived is not None:
            kept = arrived
            self.keep_trace(pid, tracecontext.format_traceparent(arrived))
        elif kept is not None and arrived is not None and arrived.trace_id != kept.trace_id:
            links.append(Link(_span_context(arrived, SpanContext, TraceFlags)))
        if kept is None:
            return None, links, True
        remote = NonRecordingSpan(_span_context(kept, SpanContext, TraceFlags))
        return trace.set_span_in_context(remote), links, False

    def _started(self, name: str, record: ProposalRecord, kind: str,
                 attributes: dict[str, Any], start: int | None = None) -> Span:
        from opentelemetry.trace import SpanKind

        assert self._tracer is not None, "only called while on"
        pid = record.proposal_id
        parent, links, begins = self._parent(pid)
        attributes.update({"improved.proposal_id": pid, "improved.service": record.service,
                           "improved.class": record.gate_class})
        span = self._tracer.start_span(name, context=parent, kind=SpanKind[kind],
                                       attributes=attributes, links=links, start_time=start)
        if begins:
            self.keep_trace(pid, traceparent_of(span))
        return span

    def transition(self, record: ProposalRecord, trailer: Trailer, start: int,
                   end: int) -> None:
        """The span of one committed transition, from `start` to `end` (ns since the epoch:
        from what came before it in the pass to its decision)."""
        attributes: dict[str, Any] = {"improved.stage": trailer.to_stage}
        if trailer.verdict is not None:
            attributes["improved.verdict"] = trailer.verdict
        if trailer.cause is not None:
            attributes["improved.cause"] = trailer.cause
        if trailer.to_stage != "propose" and self.trace_of(record.proposal_id) is None \
                and tracecontext.parse(incoming.get()) is None:
            attributes["improved.trace_resumed"] = True  # a restart lost the proposal's trace
        self._started(stage_span_name(trailer), record, "INTERNAL", attributes,
                      start).end(end_time=end)

    @contextmanager
    def request(self, record: ProposalRecord, subject: str) -> Iterator[dict[str, str]]:
        """A span around a request to the owning service; the headers that carry it there."""
        kind = subject.rsplit(".", 1)[-1]
        span = self._started(f"improved.{kind}.request", record, "CLIENT",
                             {"messaging.system": "nats",
                              "messaging.destination.name": subject})
        try:
            yield {TRACEPARENT: traceparent_of(span)}
        except BaseException as exc:
            from opentelemetry.trace import Status, StatusCode

            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
            span.set_attribute("error.type", type(exc).__name__)
            raise
        finally:
            span.end()

    def headers_for(self, pid: str) -> dict[str, str] | None:
        """The header carrying `pid`'s trace onto a message the daemon publishes for it (a
        rollback it proposes), or None."""
        kept = self.trace_of(pid) if self.on else None
        return {TRACEPARENT: kept} if kept is not None else None


def _span_context(parent: TraceParent, span_context: Any, flags: Any) -> Any:
    return span_context(trace_id=int(parent.trace_id, 16), span_id=int(parent.span_id, 16),
                        is_remote=True, trace_flags=flags(parent.flags))


def start(table: TelemetrySettings, environ: Mapping[str, str]) -> Tracing:
    """The daemon's tracing as `settings` says: off (nothing imported), or a tracer provider
    of its own exporting in batches (OTEL_BSP_* tune them). ConfigError when traces are asked
    for without the `otel` extra, or with a value that cannot be used."""
    chosen = settings(table, environ)
    if chosen is None:
        return Tracing()
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ConfigError("traces are configured ([telemetry] or OTEL_*) but OpenTelemetry is "
                          "not installed: pip install 'improved[otel]'") from None
    resource = Resource.create({"service.name": chosen.service_name}
                               if chosen.service_name else {})
    provider = TracerProvider(resource=resource, sampler=_sampler(chosen))
    for exporter in chosen.exporters:
        provider.add_span_processor(BatchSpanProcessor(_exporter(exporter, chosen)))
    return Tracing(provider.get_tracer("improved"), provider)


def _sampler(chosen: TraceSettings) -> Any:
    """The table's sampler, or None: the SDK's own (OTEL_TRACES_SAMPLER, else parent-based
    always on)."""
    from opentelemetry.sdk.trace import sampling

    if chosen.sampler is None:
        return None
    inner = {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
             "traceidratio": sampling.TraceIdRatioBased(chosen.sampler_arg)}
    name = chosen.sampler.removeprefix("parentbased_")
    return sampling.ParentBased(inner[name]) if chosen.sampler.startswith("parentbased_") \
        else inner[name]


def _exporter(name: str, chosen: TraceSettings) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if chosen.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=chosen.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=chosen.endpoint)
