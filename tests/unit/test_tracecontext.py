"""The W3C `traceparent` a proposal, a signal, an ApplyOrder or a measure request may carry:
what the specification calls valid is read, everything else is no trace context (ignored,
never an error); and when the daemon traces, from `[telemetry]` and the OTEL_* variables."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from improved.client import tracing
from improved.client.config import TelemetrySettings
from improved.client.connection import ConfigError
from improved.client.sdk import ImproveError, traced
from improved.protocol.tracecontext import (
    TRACEPARENT,
    TraceParent,
    format_traceparent,
    of_headers,
    parse,
)
from improved.runtime import telemetry

HEX = "0123456789abcdef"
trace_ids = st.text(HEX, min_size=32, max_size=32).filter(lambda s: s != "0" * 32)
span_ids = st.text(HEX, min_size=16, max_size=16).filter(lambda s: s != "0" * 16)
flags = st.integers(0, 255)


@given(trace_ids, span_ids, flags)
def test_a_version_00_traceparent_reads_back_what_it_says(trace_id, span_id, flag):
    header = f"00-{trace_id}-{span_id}-{flag:02x}"
    assert parse(header) == TraceParent(trace_id, span_id, flag)
    assert format_traceparent(parse(header)) == header
    assert parse(header).sampled == bool(flag & 1)


@given(st.integers(1, 254), trace_ids, span_ids, flags, st.text(max_size=40))
def test_a_later_version_is_read_by_its_first_four_fields(version, trace_id, span_id, flag,
                                                          more):
    header = f"{version:02x}-{trace_id}-{span_id}-{flag:02x}"
    assert parse(header) == TraceParent(trace_id, span_id, flag)
    assert parse(f"{header}-{more}") == TraceParent(trace_id, span_id, flag)


@pytest.mark.parametrize("header", [
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero span id
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff is invalid
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",  # 00 has nothing after
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # uppercase
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # 31 hex trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-01",  # 15 hex span id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",  # one-digit flags
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",  # not hex
    "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
    "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",  # a later version: `-` next
    "", "00", "traceparent", "00-" + "a" * 600,
])
def test_what_the_specification_calls_invalid_is_no_trace_context(header):
    assert parse(header) is None


@given(st.one_of(st.text(max_size=200), st.binary(max_size=80), st.none(), st.integers(),
                 st.lists(st.text(max_size=5), max_size=3)))
def test_any_header_value_parses_or_is_ignored_never_a_crash(value):
    found = parse(value)
    assert found is None or (len(found.trace_id) == 32 and len(found.span_id) == 16)


def test_a_message_costs_one_header_read():
    assert of_headers(None) is None and of_headers({}) is None
    assert of_headers({TRACEPARENT: "junk"}) == "junk"  # read, not parsed: parsed only traced


def test_an_explicit_traceparent_goes_on_and_a_bad_one_is_refused_before_sending():
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert traced(good) == {TRACEPARENT: good}
    with pytest.raises(ImproveError) as refused:
        traced("00-nope")
    assert refused.value.code == "invalid_value" and refused.value.field == "traceparent"


def test_without_the_api_loaded_nothing_is_sent_and_a_handler_costs_nothing(monkeypatch):
    monkeypatch.setattr(tracing, "_api", lambda: None)
    assert traced(None) is None
    with tracing.handling("apply", "s.improve.apply", None):
        assert tracing.received() is None
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with tracing.handling("apply", "s.improve.apply", {TRACEPARENT: good}):
        assert tracing.received() == good
    with tracing.handling("apply", "s.improve.apply", {TRACEPARENT: "bad"}):
        assert tracing.received() is None
    assert tracing.received() is None


# -- when the daemon traces ----------------------------------------------------------------------

OFF = TelemetrySettings()
TABLE = TelemetrySettings(endpoint="http://collector:4318/", service_name="mesh-a",
                          sampler="traceidratio", sampler_arg=0.25)


def test_absent_both_the_table_and_the_variables_nothing_is_traced():
    assert telemetry.settings(OFF, {}) is None
    assert telemetry.start(OFF, {}).on is False
    assert telemetry.settings(OFF, {"OTEL_EXPORTER_OTLP_ENDPOINT": ""}) is None


def test_the_table_alone_traces_to_its_endpoint():
    chosen = telemetry.settings(TABLE, {})
    assert chosen == telemetry.TraceSettings(
        exporters=("otlp",), protocol="http/protobuf", endpoint="http://collector:4318/v1/traces",
        service_name="mesh-a", sampler="traceidratio", sampler_arg=0.25)


def test_the_variables_win_over_the_table():
    chosen = telemetry.settings(TABLE, {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "from-env", "OTEL_TRACES_SAMPLER": "always_on"})
    # None: the SDK reads the variable itself
    assert chosen is not None and chosen.protocol == "grpc" and chosen.endpoint is None
    assert chosen.service_name is None and chosen.sampler is None
    assert telemetry.settings(OFF, {"OTEL_TRACES_EXPORTER": "console"}).exporters == ("console",)


@pytest.mark.parametrize("environ", [{"OTEL_SDK_DISABLED": "true"},
                                     {"OTEL_SDK_DISABLED": "TRUE"},
                                     {"OTEL_TRACES_EXPORTER": "none"}])
def test_the_sdk_switches_turn_traces_off_whatever_the_table_says(environ):
    assert telemetry.settings(TABLE, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318",
                                      **environ}) is None


@pytest.mark.parametrize(("environ", "named"), [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
])
def test_a_value_the_daemon_cannot_use_is_one_line_naming_the_variable(environ, named):
    with pytest.raises(ConfigError) as refused:
        telemetry.settings(TABLE, environ)
    assert str(refused.value).startswith(named) and "\n" not in str(refused.value)


def test_with_the_api_loaded_the_current_span_goes_on_and_a_handler_continues_the_order():
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    caller = TracerProvider().get_tracer("caller")  # a provider of its own: nothing global
    with caller.start_as_current_span("caller") as span:
        ctx = span.get_span_context()
        assert traced(None) == {
            TRACEPARENT: f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"}
    assert traced(None) is None  # no span current: nothing to send
    order = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with tracing.handling("apply", "s.improve.apply", {TRACEPARENT: order}):
        inside = trace.get_current_span().get_span_context()
        assert f"{inside.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"
        assert tracing.received() == order
