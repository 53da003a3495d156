"""Active learn-back through the bus (issue 19 item 5): at `metric_snapshot.review_after` the
daemon asks the owning service (`<svc>.improve.measure`) to run the snapshot's query, and
records held, regressed (which proposes the recorded rollback) or unmeasured — never held for
a service that could not answer."""

from __future__ import annotations

import asyncio
import time

import pytest

from improved.client.sdk import MeshClient
from improved.protocol import subjects as S
from improved.protocol.model import ApplyResult, MeasureRequest, MetricSnapshot, to_json
from improved_reference.ranking_store import RankingStore
from tests.bus import eventually, measurement, trailers, trusted_service
from tests.factories import rank_proposal, signal
from tests.keys import CHECK

pytestmark = pytest.mark.asyncio(loop_scope="session")


def later(ms: int = 300) -> int:
    return int(time.time() * 1000) + ms


def watched(svc: str, value: float = 5, baseline: float = 0.5, review_after: int | None = None,
            query: str | None = "metrics.ctr", metric: str = "ctr"):
    return rank_proposal(svc, value=value, metric_snapshot=MetricSnapshot(
        metric=metric, baseline=baseline, query=query,
        review_after=later() if review_after is None else review_after))



async def status_of(client, pid, status):
    state = await client.state(pid)
    return state if state is not None and state.status == status else None


async def plain_applier(order) -> ApplyResult:
    """An owning service that applies rank changes and measures nothing."""
    key = order.proposal.proposal_data["set"]["key"]
    return ApplyResult(ok=True, applied_id=f"x:{key}", inverse={"delete": key},
                       rollbackable=True)


async def set_metric(store: RankingStore, key: str, value) -> None:
    kv = await store.js.key_value(store.values_bucket)
    await kv.put(key, to_json(value))


class CountingStore(RankingStore):
    """The reference store, counting the measure requests it answers."""

    def __init__(self, nc, svc: str):
        super().__init__(nc, svc)
        self.asked: list[MeasureRequest] = []

    async def measure(self, request: MeasureRequest) -> float:
        self.asked.append(request)
        return await super().measure(request)


async def test_a_value_within_the_baseline_holds_and_is_measured_once(daemon, nc, svc):
    store = CountingStore(nc, svc)
    store.use_key(await trusted_service(daemon, svc))  # its answers are its own
    await store.start()
    await set_metric(store, "metrics.ctr", 0.49)  # within 5 % of 0.5
    client = MeshClient(nc, svc)
    pid = (await client.propose(watched(svc))).proposal_id
    trailer = await measurement(daemon, svc, pid)
    assert trailer["verdict"] == "held"
    assert {"metric:ctr", "value:0.49", "baseline:0.5", "query:metrics.ctr",
            f"measured_by:asked {svc}"} <= set(trailer["refs"])
    assert [(r.proposal_id, r.metric, r.query) for r in store.asked] \
        == [(pid, "ctr", "metrics.ctr")]
    learn = await eventually(lambda: client.learn_back(pid))
    assert (learn.measured, learn.value, learn.metric, learn.baseline) == \
        ("held", 0.49, "ctr", 0.5)
    assert (await client.state(pid)).status == "applied"

    # a redelivered pass (a replica, a restart, `retry`) finds the verdict on the chain
    await daemon.engine.advance(svc, pid)
    await asyncio.sleep(0.3)
    chain = await trailers(daemon, svc, pid)
    assert [t.get("verdict") for t in chain].count("held") == 1 and len(store.asked) == 1
    await store.stop()


async def test_a_regressed_value_proposes_the_recorded_rollback(daemon, nc, svc):
    store = RankingStore(nc, svc)
    store.use_key(await trusted_service(daemon, svc))
    await store.start()
    client = MeshClient(nc, svc)
    base = (await client.propose(rank_proposal(svc, value=1))).proposal_id
    await eventually(lambda: status_of(client, base, "applied"))
    await set_metric(store, "metrics.ctr", 0.3)  # 40 % below the baseline
    pid = (await client.propose(watched(svc, value=5, review_after=later(800)))).proposal_id
    await eventually(lambda: status_of(client, pid, "applied"))
    # a signed reading that looks fine is evidence, not the measurement: the service is asked
    await client.refine(signal(svc, CHECK[0], kind="metric", name="ctr", value=0.6,
                               proposal_id=pid), key=CHECK[1])
    trailer = await measurement(daemon, svc, pid)
    assert trailer["verdict"] == "regressed" and "value:0.3" in trailer["refs"]
    assert any(r.startswith("rollback_proposal:") for r in trailer["refs"])
    await eventually(lambda: status_of(client, pid, "rolled_back"), timeout=15)
    assert await store.value("search.title_boost") == 1  # the prior content is back
    learn = await client.learn_back(pid)
    assert learn is not None and (learn.measured, learn.value) == ("regressed", 0.3)
    await store.stop()


async def test_a_service_that_serves_no_measurement_is_unmeasured_never_held(daemon, nc, svc):
    client = MeshClient(nc, svc)
    sub = await client.serve_apply(plain_applier)
    pid = (await client.propose(watched(svc))).proposal_id
    trailer = await measurement(daemon, svc, pid)
    assert trailer["verdict"] == "unmeasured"
    assert f"cause:no service answers {S.measure_request(svc)}" in trailer["refs"]
    assert not any(r.startswith("value:") for r in trailer["refs"])
    learn = await eventually(lambda: client.learn_back(pid))
    assert learn.measured == "unmeasured" and learn.value is None
    state = await client.state(pid)
    assert state.status == "applied"  # nothing is rolled back on what nobody measured
    await sub.unsubscribe()


@pytest.mark.parametrize(("reply", "cause"), [
    (b'{"value": "high"}', "malformed reply"),
    (b'{"value": 0.5, "unit": "%"}', "malformed reply"),
    (b"not json", "malformed reply"),
    (b'{"error": {"code": "unmeasurable", "message": "no such metric"}}',
     "could not measure: no such metric"),
])
async def test_a_bad_reply_is_unmeasured_with_its_cause(daemon, nc, svc, reply, cause):
    client = MeshClient(nc, svc)
    sub = await client.serve_apply(plain_applier)

    async def answer(msg):
        await msg.respond(reply)

    bad = await nc.subscribe(S.measure_request(svc), cb=answer)
    pid = (await client.propose(watched(svc))).proposal_id
    trailer = await measurement(daemon, svc, pid)
    assert trailer["verdict"] == "unmeasured"
    assert any(r.startswith("cause:") and cause in r for r in trailer["refs"]), trailer["refs"]
    assert (await client.state(pid)).status == "applied"
    await bad.unsubscribe()
    await sub.unsubscribe()


async def test_the_reference_store_refuses_what_it_cannot_measure(daemon, nc, svc):
    store = RankingStore(nc, svc)
    await store.start()
    await set_metric(store, "metrics.label", "fast")
    client = MeshClient(nc, svc)
    missing = (await client.propose(watched(svc, query="metrics.nothing"))).proposal_id
    trailer = await measurement(daemon, svc, missing)
    assert trailer["verdict"] == "unmeasured"
    assert any("no value under 'metrics.nothing'" in r for r in trailer["refs"])
    text = (await client.propose(watched(svc, value=6, query="metrics.label"))).proposal_id
    trailer = await measurement(daemon, svc, text)
    assert trailer["verdict"] == "unmeasured" and any("not a number" in r
                                                       for r in trailer["refs"])
    await store.stop()


async def test_a_restart_remembers_the_measurements_still_due(daemon, nc, svc):
    """What wakes a measurement is the measurement index, `improve.due.<svc>.<id>`, written
    with the apply and replaced by a tombstone with the verdict: a restart reads it (a new
    process remembers no record), so a proposal applied long ago is still measured at its
    review_after."""
    store = RankingStore(nc, svc)
    store.use_key(await trusted_service(daemon, svc))
    await store.start()
    await set_metric(store, "metrics.ctr", 0.5)
    client = MeshClient(nc, svc)
    due_at = later(1500)
    pid = (await client.propose(watched(svc, review_after=due_at))).proposal_id
    await eventually(lambda: status_of(client, pid, "applied"))
    assert pid in daemon.engine.reviews

    async def indexed():
        return [e for e in await daemon.store.read_due() if e.proposal_id == pid]

    [entry] = await eventually(indexed)
    assert (entry.service, entry.review_after) == (svc, due_at)
    # as a new process would start, long after the apply: nothing remembered
    daemon.engine.reviews.clear()
    daemon.engine.records.cache.pop(pid, None)
    await daemon.index_checks.find_reviews()  # what start-up runs after ready
    assert daemon.engine.reviews[pid] == (due_at, svc)
    assert (await measurement(daemon, svc, pid))["verdict"] == "held"
    assert pid not in daemon.engine.reviews
    await eventually(lambda: _gone(daemon, pid))  # the verdict took it out of the index
    await store.stop()


async def _gone(daemon, pid) -> bool:
    return pid not in {e.proposal_id for e in await daemon.store.read_due()}


async def test_a_forged_due_entry_only_makes_a_pass_that_finds_nothing_to_measure(
        daemon, nc, svc):
    """Anyone who may publish on the records stream could write an entry: it wakes a pass,
    which decides from the chain — a proposal that is not applied is not measured."""
    from improved.protocol.model import MeasureDue

    client = MeshClient(nc, svc)
    gated = rank_proposal(svc, value=9, change_class="L2", metric_snapshot=MetricSnapshot(
        metric="ctr", baseline=0.5, query="metrics.ctr", review_after=later(0)))
    pid = (await client.propose(gated)).proposal_id
    assert (await client.triage(pid)).cause == "awaiting_operator"
    await nc.jetstream().publish(S.due_entry(svc, pid), to_json(MeasureDue(
        proposal_id=pid, service=svc, review_after=later(0))), stream=S.STREAM_RECORDS)
    daemon.engine.reviews.pop(pid, None)
    await daemon.index_checks.find_reviews()
    await asyncio.sleep(1.0)
    assert not [t for t in await trailers(daemon, svc, pid)
                if t.get("to_stage") == "learn-back"]
    assert (await client.state(pid)).status == "pending"
