"""The hostile bus participant's attacks of the trust issue, each run twice (`mesh_bus`): on
the open embedded bus (`improved run`), where anyone may publish, subscribe and call the
JetStream API, and under deploy/accounts.conf's users (`improved run --accounts`), where the
server refuses most of them. What the daemon decides must be the same on both: on the open
bus because what moves a decision is evidence (core.boundary, the chains), under accounts
because the attacker is refused as well. The attacker is `svc-skills` (a service of the mesh,
not the one attacked) or `operator` where the act needs an operator's rights.

On the open bus the daemon trusts a key for `ranking` (its answers are signed); under
accounts its subjects are bound to it, which attests its answers without one."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog.testing
from nats.js.api import StreamConfig

from improved.client.sdk import MeshClient, serve_spec
from improved.core import apply as apply_stage
from improved.core import breaker, triage
from improved.protocol import subjects as S
from improved.protocol.model import MetricSnapshot, to_json
from improved_reference.ranking_store import RankingStore
from tests.bus import eventually, logged, measurement, publish, trusted_service
from tests.factories import rank_proposal, review

pytestmark = pytest.mark.asyncio(loop_scope="session")

SVC = "ranking"  # the attacked service, `svc-ranking` under accounts
ATTACKER = "svc-skills"


def later(ms: int = 300) -> int:
    return int(time.time() * 1000) + ms


async def ranking(mesh, metric: float | None = None) -> tuple[RankingStore, MeshClient]:
    """The ranking store as its own user, its answers its own on either bus."""
    conn = await mesh.connect("svc-ranking")
    store = RankingStore(conn.nc, SVC)
    if not mesh.accounts:
        store.use_key(await trusted_service(mesh.daemon, SVC))
    await store.start()
    if metric is not None:
        kv = await store.js.key_value(store.values_bucket)
        await kv.put("metrics.ctr", to_json(metric))
    return store, MeshClient(conn.nc, SVC, timeout=5.0)


async def impostor(mesh, subject: str, body: bytes):
    """`svc-skills` tries to answer `subject` first; under accounts the server refuses the
    subscription (and names it), so it hears nothing."""
    attacker = await mesh.connect(ATTACKER)

    async def answer(msg):
        if msg.reply:
            await msg.respond(body)

    await attacker.nc.subscribe(subject, cb=answer)
    await attacker.nc.flush()
    if mesh.accounts:
        await attacker.violation(subject)
    return attacker



async def status(client, pid, wanted):
    state = await client.state(pid)
    return state if state is not None and state.status == wanted else None


def watched(value: float = 5, review_after: int | None = None):
    return rank_proposal(SVC, key="attack.boost", value=value, metric_snapshot=MetricSnapshot(
        metric="ctr", baseline=0.5, query="metrics.ctr",
        review_after=later() if review_after is None else review_after))


async def test_an_impostor_answering_the_measurement_first_rolls_nothing_back(mesh_bus):
    store, client = await ranking(mesh_bus, metric=0.49)
    await impostor(mesh_bus, S.measure_request(SVC), b'{"value": 0.01}')
    pid = (await client.propose(watched())).proposal_id
    trailer = await measurement(mesh_bus.daemon, SVC, pid)
    assert trailer["verdict"] == "held" and "value:0.49" in trailer["refs"]
    assert f"answered_by:service:{SVC}" in trailer["refs"]
    assert (await client.state(pid)).status == "applied"
    await store.stop()


async def test_an_impostor_cannot_hide_a_real_regression(mesh_bus):
    store, client = await ranking(mesh_bus, metric=0.3)
    base = (await client.propose(rank_proposal(SVC, key="attack.boost", value=1)))
    await eventually(lambda: status(client, base.proposal_id, "applied"))
    await impostor(mesh_bus, S.measure_request(SVC), b'{"value": 0.5}')
    pid = (await client.propose(watched(review_after=later(800)))).proposal_id
    assert (await measurement(mesh_bus.daemon, SVC, pid))["verdict"] == "regressed"
    await eventually(lambda: status(client, pid, "rolled_back"), timeout=15)
    await store.stop()


async def test_an_impostor_saying_improve_false_refuses_nothing(mesh_bus):
    store, client = await ranking(mesh_bus)
    await impostor(mesh_bus, S.service_spec(SVC), b'{"service": "ranking", "improve": false}')
    reply = await client.propose(rank_proposal(SVC, key="attack.spec", value=3))
    assert reply.status in ("pending", "applied")
    await eventually(lambda: status(client, reply.proposal_id, "applied"))
    await store.stop()


async def test_the_services_own_improve_false_refuses(mesh_bus):
    from improved.client.sdk import ImproveError

    conn = await mesh_bus.connect("svc-ranking")
    key = None if mesh_bus.accounts else await trusted_service(mesh_bus.daemon, SVC)
    spec = await serve_spec(conn.nc, SVC, key=key)  # its own omission
    with pytest.raises(ImproveError) as refused:
        await MeshClient(conn.nc, SVC, timeout=5.0).propose(
            rank_proposal(SVC, key="attack.omitted", value=3))
    assert refused.value.code == "no_surface"
    await spec.unsubscribe()


async def test_a_review_on_another_services_subject_moves_nothing(mesh_bus):
    store, client = await ranking(mesh_bus)
    pid = (await client.propose(rank_proposal(SVC, key="attack.review", value=4,
                                              change_class="L2"))).proposal_id
    assert (await client.triage(pid)).cause == "awaiting_operator"
    operator = await mesh_bus.connect("operator")
    with structlog.testing.capture_logs() as logs:
        await publish(operator.nc, S.inbound_review("skills"), review(pid))
        refused = await logged(logs, "refused", subject=S.inbound_review("skills"))
    assert refused["code"] == "not_found", refused
    assert (await client.state(pid)).status == "pending"
    await publish(operator.nc, S.inbound_review(SVC), review(pid))
    await eventually(lambda: status(client, pid, "applied"))
    await store.stop()


async def test_a_forged_ledger_entry_rejects_nothing(mesh_bus):
    store, client = await ranking(mesh_bus)
    first = rank_proposal(SVC, key="attack.ledger", value=1, change_class="L2")
    pid = (await client.propose(first)).proposal_id
    newer = rank_proposal(SVC, key="attack.ledger", value=2, change_class="L2",
                          created_at=first.created_at + 1000)
    record = await mesh_bus.daemon.engine.records.rebuild(SVC, pid)
    attacker = await mesh_bus.connect(ATTACKER)
    entry = {"proposal_id": pid, "principal": "operator:alice", "reason": "forged",
             "at": later(0), "evidence": triage.evidence_digest(newer)}
    await attacker.nc.publish(f"$KV.{S.BUCKET_LEDGER}.{S.dedup_key_of(SVC, record.dedup_key)}",
                              to_json(entry))
    await attacker.nc.flush()
    if mesh_bus.accounts:
        await attacker.violation_like(r"\$KV\.improved_ledger\..*")
    reply = await client.propose(newer)
    assert reply.status == "pending"
    assert (await client.triage(reply.proposal_id)).cause == "awaiting_operator"
    await store.stop()


async def test_a_published_rollback_does_not_open_the_breaker(mesh_bus):
    """The service itself may publish its own proposals, the recorded inverse of an
    autonomous change among them: applied like any L0, never counted by the breaker."""
    store, client = await ranking(mesh_bus)
    for n in range(3):
        pid = (await client.propose(rank_proposal(SVC, key=f"attack.k{n}", value=n + 2)))
        pid = pid.proposal_id
        await eventually(lambda pid=pid: status(client, pid, "applied"))
        inverse = apply_stage.rollback_proposal(await mesh_bus.daemon.engine.records.rebuild(SVC, pid))
        await client.publish(inverse)
        await eventually(lambda pid=pid: status(client, pid, "rolled_back"), timeout=15)
    autonomy = [b for _, b in await mesh_bus.daemon.store.read_chain_at(
        S.autonomy_audit(breaker.AUTONOMY_ID))]
    assert not [b for b in autonomy if b.get("verdict") == "rollback"]
    after = (await client.propose(rank_proposal(SVC, key="attack.after", value=9))).proposal_id
    await eventually(lambda: status(client, after, "applied"))
    await store.stop()


async def test_a_limit_on_the_audit_stream_lets_nothing_apply_on_a_forgetting_log(mesh_bus):
    store, client = await ranking(mesh_bus)
    first = (await client.propose(rank_proposal(SVC, key="attack.limit", value=1)))
    await eventually(lambda: status(client, first.proposal_id, "applied"))
    await mesh_bus.daemon.engine.checkpoints.checkpoint(mesh_bus.daemon._checkpoint_key)  # noqa: SLF001
    attacker = await mesh_bus.connect(ATTACKER)
    js = attacker.nc.jetstream(timeout=2.0)
    daemon_js = mesh_bus.daemon.store.js
    cfg = (await daemon_js.stream_info(S.STREAM_AUDIT)).config
    try:
        await js.update_stream(StreamConfig.from_response({**cfg.as_dict(), "max_msgs": 2}))
        await js.update_stream(cfg)  # and back, before any checkpoint looks
    except Exception:  # refused (under accounts the server drops it: a timeout)
        assert mesh_bus.accounts
    await asyncio.sleep(1.2)  # the next pass compares the audit stream's retention
    with structlog.testing.capture_logs() as logs:
        pid = (await client.propose(rank_proposal(SVC, key="attack.limit2",
                                                  value=2))).proposal_id
        if mesh_bus.accounts:  # nothing was lost: the loop goes on
            assert (await daemon_js.stream_info(S.STREAM_AUDIT)).config.max_msgs == cfg.max_msgs
            await eventually(lambda: status(client, pid, "applied"))
        else:  # the log forgot: a crisis at once, the apply refused
            await logged(logs, "applies refused", proposal_id=pid)
            assert (await client.state(pid)).status != "applied"
            assert (await mesh_bus.daemon.engine.autonomy.state(2**62)).crisis
    await store.stop()


async def test_a_forged_crisis_resolution_resolves_nothing(mesh_bus):
    from improved.core import audit
    from improved.core.record import ChainHead
    from improved.runtime.store import Store

    daemon = mesh_bus.daemon
    await daemon.engine.autonomy.chain_broken("a test opens a crisis")
    crisis = (await daemon.engine.autonomy.state(2**62)).crisis
    attacker = await mesh_bus.connect(ATTACKER)
    subject = S.autonomy_audit(breaker.AUTONOMY_ID)
    chain = await daemon.store.read_chain_at(subject)
    last_seq, last = chain[-1]
    draft = breaker.draft(breaker.in_crisis(breaker.from_trailer(last), ""), "crisis_resolved",
                          "operator:alice", "human", f"{crisis} resolved",
                          breaker.Marks(resolved=crisis))
    head = ChainHead(length=last["seq"] + 1, last_hash=last["hash"], stream_seq=last_seq)
    forged = audit.seal_next(draft, breaker.AUTONOMY_ID, head, "L0", "operation",
                             last["at"] + 1)
    try:
        await Store(attacker.nc).append_to(subject, forged, last_seq)
    except Exception:  # refused under accounts: only the daemon writes trailers
        assert mesh_bus.accounts
    daemon.engine.autonomy.forget()  # read the chain afresh
    assert (await daemon.engine.autonomy.state(2**62)).crisis  # still in crisis, on either bus
