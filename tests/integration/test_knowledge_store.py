"""The reference knowledge store against a real nats-server: CAL batches applied under the
approver's capability, inside the namespace, within the quotas, exactly once, with an inverse
that replays; hostile orders refused with nothing changed; and apply + rollback through the
real daemon."""

from __future__ import annotations

import pytest
import pytest_asyncio

from improved import testing
from improved.client.sdk import MeshClient
from improved.core import propose
from improved.protocol import subjects
from improved.protocol.model import (
    ApplyOrder,
    Proposal,
    ProposalEdit,
    to_json,
)
from improved_reference.knowledge_store import (
    KnowledgeStore,
    bucket_names,
    main,
    namespace_key,
)
from tests.bus import (
    crash_once_after_the_write,
    eventually,
    kv_revisions,
    publish,
    rolled_back,
    send,
    serving,
    trailers,
)
from tests.factories import review

NS = "agent:recommendations"
ALICE = "operator:alice"
FACTS = ('ADD fact SET subject = "user:jo" SET relation = "prefers" SET object = "tea" '
         'REASON "said so on Monday"\n'
         'ADD fact SET subject = "user:jo" SET relation = "prefers" SET object = "black tea" '
         'REASON "said so on Tuesday"')
MERGE = ('SUPERSEDE facts WHERE subject = "user:jo" AND relation = "prefers" '
         'SET object = "tea" REASON "merge 2 duplicate extractions"')


def proposal(svc: str, *, cal: str | None = None, data: dict | None = None,
             namespace: str | None = NS, change_class: str = "L2", **over) -> Proposal:
    return testing.proposal(svc, **{
        "target_ref": "entity:prefs/user:jo", "change_class": change_class,
        "template": "merge_duplicate_facts", "args": {"subject": "user:jo"},
        "analyzer": "curator.duplicate_sweep/1", "actor": f"mcp:{svc}-curator:1",
        "proposal_cal": cal, "proposal_data": data, "namespace": namespace, **over})


def order(p: Proposal, authority: str = ALICE, attempt: int = 1) -> ApplyOrder:
    pid, _ = propose.identify(p)
    return ApplyOrder(proposal_id=pid, proposal=p, authority=authority, attempt=attempt)


@pytest_asyncio.fixture(loop_scope="session")
async def store(nc, svc):
    async with serving(nc, KnowledgeStore(nc, svc), bucket_names(svc)) as s:
        yield s


async def revisions(nc, svc: str, namespace: str = NS) -> int:
    return await kv_revisions(nc, bucket_names(svc)[0], namespace_key(namespace))


async def objects(store: KnowledgeStore, namespace: str = NS) -> list[str]:
    return sorted(g["object"] for g in (await store.recall(namespace)).values())


# -- applying ------------------------------------------------------------------------------------


async def test_a_batch_applies_once_and_a_repeat_changes_nothing(nc, svc, store):
    o = order(proposal(svc, cal=FACTS))
    first, first_bytes = await send(nc, svc, o)
    assert first.ok and first.rollbackable, first.error
    assert await objects(store) == ["black tea", "tea"]
    added = sorted(await store.recall(NS))
    assert first.applied_id == f"{NS}:" + ",".join(
        s["target"] for s in reversed(first.inverse["cal_inverse"]))
    assert sorted(s["target"] for s in first.inverse["cal_inverse"]) == added
    assert all(s["op"] == "retract" for s in first.inverse["cal_inverse"])
    _, again = await send(nc, svc, order(o.proposal, attempt=2))
    assert again == first_bytes
    assert await revisions(nc, svc) == 1 and (store.applies, store.orders) == (1, 2)


async def test_the_seed_shaped_merge_and_its_inverse_replayed_by_the_store(nc, svc, store):
    """SUPERSEDE … WHERE (the OMS seed's example) merges the duplicates into one grain; the
    inverse names the grains really written, applied as proposal_data it reinstates both, and
    its own inverse merges them again."""
    await send(nc, svc, order(proposal(svc, cal=FACTS)))
    before = sorted(await store.recall(NS))
    merged, _ = await send(nc, svc, order(proposal(svc, cal=MERGE)))
    assert merged.ok, merged.error
    assert await objects(store) == ["tea"]
    [step] = merged.inverse["cal_inverse"]
    assert step["op"] == "supersede" and step["target"] in await store.recall(NS)
    assert sorted(step["restore_from"]) == before
    undo, _ = await send(nc, svc, order(proposal(svc, data=merged.inverse)))
    assert undo.ok and undo.rollbackable, undo.error
    assert sorted(await store.recall(NS)) == before
    redo, _ = await send(nc, svc, order(proposal(svc, data=undo.inverse)))
    assert redo.ok and sorted(await store.recall(NS)) == [step["target"]]


async def test_revert_goes_back_to_the_version_before_the_head(nc, svc, store):
    added, _ = await send(nc, svc, order(proposal(
        svc, cal='ADD fact SET subject = "s" SET relation = "r" SET object = "v1" REASON "a"')))
    v1 = added.inverse["cal_inverse"][0]["target"]
    moved, _ = await send(nc, svc, order(proposal(
        svc, cal=f'SUPERSEDE {v1} SET object = "v2" REASON "b"')))
    assert await objects(store) == ["v2"]
    v2 = moved.inverse["cal_inverse"][0]["target"]
    reverted, _ = await send(nc, svc, order(proposal(svc, cal=f'REVERT {v2} REASON "c"')))
    assert reverted.ok and await objects(store) == ["v1"]
    assert reverted.inverse["cal_inverse"][0]["restore_from"] == v2
    nothing_before, _ = await send(nc, svc, order(proposal(svc, cal=f'REVERT {v1[:20]} '
                                                            'REASON "d"')))
    assert not nothing_before.ok and "E040" in nothing_before.error


async def test_crash_after_the_write_adopts_it_without_writing_again(nc, svc, store):
    crash_once_after_the_write(store)
    o = order(proposal(svc, cal=FACTS))
    crashed, _ = await send(nc, svc, o)
    assert not crashed.ok and "crashed after the write" in crashed.error
    result, _ = await send(nc, svc, o)
    assert result.ok and await objects(store) == ["black tea", "tea"]
    assert await revisions(nc, svc) == 1 and store.applies == 1


# -- hostile bus participants: refused, nothing changed ---------------------------------------------


async def unchanged(nc, svc, store, count: int, live: list[str]) -> None:
    assert await revisions(nc, svc) == count
    assert await objects(store) == live


@pytest.mark.parametrize(("cal", "why"), [
    ('SUPERSEDE facts WHERE namespace = "user:private" AND subject = "user:jo" '
     'SET object = "coffee" REASON "x"', "E045 NamespaceMismatch"),
    ('SUPERSEDE facts WHERE subject = "user:nobody" SET object = "x" REASON "x"', "E046"),
])
async def test_a_batch_writing_outside_its_namespace_is_refused(nc, svc, store, cal, why):
    await send(nc, svc, order(proposal(svc, cal=FACTS)))
    result, _ = await send(nc, svc, order(proposal(svc, cal=cal)))
    assert not result.ok and why in result.error
    await unchanged(nc, svc, store, 1, ["black tea", "tea"])


async def test_an_address_in_another_namespace_is_outside_the_recommendations(nc, svc, store):
    other, _ = await send(nc, svc, order(proposal(svc, cal=FACTS, namespace="user:private")))
    grain = other.inverse["cal_inverse"][0]["target"]
    await send(nc, svc, order(proposal(svc, cal=FACTS)))
    for cal in (f'SUPERSEDE {grain} SET object = "coffee" REASON "x"', f'REVERT {grain} '
                'REASON "x"'):
        result, _ = await send(nc, svc, order(proposal(svc, cal=cal)))
        assert not result.ok and "is no grain of namespace 'agent:recommendations'" in \
            result.error
    await unchanged(nc, svc, store, 1, ["black tea", "tea"])
    assert await objects(store, "user:private") == ["black tea", "tea"]


async def test_a_quota_breach_is_refused_whole(nc, svc, store):
    adds = "\n".join(f'ADD fact SET subject = "s" SET relation = "r" SET object = "{i}" '
                     f'REASON "r{i}"' for i in range(21))
    result, _ = await send(nc, svc, order(proposal(svc, cal=adds)))
    assert not result.ok and "E052" in result.error and "MAX_ADD_PER_MINUTE = 20" in result.error
    await unchanged(nc, svc, store, 0, [])
    twenty = adds.rsplit("\n", 1)[0]
    assert (await send(nc, svc, order(proposal(svc, cal=twenty))))[0].ok
    one_more, _ = await send(nc, svc, order(proposal(svc, cal=FACTS)))
    assert not one_more.ok and "with 20 in the last minute" in one_more.error
    assert await revisions(nc, svc) == 1


async def test_an_approver_without_the_capability_is_refused(nc, svc):
    store = KnowledgeStore(nc, svc, writers=(("operator:alice", "agent:*"),))
    await store.start()
    try:
        for authority, namespace in (("operator:mallory", NS), (ALICE, "user:private"),
                                     ("mcp:curator", NS)):
            result, _ = await send(nc, svc, order(proposal(svc, cal=FACTS, namespace=namespace),
                                                  authority=authority))
            assert not result.ok and f"{authority} holds no capability" in result.error
        await unchanged(nc, svc, store, 0, [])
        assert (await send(nc, svc, order(proposal(svc, cal=FACTS))))[0].ok
    finally:
        await store.stop()


@pytest.mark.parametrize(("over", "why"), [
    ({"namespace": None}, "names no namespace"),
    ({"target_ref": "rank:x"}, "unsupported target scheme"),
    ({"cal": None, "data": {"set": {"key": "k", "value": 1}}}, "expected proposal_cal"),
    ({"cal": None, "data": {"cal_inverse": [{"op": "supersede", "target": None,
                                             "restore_from": {"grain_type": "facts"}}]}},
     "only a plan naming real grains"),
    ({"cal": None, "data": {"cal_inverse": [{"op": "retract",
                                             "target": "sha256:" + "ab" * 32}]}},
     "is no grain of namespace"),
    ({"cal": 'DELETE facts WHERE subject = "x"'}, "destructive"),
    ({"cal": None, "proposal_edit": ProposalEdit(format="unified", base_digest="sha256:0",
                                                 diff="")}, "not proposal_edit"),
])
async def test_malformed_and_foreign_orders_are_refused(nc, svc, store, over, why):
    fields = {"cal": FACTS, **over}
    result, _ = await send(nc, svc, order(proposal(svc, **fields)))
    assert not result.ok and why in result.error
    await unchanged(nc, svc, store, 0, [])


async def test_a_stale_inverse_is_refused_after_a_later_change(nc, svc, store):
    added, _ = await send(nc, svc, order(proposal(
        svc, cal='ADD fact SET subject = "s" SET relation = "r" SET object = "v1" REASON "a"')))
    v1 = added.inverse["cal_inverse"][0]["target"]
    await send(nc, svc, order(proposal(svc, cal=f'SUPERSEDE {v1} SET object = "v2" REASON "b"')))
    result, _ = await send(nc, svc, order(proposal(svc, data=added.inverse)))
    assert not result.ok and "E040" in result.error and "not the head" in result.error
    await unchanged(nc, svc, store, 2, ["v2"])


async def test_a_forged_order_is_refused_when_the_store_verifies_acceptance(daemon, nc, svc):
    """Anyone on the bus may publish an ApplyOrder naming operator:alice; with the acceptance
    gate in the store, an order whose approval is not on the audit chain applies nothing."""
    store = KnowledgeStore(nc, svc, verify_acceptance=True)
    await store.start()
    try:
        result, _ = await send(nc, svc, order(proposal(svc, cal=FACTS)))
        assert not result.ok and result.error.startswith("not_accepted:")
        await unchanged(nc, svc, store, 0, [])
        assert store.capabilities()["conformance"] == "L3"
    finally:
        await store.stop()


def test_main_help_and_a_bad_writer(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "--writer" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["--service", "k", "--writer", "operator:alice"])
    assert exit_.value.code == 2
    assert "PRINCIPAL=NAMESPACE" in capsys.readouterr().err


# -- through the daemon: approved, applied, rolled back by its inverse ---------------------------


async def test_an_approved_batch_is_applied_and_rolled_back_through_the_daemon(daemon, nc, svc,
                                                                                store):
    client = MeshClient(nc, svc)
    first = (await client.propose(proposal(svc, cal=FACTS))).proposal_id
    await eventually(lambda: client.decision(first))
    await publish(nc, subjects.inbound_review(svc), review(first))
    assert (await eventually(lambda: client.outcome(first))).ok
    before = sorted(await store.recall(NS))
    pid = (await client.propose(proposal(svc, cal=MERGE))).proposal_id
    await eventually(lambda: client.decision(pid))
    await publish(nc, subjects.inbound_review(svc), review(pid))
    out = await eventually(lambda: client.outcome(pid))
    assert out.ok and out.rollbackable and out.authority == ALICE
    assert all(s["target"] for s in out.inverse["cal_inverse"])
    assert await objects(store) == ["tea"]
    await rolled_back(nc, client, svc, pid, "the merge lost a preference")
    assert sorted(await store.recall(NS)) == before
    chain = await trailers(daemon, svc, pid)
    assert chain[-1]["verdict"] == "rolled_back"


async def test_a_namespace_tampered_with_in_kv_is_never_built_on(nc, svc, store):
    """Anyone on the bus may write the bucket: a grain altered in place no longer matches its
    address, and every change to that namespace is refused (final, not retried) until it is
    repaired."""
    await send(nc, svc, order(proposal(svc, cal=FACTS)))
    kv = await nc.jetstream().key_value(bucket_names(svc)[0])
    state = await store.state(NS)
    address = next(iter(state["grains"]))
    state["grains"][address]["object"] = "whisky"
    await kv.put(namespace_key(NS), to_json(state))
    result, _ = await send(nc, svc, order(proposal(svc, cal=MERGE)))
    assert not result.ok and "does not match its content address" in result.error
    await kv.put(namespace_key(NS), b'"not a namespace"')
    result, _ = await send(nc, svc, order(proposal(svc, cal=MERGE)))
    assert not result.ok and "not this store's" in result.error
    assert store.applies == 1
