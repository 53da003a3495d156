"""OpenTelemetry traces through the loop, end to end: a daemon of the test's own (`improved run`
as a process, configured by the OTEL_* variables only) exports OTLP over HTTP/protobuf to a
receiver of the test's own, which decodes each `ExportTraceServiceRequest` as a collector
would. A proposal published with a `traceparent` continues the caller's trace through
propose, triage and apply, and the ApplyOrder carries it on to the owning service; one
without gets a trace of its own. (The session daemon runs without telemetry.)
"""

from __future__ import annotations

import secrets
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from improved.client import connection, tracing
from improved.client.sdk import MeshClient
from improved.protocol.model import ApplyResult
from improved.runtime import bus
from tests.bus import eventually
from tests.cli import ENV, IMPROVED
from tests.factories import rank_proposal, signal
from tests.harness import DaemonProcess, write_config

SERVICE_NAME = "improved-under-test"


class Receiver:
    """An OTLP/HTTP trace receiver on a free port: every span exported to it, decoded, with
    its resource's service.name."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        received = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    resource = {a.key: a.value.string_value
                                for a in resource_spans.resource.attributes}
                    for scope in resource_spans.scope_spans:
                        received.extend(decoded(span, resource) for span in scope.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", bus.free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of(self, **attributes: str) -> list[dict]:
        return [s for s in self.spans
                if all(s["attributes"].get(k) == v for k, v in attributes.items())]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def decoded(span, resource: dict[str, str]) -> dict:
    def value(v):
        kind = v.WhichOneof("value")
        return getattr(v, kind) if kind else None

    return {"name": span.name, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
            "parent_span_id": span.parent_span_id.hex(), "service": resource.get("service.name"),
            "attributes": {a.key: value(a.value) for a in span.attributes},
            "links": [link.trace_id.hex() for link in span.links]}


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def traced_daemon(own_server, tmp_path, receiver, monkeypatch):
    """`improved run` on the test's own server, exporting its traces to `receiver`."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_SERVICE_NAME", SERVICE_NAME)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms: spans arrive within the test
    daemon = DaemonProcess(own_server.url, tmp_path / "daemon.log",
                           write_config(tmp_path / "improved.toml"))
    daemon.start()
    yield daemon
    daemon.stop()


async def test_a_proposal_with_traceparent_is_one_trace_on_to_the_owning_service(
        own_server, traced_daemon, receiver, svc):
    await traced_daemon.ready()
    nc = await connection.connect(own_server.url, "traces")
    seen: list[str | None] = []

    async def apply(order) -> ApplyResult:
        seen.append(tracing.received())  # the ApplyOrder's traceparent header
        return ApplyResult(ok=True, applied_id=order.proposal_id)

    client = MeshClient(nc, svc)
    await client.serve_apply(apply)
    trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
    pid = await client.publish(rank_proposal(svc), traceparent=f"00-{trace_id}-{caller}-01")

    async def applied():
        stages = {s["name"] for s in receiver.of(**{"improved.proposal_id": pid})}
        return stages >= {"improved.propose", "improved.triage", "improved.apply",
                          "improved.apply.request"} and \
            any(s["attributes"].get("improved.verdict") == "applied"
                for s in receiver.of(**{"improved.proposal_id": pid}))

    await eventually(applied, timeout=30, what="the proposal's spans exported")
    spans = receiver.of(**{"improved.proposal_id": pid})
    assert {s["trace_id"] for s in spans} == {trace_id}, "one trace: the caller's"
    assert {s["service"] for s in spans} == {SERVICE_NAME}
    for span in spans:
        assert span["attributes"]["improved.service"] == svc
        assert span["attributes"]["improved.class"] == "L0"
        assert span["parent_span_id"] == caller, f"{span['name']} is under the caller's span"
    verdicts = {(s["name"], s["attributes"].get("improved.verdict")) for s in spans}
    assert {("improved.triage", "accept"), ("improved.apply", "dispatched"),
            ("improved.apply", "applied")} <= verdicts
    # the ApplyOrder carried the trace to the owning service, in the span of its request
    request = next(s for s in spans if s["name"] == "improved.apply.request")
    assert seen and seen[-1] == f"00-{trace_id}-{request['span_id']}-01"

    # a learn-back signal later, in a trace of its own, joins the proposal's trace and links
    # to its sender's
    other = secrets.token_hex(16)
    await client.signal(signal(svc, "agent:ops", proposal_id=pid),
                        traceparent=f"00-{other}-{secrets.token_hex(8)}-01")
    learnt = await eventually(lambda: _first(receiver.of(**{"improved.proposal_id": pid}),
                                             "improved.learn-back"), timeout=30,
                              what="the learn-back span")
    assert (learnt["trace_id"], learnt["parent_span_id"]) == (trace_id, caller)
    assert learnt["attributes"]["improved.verdict"] == "signal"
    assert learnt["links"] == [other]
    await connection.close(nc)


async def _first(spans: list[dict], name: str) -> dict | None:
    return next((s for s in spans if s["name"] == name), None)


async def test_a_proposal_without_traceparent_gets_a_trace_of_its_own(
        own_server, traced_daemon, receiver, svc):
    await traced_daemon.ready()
    nc = await connection.connect(own_server.url, "traces")
    seen: list[str | None] = []

    async def apply(order) -> ApplyResult:
        seen.append(tracing.received())
        return ApplyResult(ok=True, applied_id=order.proposal_id)

    client = MeshClient(nc, svc)
    await client.serve_apply(apply)
    pid = (await client.propose(rank_proposal(svc, key="untraced"))).proposal_id

    async def applied():
        return any(s["attributes"].get("improved.verdict") == "applied"
                   for s in receiver.of(**{"improved.proposal_id": pid}))

    await eventually(applied, timeout=30, what="the proposal's apply span exported")
    spans = receiver.of(**{"improved.proposal_id": pid})
    root = next(s for s in spans if s["name"] == "improved.propose")
    assert root["parent_span_id"] == "", "its registration begins the trace"
    assert {s["trace_id"] for s in spans} == {root["trace_id"]}
    assert all(s["parent_span_id"] == root["span_id"] for s in spans if s is not root)
    assert seen and seen[-1] is not None and root["trace_id"] in seen[-1]
    await connection.close(nc)


def test_traces_asked_for_in_a_form_the_daemon_cannot_use_stop_the_start_in_one_line(
        nats_url, tmp_path):
    env = {**ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    out = subprocess.run([*IMPROVED, "run", "--nats", nats_url, "--data-dir",
                          str(tmp_path / "data")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "improved: OTEL_EXPORTER_OTLP_PROTOCOL: expected http/protobuf or grpc, got "
        "'http/json'"]
    assert not (tmp_path / "data" / "checkpoint.pem").exists(), "nothing started"


@pytest.mark.asyncio(loop_scope="session")
async def test_an_asynchronous_report_carries_the_callers_trace_and_refuses_a_bad_one(
        daemon, nc, svc):
    """`MeshClient.report`, like `signal`, sends the caller's `traceparent` with the
    ApplyReport (the daemon's consumer reads it, as for a proposal), and refuses a malformed
    one before anything is published."""
    from improved.client.sdk import ImproveError
    from improved.protocol import subjects as S
    from improved.protocol.model import ApplyReport

    seen: list = []

    async def noted(msg) -> None:
        seen.append(msg)

    sub = await nc.subscribe(S.inbound_applied(svc), cb=noted)
    await nc.flush()
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    client = MeshClient(nc, svc)
    report = ApplyReport(proposal_id="a" * 64, service=svc, ok=True, applied_id="x")
    with pytest.raises(ImproveError) as refused:
        await client.report(report, traceparent="00-nope")
    assert refused.value.field == "traceparent"
    await client.report(report, traceparent=good)
    await eventually(lambda: _true(bool(seen)), 5, what="the report on its subject")
    assert [msg.headers.get(tracing.TRACEPARENT) for msg in seen] == [good]
    await sub.unsubscribe()


async def _true(value: bool) -> bool:
    return value
