"""The client SDK and the reference ranking store, against a real nats-server (no daemon):
orders are sent by hand, as the daemon would send them."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import pytest_asyncio

from improved import testing
from improved.client.sdk import ImproveError, MeshClient, serve_spec
from improved.core import propose
from improved.protocol import subjects
from improved.protocol.model import (
    ApplyOrder,
    ApplyResult,
    Proposal,
    ProposalState,
    to_json,
)
from improved.runtime.store import Store
from improved_reference.ranking_store import RankingStore, bucket_names, main, parse_change
from tests.bus import KVRevision, crash_once_after_the_write, kv_history, send

KEY = "search.title_boost"


def proposal(svc: str, *, target: str = f"rank:{KEY}", data=None, value=1.5,
             at: int = 1768471200000) -> Proposal:
    return testing.proposal(
        svc, target, "L0", template="adjust_rank", args={"item": "title", "delta": value},
        analyzer="acme.tuner/1", actor=f"{svc}:agent-1", created_at=at,
        proposal_data=data if data is not None else {"set": {"key": KEY, "value": value}})


def order(p: Proposal, attempt: int = 1) -> ApplyOrder:
    pid, _ = propose.identify(p)
    return ApplyOrder(proposal_id=pid, proposal=p, authority="operator:policy", attempt=attempt)




async def history(nc, svc: str, key: str) -> list[KVRevision]:
    return await kv_history(nc, bucket_names(svc)[0], key)


@pytest_asyncio.fixture(loop_scope="session")
async def store(nc, svc):
    s = RankingStore(nc, svc)
    await s.start()
    yield s
    await s.stop()
    js = nc.jetstream()
    for bucket in bucket_names(svc):
        await js.delete_key_value(bucket)


# -- the ranking store ---------------------------------------------------------------------------


async def test_order_sets_value_and_returns_rollbackable_inverse(nc, svc, store):
    o = order(proposal(svc))
    result, _ = await send(nc, svc, o)
    assert result.ok, result.error
    assert result.rollbackable
    assert result.inverse == {"delete": KEY}
    assert result.applied_id.startswith(f"{bucket_names(svc)[0]}:{KEY}@")
    assert await store.value(KEY) == 1.5
    assert await store.apply_count(o.proposal_id) == 1
    assert (store.applies, store.orders) == (1, 1)


async def test_same_order_twice_returns_identical_result_and_writes_once(nc, svc, store):
    o = order(proposal(svc))
    first, first_bytes = await send(nc, svc, o)
    again, again_bytes = await send(nc, svc, order(o.proposal, attempt=2))
    assert first.ok and again == first and again_bytes == first_bytes
    assert (store.applies, store.orders) == (1, 2)
    assert len(await history(nc, svc, KEY)) == 1


async def test_second_proposal_records_first_value_as_prior(nc, svc, store):
    first = order(proposal(svc, value=1.5))
    second = order(proposal(svc, value=2.0, at=1768471300000))
    r1, r1_bytes = await send(nc, svc, first)
    r2, _ = await send(nc, svc, second)
    assert r1.ok and r2.ok and r1.applied_id != r2.applied_id
    assert r2.inverse == {"set": {"key": KEY, "value": 1.5}}
    assert await store.value(KEY) == 2.0
    # A late repeat of the first order answers as before and does not undo the second.
    _, repeat_bytes = await send(nc, svc, first)
    assert repeat_bytes == r1_bytes
    assert await store.value(KEY) == 2.0
    assert store.applies == 2


async def test_inverse_applies_back(nc, svc, store):
    await send(nc, svc, order(proposal(svc, value=1.5)))
    r2, _ = await send(nc, svc, order(proposal(svc, value=2.0, at=1768471300000)))
    undo, _ = await send(nc, svc, order(proposal(svc, data=r2.inverse, at=1768471400000)))
    assert undo.ok and await store.value(KEY) == 1.5
    r_del, _ = await send(nc, svc, order(proposal(svc, data={"delete": KEY}, at=1768471500000)))
    assert r_del.ok and r_del.inverse == {"set": {"key": KEY, "value": 1.5}}
    assert await store.value(KEY) is None


@pytest.mark.parametrize(("target", "data", "reason"), [
    (f"rank:{KEY}", {"put": {"key": KEY, "value": 1}}, "must be {\"set\""),
    (f"rank:{KEY}", {"set": {"key": "search.other", "value": 1}}, "does not match"),
    (f"rank:{KEY}", {"set": {"key": KEY, "value": [1, 2]}}, "JSON scalar"),
    (f"rank:{KEY}", {"set": {"key": KEY, "value": {"a": 1}}}, "JSON scalar"),
    (f"rank:{KEY}", {"set": {"key": KEY, "value": None}}, "null"),
    (f"rank:{KEY}", {"set": {"key": KEY}}, "proposal_data.set must be"),
    (f"rank:{KEY}", {"set": {"key": KEY, "value": 1}, "extra": 1}, "got keys"),
    (f"skill:{KEY}", {"set": {"key": KEY, "value": 1}}, "unsupported target scheme"),
    ("rank:a..b", {"set": {"key": "a..b", "value": 1}}, "must match"),
])
async def test_bad_proposal_data_is_refused_and_changes_nothing(nc, svc, store, target, data,
                                                                reason):
    o = order(proposal(svc, target=target, data=data))
    result, _ = await send(nc, svc, o)
    assert not result.ok and not result.rollbackable
    assert reason in result.error
    assert await store.value(KEY) is None
    assert await store.apply_count(o.proposal_id) == 0
    assert store.applies == 0


async def test_bad_orders_get_ok_false_and_service_keeps_serving(nc, svc, store):
    for body in (b"not json", b"{}", to_json({**msgspec.to_builtins(order(proposal(svc))),
                                               "proposal": {"service": svc}})):
        result, _ = await send(nc, svc, body)
        assert not result.ok and result.error.startswith("bad ApplyOrder")
    other = order(proposal("someone-else"))
    result, _ = await send(nc, svc, other)
    assert not result.ok and "someone-else" in result.error
    result, _ = await send(nc, svc, order(proposal(svc)))
    assert result.ok


async def test_crash_before_the_write_is_finished_by_the_next_order(nc, svc, store):
    real = store._write
    calls = 0

    async def crash_once(*args):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("crashed before the write")
        return await real(*args)

    store._write = crash_once
    o = order(proposal(svc))
    crashed, _ = await send(nc, svc, o)
    assert not crashed.ok and "crashed before the write" in crashed.error
    assert await store.value(KEY) is None
    result, _ = await send(nc, svc, o)
    assert result.ok and await store.value(KEY) == 1.5
    assert result.inverse == {"delete": KEY}
    assert len(await history(nc, svc, KEY)) == 1


async def test_crash_after_the_write_adopts_it_without_writing_again(nc, svc, store):
    crash_once_after_the_write(store)
    o = order(proposal(svc))
    crashed, _ = await send(nc, svc, o)
    assert not crashed.ok and await store.value(KEY) == 1.5
    result, _ = await send(nc, svc, o)
    (entry,) = await history(nc, svc, KEY)
    assert result.ok and result.applied_id.endswith(f"@{entry.revision}")
    assert store.applies == 1


async def test_concurrent_twins_apply_once(nc, svc, store):
    twin = RankingStore(nc, svc)
    await twin.start()
    try:
        o = order(proposal(svc))
        results = await asyncio.gather(*(s.apply(o) for s in (store, twin, store, twin)))
    finally:
        await twin.stop()
    assert all(r == results[0] for r in results) and results[0].ok
    assert store.applies + twin.applies == 1
    assert len(await history(nc, svc, KEY)) == 1


def test_parse_change_accepts_every_scheme():
    for scheme in ("rank", "score", "cache", "config"):
        p = proposal("svc", target=f"{scheme}:{KEY}")
        assert parse_change(p).value == 1.5


def test_main_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "--service" in capsys.readouterr().out


# -- the SDK ---------------------------------------------------------------------------------------


async def test_handler_that_raises_answers_not_now_and_subscription_survives(nc, svc):
    calls = 0

    async def flaky(o: ApplyOrder) -> ApplyResult:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ValueError("boom")
        if calls == 2:
            return "not a result"  # type: ignore[return-value]
        return ApplyResult(ok=True, applied_id=f"x@{calls}")

    sub = await MeshClient(nc, svc).serve_apply(flaky)
    try:
        o = order(proposal(svc))
        reply = await nc.request(subjects.apply_request(svc), to_json(o), timeout=5)
        err = msgspec.json.decode(reply.data)["error"]  # "not now": the daemon retries
        assert err["code"] == "unavailable" and "ValueError: boom" in err["message"]
        second, _ = await send(nc, svc, o)
        assert not second.ok and "not an ApplyResult" in second.error
        third, _ = await send(nc, svc, o)
        assert third.ok and third.applied_id == "x@3"
    finally:
        await sub.unsubscribe()


async def test_serve_spec_answers_capabilities_or_their_omission(nc, svc, store):
    reply = await nc.request(subjects.service_spec(svc), b"{}", timeout=5)
    assert msgspec.json.decode(reply.data)["improve"] is True
    other = f"{svc}-bare"
    sub = await serve_spec(nc, other)
    try:
        reply = await nc.request(subjects.service_spec(other), b"{}", timeout=5)
        assert msgspec.json.decode(reply.data) == {"service": other, "improve": False}
    finally:
        await sub.unsubscribe()


async def test_propose_returns_reply_or_raises_improve_error(nc, svc):
    """A stand-in daemon: refuses a proposal without `summary`, registers anything else."""

    async def fake_daemon(msg):
        body = msgspec.json.decode(msg.data)
        if "summary" not in body:
            await msg.respond(b'{"error": {"code": "missing_field", "message": "missing '
                              b'required field `summary`", "field": "summary"}}')
        else:
            await msg.respond(to_json({"proposal_id": "ab" * 32, "status": "pending"}))

    sub = await nc.subscribe(subjects.propose_request(svc), cb=fake_daemon)
    try:
        client = MeshClient(nc, svc)
        reply = await client.propose(proposal(svc))
        assert (reply.proposal_id, reply.status) == ("ab" * 32, "pending")
        bad = msgspec.to_builtins(proposal(svc))
        del bad["summary"]
        with pytest.raises(ImproveError) as err:
            await client.propose(bad)
        assert (err.value.code, err.value.field) == ("missing_field", "summary")
        raw = await client.propose_raw(to_json(bad))
        assert raw["error"]["code"] == "missing_field"
    finally:
        await sub.unsubscribe()


async def test_publish_refuses_a_bad_proposal_before_sending(nc, svc):
    bad = msgspec.to_builtins(proposal(svc))
    bad["status"] = "applied"
    with pytest.raises(ImproveError) as err:
        await MeshClient(nc, svc).publish(bad)
    assert err.value.code == "status_forbidden"


async def test_retained_records_read_back_or_none(nc, svc):
    await Store(nc).ensure()  # the daemon's own idempotent stream setup; no daemon runs
    client = MeshClient(nc, svc)
    pid = "cd" * 32
    assert await client.state(pid) is None
    state = ProposalState(proposal_id=pid, service=svc, target_ref=f"rank:{KEY}",
                          change_class="L0", gate_class="L0", scope="knowledge",
                          dedup_key="ef" * 32, stage="propose", status="pending",
                          summary_text="adjust rank of title by 0.5", updated_at=1)
    await nc.jetstream().publish(subjects.proposal_state(svc, pid), to_json(state),
                                 stream=subjects.STREAM_RECORDS)
    assert await client.state(pid) == state
    assert await client.decision(pid) is None
    assert await client.outcome(pid) is None
    assert await client.learn_back(pid) is None
