"""The daemon's metrics (parsed back from the exposition) and its HTTP health endpoints."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from improved.runtime.metrics import AUTONOMY_STATES, CLASSES, CONTENT_TYPE, Metrics, serve
from tests.bus import samples, value


def test_transitions_count_per_label_set_with_none_as_empty():
    m = Metrics()
    labels = {"stage": "triage", "verdict": "accept", "cause": "", "class": "L0"}
    assert value(m, "improved_transitions_total", **labels) is None
    m.transition("triage", "accept", None, "L0")
    m.transition("triage", "accept", None, "L0")
    m.transition("triage", None, "no_grant", "L3")
    assert value(m, "improved_transitions_total", **labels) == 2
    assert value(m, "improved_transitions_total", stage="triage", verdict="",
                 cause="no_grant", **{"class": "L3"}) == 1


def test_stage_histogram_buckets_span_milliseconds_to_seconds():
    m = Metrics()
    m.observe_stage("apply", 0.0005)
    m.observe_stage("apply", 0.2)
    m.observe_stage("apply", 20.0)
    assert value(m, "improved_stage_seconds_count", stage="apply") == 3
    assert value(m, "improved_stage_seconds_sum", stage="apply") == pytest.approx(20.2005)
    assert value(m, "improved_stage_seconds_bucket", stage="apply", le="0.001") == 1
    assert value(m, "improved_stage_seconds_bucket", stage="apply", le="0.25") == 2
    assert value(m, "improved_stage_seconds_bucket", stage="apply", le="30.0") == 3
    assert value(m, "improved_stage_seconds_bucket", stage="apply", le="+Inf") == 3


def test_refusals_and_apply_results_count():
    m = Metrics()
    for result in ("ok", "failed", "unreachable", "rolled_back"):
        assert value(m, "improved_applies_total", result=result) == 0  # present from the start
    m.refused("bad_signature")
    m.refused("bad_signature")
    m.refused("malformed")
    m.apply_result("ok")
    m.apply_result("rolled_back")
    m.apply_result("ok")
    assert value(m, "improved_refused_total", code="bad_signature") == 2
    assert value(m, "improved_refused_total", code="malformed") == 1
    assert value(m, "improved_applies_total", result="ok") == 2
    assert value(m, "improved_applies_total", result="rolled_back") == 1
    assert value(m, "improved_applies_total", result="failed") == 0
    with pytest.raises(ValueError):
        m.apply_result("maybe")


def test_gauges_follow_the_last_value():
    m = Metrics()
    m.set_pending_reviews(4)
    m.set_in_flight(7)
    m.set_ready(True)
    m.set_connected(True)
    assert value(m, "improved_pending_reviews") == 4
    assert value(m, "improved_in_flight") == 7
    assert value(m, "improved_ready") == 1
    assert value(m, "improved_nats_connected") == 1
    m.set_pending_reviews(0)
    m.set_in_flight(2)
    m.set_ready(False)
    m.set_connected(False)
    assert value(m, "improved_pending_reviews") == 0
    assert value(m, "improved_in_flight") == 2
    assert value(m, "improved_ready") == 0
    assert value(m, "improved_nats_connected") == 0


def autonomy(m: Metrics) -> dict[str, float]:
    return {s: value(m, "improved_autonomy", state=s) for s in AUTONOMY_STATES}


def test_autonomy_has_exactly_one_state_at_one():
    m = Metrics()
    assert autonomy(m) == {"on": 1, "circuit_open": 0, "autonomy_off": 0}
    for state in ("circuit_open", "autonomy_off", "on", "autonomy_off"):
        m.set_autonomy(state)
        got = autonomy(m)
        assert got[state] == 1
        assert sum(got.values()) == 1
    with pytest.raises(ValueError):
        m.set_autonomy("sideways")
    assert autonomy(m)["autonomy_off"] == 1  # a refused state changes nothing


def test_two_instances_do_not_share_a_registry():
    a, b = Metrics(), Metrics()
    a.refused("x")
    assert value(a, "improved_refused_total", code="x") == 1
    assert value(b, "improved_refused_total", code="x") is None


def test_triage_decisions_and_rollbacks_count_by_class_from_the_trailer_verdict():
    m = Metrics()
    for cls in CLASSES:  # every bounded label set present at 0, so rate() sees the first
        for verdict in ("accept", "defer", "reject"):
            assert value(m, "improved_proposals_triaged_total", verdict=verdict,
                         **{"class": cls}) == 0
        for result in ("rolled_back", "rollback_failed"):
            assert value(m, "improved_rollbacks_total", result=result, **{"class": cls}) == 0
    m.decided("accept", "L0")
    m.decided("accept", "L0")
    m.decided("defer", "L2")
    m.decided("rolled_back", "L3")
    m.decided("rollback_failed", "L0")
    for other in ("approve", "applied", "dispatched", None):  # counted elsewhere, or nowhere
        m.decided(other, "L2")
    m.decided("accept", "L9")  # not a class: no new series
    assert value(m, "improved_proposals_triaged_total", verdict="accept", **{"class": "L0"}) == 2
    assert value(m, "improved_proposals_triaged_total", verdict="defer", **{"class": "L2"}) == 1
    assert value(m, "improved_rollbacks_total", result="rolled_back", **{"class": "L3"}) == 1
    assert value(m, "improved_rollbacks_total", result="rollback_failed",
                 **{"class": "L0"}) == 1
    series = [k for k in samples(m) if k[0] == "improved_proposals_triaged_total"]
    assert len(series) == 15


def test_apply_seconds_from_dispatch_to_answer_per_result():
    m = Metrics()
    m.observe_apply("ok", 0.02)
    m.observe_apply("ok", 45.0)  # an answer on the slow retry
    m.observe_apply("failed", 3.0)
    assert value(m, "improved_apply_seconds_count", result="ok") == 2
    assert value(m, "improved_apply_seconds_bucket", result="ok", le="0.025") == 1
    assert value(m, "improved_apply_seconds_bucket", result="ok", le="60.0") == 2
    assert value(m, "improved_apply_seconds_bucket", result="failed", le="2.5") == 0
    assert value(m, "improved_apply_seconds_bucket", result="failed", le="5.0") == 1
    assert value(m, "improved_apply_seconds_bucket", result="failed", le="3600.0") == 1


def test_queue_breaker_and_crisis_gauges():
    m = Metrics()
    assert value(m, "improved_review_oldest_waiting_timestamp_seconds") == 0
    m.set_oldest_review(1_700_000_000_500)
    assert value(m, "improved_review_oldest_waiting_timestamp_seconds") == 1_700_000_000.5
    m.set_oldest_review(None)  # the queue emptied
    assert value(m, "improved_review_oldest_waiting_timestamp_seconds") == 0
    m.set_breaker(1_700_000_172_800_000, 3, 3)
    assert value(m, "improved_breaker_paused_until_timestamp_seconds") == 1_700_000_172_800
    assert value(m, "improved_breaker_rollbacks") == 3
    assert value(m, "improved_breaker_threshold") == 3
    assert value(m, "improved_crisis_open") == 0
    m.set_crisis(True)
    assert value(m, "improved_crisis_open") == 1
    m.set_crisis(False)
    assert value(m, "improved_crisis_open") == 0


def test_a_checkpoint_that_could_not_run_leaves_the_last_verdict():
    m = Metrics()
    m.set_checkpoint_interval(300)
    assert value(m, "improved_checkpoint_interval_seconds") == 300
    assert value(m, "improved_checkpoint_verified") == 0  # before the first
    m.checkpoint("verified", 1_700_000_000_000)
    assert value(m, "improved_checkpoint_verified") == 1
    assert value(m, "improved_checkpoint_last_timestamp_seconds") == 1_700_000_000
    m.checkpoint("failed")  # an outage says nothing of the log
    assert value(m, "improved_checkpoint_verified") == 1
    m.checkpoint("broken")
    assert value(m, "improved_checkpoint_verified") == 0
    assert value(m, "improved_checkpoint_last_timestamp_seconds") == 1_700_000_000
    assert [value(m, "improved_checkpoints_total", result=r) for r in
            ("verified", "broken", "failed")] == [1, 1, 1]
    with pytest.raises(ValueError):
        m.checkpoint("maybe")


# --- HTTP ------------------------------------------------------------------------------------

async def exchange(port: int, raw: bytes, *, eof: bool = False) -> tuple[int, dict, bytes]:
    """Send raw bytes, read to EOF; the status, headers (lower-cased) and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        if eof:
            writer.write_eof()
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("ascii").split("\r\n")
    version, status, _reason = lines[0].split(" ", 2)
    assert version == "HTTP/1.1"
    headers = {}
    for line in lines[1:]:
        name, _, v = line.partition(":")
        headers[name.strip().lower()] = v.strip()
    assert int(headers["content-length"]) == len(body)
    assert headers["connection"] == "close"
    return int(status), headers, body


def get(path: str, method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nUser-Agent: test\r\n\r\n".encode()


@pytest.fixture
async def endpoint():
    state = {"ready": False, "healthy": True}
    m = Metrics()
    server = await serve(m, "127.0.0.1", 0, ready=lambda: state["ready"],
                         healthy=lambda: state["healthy"], read_timeout=1.0)
    port = server.sockets[0].getsockname()[1]
    yield m, port, state
    server.close()
    await server.wait_closed()


async def test_metrics_endpoint_serves_the_exposition(endpoint):
    m, port, _ = endpoint
    m.refused("malformed")
    m.set_autonomy("circuit_open")
    status, headers, body = await exchange(port, get("/metrics"))
    assert status == 200
    assert headers["content-type"] == CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert "improved_refused" in families
    assert 'improved_refused_total{code="malformed"} 1.0' in body.decode()
    assert 'improved_autonomy{state="circuit_open"} 1.0' in body.decode()
    status, _, _ = await exchange(port, get("/metrics?name[]=improved_ready"))
    assert status == 200  # a query string does not change the path


async def test_healthz_and_readyz_follow_the_callables(endpoint):
    _, port, state = endpoint
    assert (await exchange(port, get("/healthz")))[0::2] == (200, b"ok")
    assert (await exchange(port, get("/readyz")))[0::2] == (503, b"not ready")
    state["ready"] = True
    state["healthy"] = False
    assert (await exchange(port, get("/healthz")))[0::2] == (503, b"unhealthy")
    assert (await exchange(port, get("/readyz")))[0::2] == (200, b"ready")


async def test_a_probe_that_raises_answers_no():
    def boom() -> bool:
        raise RuntimeError("probe broke")

    server = await serve(Metrics(), "127.0.0.1", 0, ready=boom, healthy=boom)
    port = server.sockets[0].getsockname()[1]
    try:
        assert (await exchange(port, get("/healthz")))[0] == 503
        assert (await exchange(port, get("/readyz")))[0] == 503
    finally:
        server.close()
        await server.wait_closed()


async def test_unknown_path_and_other_methods(endpoint):
    _, port, _ = endpoint
    assert (await exchange(port, get("/nope")))[0] == 404
    assert (await exchange(port, get("/")))[0] == 404
    status, headers, _ = await exchange(port, get("/metrics", "POST"))
    assert status == 405
    assert headers["allow"] == "GET"
    assert (await exchange(port, get("/healthz", "DELETE")))[0] == 405
    # a body the server does not read does not cost the client its answer
    raw = b"POST /readyz HTTP/1.1\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000
    assert (await exchange(port, raw))[0] == 405


@pytest.mark.parametrize("raw", [
    b"\x00\xff\xfe garbage \x16\x03\x01\r\n\r\n",
    b"GET\r\n\r\n",
    b"GET /metrics\r\n\r\n",
    b"GET /metrics HTTP/1.1 extra\r\n\r\n",
    b"GET /metrics FTP/1.0\r\n\r\n",
    b"G(T /metrics HTTP/1.1\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nbad name: x\r\n\r\n",
    b"GET /metr\x1bics HTTP/1.1\r\n\r\n",
    b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\n" + b"X-A: b\r\n" * 200 + b"\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) * 4,
])
async def test_garbage_gets_400_and_a_closed_connection(endpoint, raw):
    _, port, _ = endpoint
    status, _, body = await exchange(port, raw, eof=True)
    assert status == 400
    assert body == b"bad request"
    # and the server still answers afterwards
    assert (await exchange(port, get("/healthz")))[0] == 200


async def test_a_truncated_request_gets_400(endpoint):
    _, port, _ = endpoint
    assert (await exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x", eof=True))[0] == 400


async def test_a_silent_client_times_out_with_408(endpoint):
    _, port, _ = endpoint
    status, _, _ = await exchange(port, b"GET /healthz HTTP/1.1\r\n")
    assert status == 408


async def test_a_client_that_disconnects_at_once_does_not_hurt(endpoint):
    _, port, _ = endpoint
    for _ in range(5):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        await writer.wait_closed()
    assert (await exchange(port, get("/healthz")))[0] == 200


async def test_many_clients_at_once(endpoint):
    m, port, state = endpoint
    state["ready"] = True
    m.set_in_flight(3)
    paths = ["/metrics", "/healthz", "/readyz", "/nope"] * 5
    # open all 20 first, so they are connected at the same time, then send
    conns = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in paths))

    async def one(conn, path):
        reader, writer = conn
        writer.write(get(path))
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return int(data.split(b" ", 2)[1]), data

    results = await asyncio.gather(*(one(c, p) for c, p in zip(conns, paths, strict=True)))
    assert [s for s, _ in results] == [200, 200, 200, 404] * 5
    for (_, data), path in zip(results, paths, strict=True):
        if path == "/metrics":
            assert b"improved_in_flight 3.0" in data
