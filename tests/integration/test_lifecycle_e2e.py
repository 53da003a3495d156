"""The Recommendation lifecycle through the bus (DESIGN §4): supersession, the rejection ledger,
and expiry withdrawing an approval."""

from __future__ import annotations

import asyncio
import time

import pytest

from improved.client.sdk import MeshClient
from improved.core import observe
from improved.protocol import subjects as S
from tests.bus import Applier, chain_ids, eventually, publish, trailers
from tests.factories import review, skill_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def status_of(client, pid, status):
    state = await client.state(pid)
    return state if state is not None and state.status == status else None


async def test_new_content_supersedes_and_an_approval_never_carries_over(daemon, nc, svc):
    client = MeshClient(nc, svc)
    old = (await client.propose(skill_proposal(svc))).proposal_id
    await client.triage(old)
    await publish(nc, S.inbound_review(svc), review(old))
    await eventually(lambda: status_of(client, old, "approved"))  # no service: not applied

    newer = skill_proposal(svc, instructions="Read the text twice; write three bullets.")
    new = (await client.propose(newer)).proposal_id
    assert (await client.triage(new)).cause == "awaiting_operator"
    assert (await client.state(new)).status == "pending"

    await eventually(lambda: status_of(client, old, "pending"))  # approval withdrawn
    chain = await trailers(daemon, svc, old)
    assert chain[-1]["verdict"] == "superseded" and f"superseded_by:{new}" in chain[-1]["refs"]
    applier = Applier()
    sub = await client.serve_apply(applier)
    await client.triage(old)
    await asyncio.sleep(0.3)
    assert applier.orders == []  # the superseded content is never applied
    await sub.unsubscribe()


async def test_a_rejected_idea_is_not_surfaced_again_on_the_same_evidence(daemon, nc, svc):
    client = MeshClient(nc, svc)
    first = skill_proposal(svc, derived_from=["sha256:" + "a" * 64])
    pid = (await client.propose(first)).proposal_id
    await client.triage(pid)
    await publish(nc, S.inbound_review(svc), review(pid, verdict="reject", reason="no"))
    await eventually(lambda: status_of(client, pid, "rejected"))

    same = skill_proposal(svc, derived_from=["sha256:" + "a" * 64])  # new id, same evidence
    again = await client.propose(same)
    assert again.proposal_id != pid and again.status == "rejected"
    decision = await client.triage(again.proposal_id)
    assert (decision.verdict, decision.cause) == ("reject", "duplicate_rejected")

    refreshed = skill_proposal(svc, derived_from=["sha256:" + "b" * 64])
    reply = await client.propose(refreshed)
    assert reply.status == "pending"
    assert (await client.triage(reply.proposal_id)).cause == "awaiting_operator"


async def test_an_approval_expires_with_its_proposal(daemon, nc, svc):
    client = MeshClient(nc, svc)
    soon = int(time.time() * 1000) + 1500
    pid = (await client.propose(skill_proposal(svc, valid_to=soon))).proposal_id
    await client.triage(pid)
    await publish(nc, S.inbound_review(svc), review(pid))
    await eventually(lambda: status_of(client, pid, "approved"))
    await asyncio.sleep(max(0.0, (soon - time.time() * 1000) / 1000) + 0.2)

    applier = Applier()
    sub = await client.serve_apply(applier)
    decision = await client.triage(pid)
    # No service answered while it was valid: each dispatch came back undelivered and was
    # tried again. An intent recorded before valid_to may still be carried out (a retry that
    # lands just then); none is ever recorded after it, and without one the proposal expires.
    if decision.verdict == "accept":  # a retry of an intent from before valid_to
        await eventually(lambda: status_of(client, pid, "applied"))
    else:
        assert (decision.verdict, decision.cause) == ("reject", "expired")
        assert (await client.state(pid)).status == "expired"
        await asyncio.sleep(0.3)
        assert applier.orders == []
    dispatched = [t["at"] for t in await trailers(daemon, svc, pid)
                  if t.get("verdict") == "dispatched"]
    assert all(at < soon for at in dispatched), (dispatched, soon)
    await sub.unsubscribe()


async def test_an_operator_rolls_back_an_applied_change(daemon, nc, svc):
    from improved_reference.ranking_store import RankingStore
    from tests.factories import rank_proposal

    store = RankingStore(nc, svc)
    await store.start()
    client = MeshClient(nc, svc)
    first = (await client.propose(rank_proposal(svc, value=1))).proposal_id
    await eventually(lambda: status_of(client, first, "applied"))
    second = (await client.propose(rank_proposal(svc, value=2))).proposal_id
    await eventually(lambda: status_of(client, second, "applied"))
    assert await store.value("search.title_boost") == 2

    await publish(nc, S.inbound_review(svc), review(second, verdict="rollback", reason="bad"))
    await eventually(lambda: status_of(client, second, "rolled_back"))
    assert await store.value("search.title_boost") == 1  # the prior content reinstated
    chain = await trailers(daemon, svc, second)
    assert [t.get("verdict") for t in chain[-3:]] == ["rollback", "dispatched", "rolled_back"]
    assert "dispatch:rollback" in chain[-2]["refs"]
    assert chain[-1]["actor"] == "operator:alice"

    # a second rollback of the same proposal is refused; nothing moves
    n = len(chain)
    await publish(nc, S.inbound_review(svc), review(second, verdict="rollback", reason="again"))
    chain = await eventually(lambda: _longer(daemon, svc, second, n))
    assert chain[-1]["verdict"] == "refused" and "(not_applied)" in chain[-1]["reason"]
    assert await store.value("search.title_boost") == 1
    await store.stop()


async def _longer(daemon, svc, pid, n):
    chain = await trailers(daemon, svc, pid)
    return chain if len(chain) > n else None


async def test_a_change_without_an_inverse_cannot_be_rolled_back(daemon, nc, svc):
    from improved.protocol.model import ApplyResult
    from tests.factories import rank_proposal

    async def no_inverse(order):
        return ApplyResult(ok=True, applied_id="opaque-1", rollbackable=False)

    client = MeshClient(nc, svc)
    sub = await client.serve_apply(no_inverse)
    pid = (await client.propose(rank_proposal(svc))).proposal_id
    await eventually(lambda: status_of(client, pid, "applied"))
    n = len(await trailers(daemon, svc, pid))
    await publish(nc, S.inbound_review(svc), review(pid, verdict="rollback", reason="undo"))
    chain = await eventually(lambda: _longer(daemon, svc, pid, n))
    assert chain[-1]["verdict"] == "refused" and "(not_rollbackable)" in chain[-1]["reason"]
    assert (await client.state(pid)).status == "applied"
    await sub.unsubscribe()


# The measurement at review_after (held, regressed → rollback, unmeasured): test_measure.py.


async def test_an_operator_rejection_teaches_the_analyzer(daemon, nc, svc):
    from tests.factories import signal

    client = MeshClient(nc, svc)
    analyzer = "improved.metric_regression/1"
    learned = daemon.store.learned
    before, _ = await daemon.store.kv_read(learned, S.BUCKET_LEARNED, analyzer)
    counts = observe.decode(before, observe.NO_COUNTS)
    for i in range(3):
        await client.signal(signal(svc, f"mcp:watch-{i}:1", positive=False, kind="metric",
                                   target_ref="rank:teach", name="ctr"))

    async def surfaced():
        ids = await chain_ids(daemon, svc)
        return ids[0] if len(ids) == 1 else None

    pid = await eventually(surfaced)
    await client.triage(pid)
    await publish(nc, S.inbound_review(svc), review(pid, verdict="reject", reason="noise"))
    await eventually(lambda: status_of(client, pid, "rejected"))
    after = await daemon.observer.counts(analyzer)
    assert (after.accepted, after.rejected) == (counts.accepted, counts.rejected + 1)
    assert await daemon.observer.weight(analyzer) < 0.5
    # the session daemon serves other tests too
    await learned.put(analyzer, before or observe.encode(observe.NO_COUNTS))


async def test_a_cal_batch_whose_applier_returns_no_inverse_is_not_rollbackable(daemon, nc, svc):
    """The plan derived from the batch is kept on the chain, but it names no grain (the
    applier did not say what it wrote), so no rollback is offered that could not run."""
    from improved.protocol.model import ApplyResult
    from tests.factories import rank_proposal

    async def cal_store(order):  # a service that applies CAL but returns no inverse of its own
        return ApplyResult(ok=True, applied_id="grain-1")

    client = MeshClient(nc, svc)
    sub = await client.serve_apply(cal_store)
    batch = ('SUPERSEDE facts WHERE subject = "user:jo" AND relation = "prefers" '
             'SET object = "tea" REASON "three later observations say tea"')
    p = rank_proposal(svc, proposal_data=None, proposal_cal=batch, target_ref="rank:jo",
                      change_class="L0")
    pid = (await client.propose(p)).proposal_id
    outcome = await eventually(lambda: client.outcome(pid))
    assert outcome.ok and not outcome.rollbackable
    [step] = outcome.inverse["cal_inverse"]
    assert step["op"] == "supersede" and step["target"] is None
    assert step["restore_from"] == {"grain_type": "facts",
                                    "where": {"subject": "user:jo", "relation": "prefers"}}
    chain = await trailers(daemon, svc, pid)
    assert any(r.startswith("inverse:") for r in chain[-1]["refs"])
    await sub.unsubscribe()
