"""Answers to the daemon's own requests, played as a hostile bus participant would on the open
embedded bus: an impostor subscribes to a service's request subject and answers first
(`<svc>.improve.measure`, `.apply`, `spec.get`), publishes reports and rollback proposals in
its name, or writes the rejection ledger. Only what is attributable to the service — signed by
the key the daemon trusts for it (core.boundary), or on subjects bound to it under accounts —
moves a decision; the rest is recorded as unattested and moves nothing."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from improved.client import connection
from improved.client.sdk import MeshClient, serve_spec
from improved.core import apply as apply_stage
from improved.core import boundary, triage
from improved.core.breaker import AUTONOMY_ID
from improved.protocol import subjects as S
from improved.protocol.model import (
    ApplyReport,
    ApplyResult,
    LedgerEntry,
    MetricSnapshot,
    to_json,
)
from improved_reference.ranking_store import RankingStore
from tests.bus import (
    daemon_config,
    eventually,
    measurement,
    own_daemon,
    refusal,
    trailers,
    trusted_service,
)
from tests.factories import rank_proposal, skill_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")


def later(ms: int = 300) -> int:
    return int(time.time() * 1000) + ms


def watched(svc: str, value: float = 5, baseline: float = 0.5, review_after: int | None = None):
    return rank_proposal(svc, value=value, metric_snapshot=MetricSnapshot(
        metric="ctr", baseline=baseline, query="metrics.ctr",
        review_after=later() if review_after is None else review_after))


async def answering(nc, subject: str, body: bytes):
    """An impostor: subscribes to `subject` (no queue group: it gets every request) and
    answers `body` at once, before any real service can."""
    async def answer(msg):
        if msg.reply:
            await msg.respond(body)

    return await nc.subscribe(subject, cb=answer)


async def set_metric(store: RankingStore, key: str, value) -> None:
    kv = await store.js.key_value(store.values_bucket)
    await kv.put(key, to_json(value))



async def status(client, pid, wanted):
    state = await client.state(pid)
    return state if state is not None and state.status == wanted else None


async def signed_store(daemon, nc, svc: str, metric: float) -> RankingStore:
    store = RankingStore(nc, svc)
    store.use_key(await trusted_service(daemon, svc))
    await store.start()
    await set_metric(store, "metrics.ctr", metric)
    return store


# -- the measurement at review_after --------------------------------------------------------------


async def test_an_impostor_answering_the_measurement_first_rolls_nothing_back(daemon, nc, svc):
    store = await signed_store(daemon, nc, svc, 0.49)  # within 5 % of the baseline: held
    impostor = await answering(nc, S.measure_request(svc), b'{"value": 0.01}')  # "regressed"
    client = MeshClient(nc, svc)
    pid = (await client.propose(watched(svc))).proposal_id
    trailer = await measurement(daemon, svc, pid)
    assert trailer["verdict"] == "held" and "value:0.49" in trailer["refs"]
    assert f"answered_by:service:{svc}" in trailer["refs"]
    assert not any(r.startswith("rollback_proposal:") for r in trailer["refs"])
    assert (await client.state(pid)).status == "applied"
    await impostor.unsubscribe()
    await store.stop()


async def test_an_impostor_cannot_hide_a_real_regression(own_server, tmp_path, svc):
    """A daemon of its own: the real regression rolls an autonomous change back, which counts
    toward the breaker, as it must (the session daemon's other tests must not meet it)."""
    async with own_daemon(own_server, tmp_path, "impostor-regression") as (nc, daemon):
        store = await signed_store(daemon, nc, svc, 0.3)  # 40 % below the baseline
        client = MeshClient(nc, svc)
        base = (await client.propose(rank_proposal(svc, value=1))).proposal_id
        await eventually(lambda: status(client, base, "applied"))
        impostor = await answering(nc, S.measure_request(svc), b'{"value": 0.5}')  # "held"
        pid = (await client.propose(watched(svc, review_after=later(800)))).proposal_id
        trailer = await measurement(daemon, svc, pid)
        assert trailer["verdict"] == "regressed" and "value:0.3" in trailer["refs"]
        assert any(r.startswith("rollback_proposal:") for r in trailer["refs"])
        await eventually(lambda: status(client, pid, "rolled_back"), timeout=15)
        await impostor.unsubscribe()
        await store.stop()


async def test_with_no_key_for_the_service_no_answer_moves_learn_back(daemon, nc, svc):
    """Nothing the service says can be told from what anyone says: the answer is recorded,
    unmeasured with why, and rolls nothing back."""
    store = RankingStore(nc, svc)  # no key: unsigned answers
    await store.start()
    impostor = await answering(nc, S.measure_request(svc), b'{"value": 0.01}')
    client = MeshClient(nc, svc)
    pid = (await client.propose(watched(svc))).proposal_id
    trailer = await measurement(daemon, svc, pid)
    assert trailer["verdict"] == "unmeasured"
    cause = next(r for r in trailer["refs"] if r.startswith("cause:"))
    assert "0.01" in cause and f"not attributable to service:{svc}" in cause, cause
    assert "answered_by:unattested" in trailer["refs"]
    await asyncio.sleep(0.5)
    assert (await client.state(pid)).status == "applied"
    await impostor.unsubscribe()
    await store.stop()


async def test_two_attested_answers_that_disagree_are_a_recorded_conflict(daemon, nc, svc):
    key = await trusted_service(daemon, svc)
    store = RankingStore(nc, svc)
    store.use_key(key)
    await store.start()
    await set_metric(store, "metrics.ctr", 0.49)
    # a second holder of the service's key (outside its queue group) says otherwise

    async def otherwise(msg):
        await msg.respond(boundary.sign_reply(b'{"value": 0.01}', msg.subject, msg.reply, key))

    impostor = await nc.subscribe(S.measure_request(svc), cb=otherwise)
    client = MeshClient(nc, svc)
    pid = (await client.propose(watched(svc))).proposal_id
    trailer = await measurement(daemon, svc, pid)
    assert trailer["verdict"] == "unmeasured" and "answered_by:conflict" in trailer["refs"]
    assert any(r.startswith("cause:attested answers disagree") for r in trailer["refs"])
    await impostor.unsubscribe()
    await store.stop()


# -- the apply and its report --------------------------------------------------------------------


async def test_where_the_service_is_known_only_its_own_apply_result_is_recorded(
        daemon, nc, svc):
    store = await signed_store(daemon, nc, svc, 0.5)
    impostor = await answering(nc, S.apply_request(svc), to_json(ApplyResult(
        ok=False, error="refused by nobody you know")))
    client = MeshClient(nc, svc)
    pid = (await client.propose(rank_proposal(svc, value=3))).proposal_id
    await eventually(lambda: status(client, pid, "applied"))
    applied = next(t for t in await trailers(daemon, svc, pid) if t.get("verdict") == "applied")
    assert f"answered_by:service:{svc}" in applied["refs"]
    assert await store.value("search.title_boost") == 3
    await impostor.unsubscribe()
    await store.stop()


async def test_a_report_in_a_known_services_name_counts_only_signed(daemon, nc, svc):
    key = await trusted_service(daemon, svc)
    client = MeshClient(nc, svc, key=key)
    js = nc.jetstream()
    # nothing serves the apply: the proposal waits for its report
    pid = (await client.propose(rank_proposal(svc, value=4))).proposal_id
    await asyncio.sleep(0.3)
    forged = ApplyReport(proposal_id=pid, service=svc, ok=True, applied_id="forged")
    await js.publish(S.inbound_applied(svc), to_json(forged), stream=S.STREAM_INBOUND)
    assert (await refusal(nc, svc, S.inbound_applied(svc)))["code"] == "not_attested"
    assert not [t for t in await trailers(daemon, svc, pid) if t.get("verdict") == "applied"]
    await client.report(ApplyReport(proposal_id=pid, service=svc, ok=True, applied_id="real"))
    await eventually(lambda: status(client, pid, "applied"))
    applied = next(t for t in await trailers(daemon, svc, pid) if t.get("verdict") == "applied")
    assert "applied:real" in applied["refs"] and f"answered_by:service:{svc}" in applied["refs"]


# -- spec.get --------------------------------------------------------------------------------------


async def test_an_impostor_saying_improve_false_first_refuses_nothing(daemon, nc, svc):
    key = await trusted_service(daemon, svc)
    real = await serve_spec(nc, svc, {"service": svc, "improve": True}, key=key)
    impostor = await answering(nc, S.service_spec(svc), b'{"service": "%s", "improve": false}'
                               % svc.encode())
    reply = await MeshClient(nc, svc).propose(skill_proposal(svc))
    assert reply.status == "pending"
    await impostor.unsubscribe()
    await real.unsubscribe()


async def test_unsigned_improve_false_on_an_open_bus_refuses_nothing(daemon, nc, svc):
    impostor = await answering(nc, S.service_spec(svc), b'{"improve": false}')
    reply = await MeshClient(nc, svc).propose(skill_proposal(svc))
    assert reply.status == "pending"
    await impostor.unsubscribe()


async def test_the_services_own_improve_false_still_refuses_and_names_only_itself(
        daemon, nc, svc):
    from improved.client.sdk import ImproveError

    key = await trusted_service(daemon, svc)
    # an attested answer that speaks of another service refuses nothing
    other = await serve_spec(nc, svc, {"service": "someone-else", "improve": False}, key=key)
    assert (await MeshClient(nc, svc).propose(skill_proposal(svc))).status == "pending"
    await other.unsubscribe()
    own = f"{svc}-own"
    key = await trusted_service(daemon, own)
    spec = await serve_spec(nc, own, key=key)  # its own omission, signed
    with pytest.raises(ImproveError) as refused:
        await MeshClient(nc, own).propose(skill_proposal(own))
    assert refused.value.code == "no_surface"
    await spec.unsubscribe()


# -- what the loop counts --------------------------------------------------------------------------


async def test_a_rollback_proposal_anyone_publishes_does_not_open_the_breaker(own_server, tmp_path):
    """The recorded inverse of an autonomous apply is readable on its chain, so anyone can
    publish the very rollback proposal learn-back would make. At an L0's class it is applied
    like any L0 — but no regression was measured, so it counts toward no breaker."""
    from improved.runtime.daemon import Daemon

    svc = "reverted"
    nc = await connection.connect(own_server.url, "impostor-rollbacks")
    daemon = Daemon(nc, msgspec.structs.replace(daemon_config(), data_dir=tmp_path / "d"))
    await daemon.start()
    store = RankingStore(nc, svc)
    await store.start()
    client = MeshClient(nc, svc)
    try:
        for n in range(3):
            pid = (await client.propose(rank_proposal(svc, value=n + 1, key=f"k{n}")))
            pid = pid.proposal_id
            await eventually(lambda pid=pid: status(client, pid, "applied"))
            record = await daemon.engine.records.rebuild(svc, pid)
            inverse = apply_stage.rollback_proposal(record)
            await client.publish(inverse)
            await eventually(lambda pid=pid: status(client, pid, "rolled_back"), timeout=15)
        chain = [b for _, b in await daemon.store.read_chain_at(S.autonomy_audit(AUTONOMY_ID))]
        assert not [b for b in chain if b.get("verdict") == "rollback"]
        assert (await daemon.engine.autonomy.state(later(10_000))).blocks(later(0)) is None
        # the mesh still applies autonomously
        last = (await client.propose(rank_proposal(svc, value=9, key="after"))).proposal_id
        await eventually(lambda: status(client, last, "applied"))
    finally:
        await store.stop()
        await daemon.stop()
        await connection.close(nc)


async def test_a_forged_ledger_entry_rejects_nothing(daemon, nc, svc):
    """The rejection ledger is a bucket: an entry naming a proposal no operator rejected (or
    none at all) sends nothing to `duplicate_rejected`; the rejected proposal's chain says."""
    client = MeshClient(nc, svc)
    first = skill_proposal(svc, instructions="first")
    pid = (await client.propose(first)).proposal_id
    newer = skill_proposal(svc, instructions="first, refreshed",
                           created_at=first.created_at + 1000)
    record = await daemon.engine.records.rebuild(svc, pid)
    # the attacker claims an operator rejected `pid` on exactly the evidence `newer` carries
    await daemon.store.ledger_put(svc, record.dedup_key, LedgerEntry(
        proposal_id=pid, principal="operator:alice", reason="forged", at=later(0),
        evidence=triage.evidence_digest(newer)))
    reply = await client.propose(newer)
    assert reply.status == "pending"
    decision = await client.triage(reply.proposal_id)
    assert decision.cause != "duplicate_rejected"
