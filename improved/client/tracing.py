"""A mesh service's side of the loop's traces (W3C Trace Context on NATS headers), with or
without OpenTelemetry: nothing here imports it. When the service itself has loaded the
OpenTelemetry API (`opentelemetry.trace` is imported) and a span is current, what it proposes
or signals carries that span's context as a `traceparent` header; an explicit `traceparent=`
argument does so on the base install. An ApplyOrder or a measure request from the daemon
carries the proposal's trace: the handler runs with it (`received()`), inside a span of its
own continuing it when the API is loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

from improved.protocol import tracecontext
from improved.protocol.tracecontext import TRACEPARENT

_received: ContextVar[str | None] = ContextVar("improved_received_traceparent", default=None)


class BadTraceparent(ValueError):
    """An explicit `traceparent=` argument that is no W3C traceparent."""


def _api() -> Any:
    """The OpenTelemetry trace API if the process has loaded it, else None (never imported
    here: a service that does not trace pays nothing)."""
    return sys.modules.get("opentelemetry.trace")


def current() -> str | None:
    """The current span's context as a `traceparent`, when the API is loaded and one is."""
    trace = _api()
    if trace is None:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return tracecontext.format_traceparent(tracecontext.TraceParent(
        f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", int(ctx.trace_flags)))


def outgoing(explicit: str | None = None) -> dict[str, str] | None:
    """The headers that carry the caller's trace onto a message: `explicit` (BadTraceparent
    when it is not one), else the current span's, else None."""
    if explicit is not None:
        if tracecontext.parse(explicit) is None:
            raise BadTraceparent(f"traceparent {explicit[:80]!r} is not a W3C traceparent "
                                 "(00-<32 hex trace id>-<16 hex span id>-<2 hex flags>)")
        return {TRACEPARENT: explicit}
    found = current()
    return {TRACEPARENT: found} if found is not None else None


def received() -> str | None:
    """The `traceparent` the order or measure request being handled came with (valid), or
    None: for a handler to log or pass on without OpenTelemetry."""
    return _received.get()


def handling(kind: str, subject: str,
             headers: dict[str, str] | None) -> AbstractContextManager[None]:
    """Around a handler of the daemon's request: the incoming trace made `received()`, and a
    server span continuing it when the API is loaded. Nothing to do costs a null context."""
    parent = tracecontext.parse(tracecontext.of_headers(headers))
    if parent is None and _api() is None:
        return nullcontext()
    return _handled(kind, subject, parent)


@contextmanager
def _handled(kind: str, subject: str, parent: tracecontext.TraceParent | None) -> Iterator[None]:
    token = _received.set(tracecontext.format_traceparent(parent) if parent else None)
    try:
        trace = _api()
        if trace is None:
            yield
            return
        context = None
        if parent is not None:
            context = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
                trace_id=int(parent.trace_id, 16), span_id=int(parent.span_id, 16),
                is_remote=True, trace_flags=trace.TraceFlags(parent.flags))))
        tracer = trace.get_tracer("improved.client")
        with tracer.start_as_current_span(f"improved.{kind}.handle", context=context,
                                          kind=trace.SpanKind.SERVER,
                                          attributes={"messaging.system": "nats",
                                                      "messaging.destination.name": subject}):
            yield
    finally:
        _received.reset(token)
