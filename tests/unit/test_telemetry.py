"""The daemon's spans, against the OpenTelemetry SDK's in-memory exporter: which trace each
transition and request of a proposal joins (the caller's, the registration's own, a new one
after a restart), and that a daemon not asked to trace loads nothing of OpenTelemetry."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from improved.core import propose
from improved.core.audit import seal
from improved.core.policy import Policy
from improved.protocol.tracecontext import TRACEPARENT, parse
from improved.runtime import telemetry
from tests.builders import NOW, make_proposal

CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def traced() -> tuple[telemetry.Tracing, InMemorySpanExporter, dict[str, str]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = telemetry.Tracing(provider.get_tracer("test"), provider)
    kept: dict[str, str] = {}
    tracing.trace_of, tracing.keep_trace = kept.get, kept.__setitem__
    return tracing, exporter, kept


def registered():
    proposal = make_proposal()
    pid, dedup = propose.identify(proposal)
    record, draft = propose.register(proposal, pid, dedup, Policy(), NOW)
    return record, seal(draft, record, NOW)


def triaged(record):
    return msgspec.structs.replace(seal(propose.register(
        record.proposal, record.proposal_id, record.dedup_key, Policy(), NOW)[1], record, NOW),
        to_stage="triage", from_stage="propose", verdict="defer", cause="awaiting_operator")


def test_a_registration_without_traceparent_begins_the_trace_its_later_stages_join():
    tracing, exporter, kept = traced()
    record, registration = registered()
    tracing.transition(record, registration, 1, 2)
    tracing.transition(record, triaged(record), 2, 3)
    root, triage = exporter.get_finished_spans()
    assert root.parent is None and root.name == "improved.propose"
    assert parse(kept[record.proposal_id]).span_id == f"{root.context.span_id:016x}"
    assert triage.parent.span_id == root.context.span_id
    assert triage.context.trace_id == root.context.trace_id
    assert dict(triage.attributes).items() >= {"improved.proposal_id": record.proposal_id,
                                       "improved.service": "svc", "improved.class": "L2",
                                       "improved.verdict": "defer",
                                       "improved.cause": "awaiting_operator"}.items()
    assert (triage.start_time, triage.end_time) == (2, 3)


def test_an_incoming_traceparent_is_the_parent_and_the_request_carries_the_trace_on():
    tracing, exporter, kept = traced()
    record, registration = registered()
    token = telemetry.incoming.set(CALLER)
    try:
        tracing.transition(record, registration, 1, 2)
    finally:
        telemetry.incoming.reset(token)
    assert kept[record.proposal_id] == CALLER
    with tracing.request(record, "svc.improve.apply") as headers:
        pass
    propose_span, request = exporter.get_finished_spans()
    for span in (propose_span, request):
        assert f"{span.context.trace_id:032x}" == parse(CALLER).trace_id
        assert f"{span.parent.span_id:016x}" == parse(CALLER).span_id
    assert request.name == "improved.apply.request"
    assert parse(headers[TRACEPARENT]).span_id == f"{request.context.span_id:016x}"
    assert tracing.headers_for(record.proposal_id) == {TRACEPARENT: CALLER}


def test_after_a_restart_a_later_stage_begins_a_new_trace_marked_resumed():
    tracing, exporter, kept = traced()
    record, _ = registered()
    tracing.transition(record, triaged(record), 2, 3)
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.attributes["improved.trace_resumed"] is True
    assert span.attributes["improved.proposal_id"] == record.proposal_id
    assert record.proposal_id in kept  # what follows in this process joins that trace


def test_a_bad_incoming_header_is_ignored():
    tracing, exporter, _ = traced()
    record, registration = registered()
    token = telemetry.incoming.set("00-not-a-trace")
    try:
        tracing.transition(record, registration, 1, 2)
    finally:
        telemetry.incoming.reset(token)
    (span,) = exporter.get_finished_spans()
    assert span.parent is None


def test_a_daemon_not_asked_to_trace_imports_nothing_of_opentelemetry():
    code = ("import os, sys\n"
            "for k in [k for k in os.environ if k.startswith('OTEL_')]: del os.environ[k]\n"
            "from improved.client.config import Config\n"
            "from improved.runtime import daemon, telemetry\n"
            "assert not telemetry.start(Config().telemetry, os.environ).on\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_traces_asked_for_without_the_otel_extra_are_one_line_naming_it():
    code = ("import sys\n"
            "sys.modules['opentelemetry.sdk'] = None  # as if the extra were not installed\n"
            "from improved.client.config import TelemetrySettings\n"
            "from improved.client.connection import ConfigError\n"
            "from improved.runtime import telemetry\n"
            "try:\n"
            "    telemetry.start(TelemetrySettings(endpoint='http://127.0.0.1:4318'), {})\n"
            "except ConfigError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().endswith("pip install 'improved[otel]'")
    assert len(out.stdout.strip().splitlines()) == 1


def test_a_request_no_service_answers_is_a_span_in_error():
    tracing, exporter, _ = traced()
    record, _ = registered()
    with pytest.raises(RuntimeError), tracing.request(record, "svc.improve.measure"):
        raise RuntimeError("no service answers svc.improve.measure")
    (span,) = exporter.get_finished_spans()
    assert span.name == "improved.measure.request"
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["error.type"] == "RuntimeError"
