"""Supersession that can't be squatted or back-dated (issue: guards that cannot be sidestepped).
Played as an agent would: a proposal dated far in the future, a newer-dated one that expired,
and older content published after newer content under the same dedup key."""

from __future__ import annotations

import asyncio
import time

from improved.client.sdk import MeshClient
from improved.core import propose
from improved.protocol import subjects as S
from improved.protocol.model import to_json
from improved_reference.ranking_store import RankingStore
from tests.bus import eventually, publish, trailers
from tests.factories import rank_proposal, review, skill_proposal

YEAR_MS = 365 * 24 * 3600 * 1000


def now_ms() -> int:
    return int(time.time() * 1000)


async def test_a_proposal_dated_in_the_future_claims_nothing_and_is_rejected(daemon, nc, svc):
    client = MeshClient(nc, svc)
    squatter = skill_proposal(svc, created_at=now_ms() + 70 * YEAR_MS)
    reply = await client.propose(squatter)
    decision = await client.triage(reply.proposal_id)
    assert (reply.status, decision.cause) == ("rejected", "invalid")
    assert "in the future" in decision.rationale
    honest = skill_proposal(svc, created_at=now_ms())
    reply = await client.propose(honest)
    decision = await client.triage(reply.proposal_id)
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_operator")
    chain = await trailers(daemon, svc, reply.proposal_id)
    assert not any(t.get("verdict") == "superseded" for t in chain)
    await publish(nc, S.inbound_review(svc), review(reply.proposal_id))
    await eventually(lambda: _status_is(client, reply.proposal_id, "approved"))


async def _status_is(client, pid, status):
    state = await client.state(pid)
    return state is not None and state.status == status


async def test_an_expired_newer_proposal_supersedes_nothing(daemon, nc, svc):
    client = MeshClient(nc, svc)
    newer = skill_proposal(svc, created_at=now_ms() + 60_000, valid_to=now_ms() + 1)
    await asyncio.sleep(0.01)
    reply = await client.propose(newer)
    assert (await client.triage(reply.proposal_id)).cause == "expired"
    older = skill_proposal(svc, created_at=now_ms())
    reply = await client.propose(older)
    decision = await client.triage(reply.proposal_id)
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_operator")
    chain = await trailers(daemon, svc, reply.proposal_id)
    assert not any(t.get("verdict") == "superseded" for t in chain)


async def test_older_content_published_after_newer_is_superseded_and_never_applied(daemon, nc,
                                                                                   svc):
    store = RankingStore(nc, svc)
    await store.start()
    client = MeshClient(nc, svc)
    try:
        t = now_ms()
        newer = rank_proposal(svc, value=2.0, created_at=t)
        older = rank_proposal(svc, value=1.0, created_at=t - 60_000)
        first = await client.publish(newer)  # through the inbound stream: dispatch is on
        await eventually(lambda: client.outcome(first))
        late = await client.publish(older)
        async def superseded():
            return any(t.get("verdict") == "superseded"
                       for t in await trailers(daemon, svc, late))

        await eventually(superseded)
        await asyncio.sleep(0.3)
        assert store.orders == 1  # only the newer content was ever sent
        assert await client.outcome(late) is None
    finally:
        await store.stop()


async def test_late_older_content_under_a_rejected_head_can_be_approved(daemon, nc, svc):
    """A rejected head supersedes nothing (`propose.supersedes`): older content with new
    evidence, arriving after the rejection, waits for the operator and an approval holds, as
    registration already decided."""
    client = MeshClient(nc, svc)
    t = now_ms()
    newer = skill_proposal(svc, created_at=t)
    first = (await client.propose(newer)).proposal_id
    await publish(nc, S.inbound_review(svc), review(first, verdict="reject"))
    await eventually(lambda: _status_is(client, first, "rejected"))
    older = skill_proposal(svc, created_at=t - 60_000,
                           evidence_query="SELECT ctr FROM clicks WHERE day = 'yesterday'")
    late = (await client.propose(older)).proposal_id
    decision = await client.triage(late)
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_operator")
    await publish(nc, S.inbound_review(svc), review(late))
    await eventually(lambda: _status_is(client, late, "approved"))
    assert not any(t.get("verdict") in ("superseded", "refused")
                   for t in await trailers(daemon, svc, late))


async def test_a_forged_dedup_head_naming_another_proposal_supersedes_nothing(daemon, nc,
                                                                             svc):
    """The dedup bucket is a cache anyone on the bus could write: a head naming a real, newer
    proposal under another dedup_key must neither supersede a newcomer nor block its
    approval."""
    client = MeshClient(nc, svc)
    t = now_ms()
    unrelated = (await client.propose(skill_proposal(svc, name="other", created_at=t)))
    victim = skill_proposal(svc, created_at=t - 60_000)
    dedup = propose.identify(victim)[1]
    kv = await nc.jetstream().key_value(S.BUCKET_DEDUP)
    await kv.put(S.dedup_key_of(svc, dedup), to_json(
        {"proposal_id": unrelated.proposal_id, "created_at": t}))
    pid = (await client.propose(victim)).proposal_id
    decision = await client.triage(pid)
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_operator")
    await publish(nc, S.inbound_review(svc), review(pid))
    await eventually(lambda: _status_is(client, pid, "approved"))
    assert not any(t.get("verdict") == "superseded" for t in await trailers(daemon, svc, pid))


async def test_a_forged_dedup_head_cannot_make_a_newcomer_supersede_another_keys_proposal(
        daemon, nc, svc):
    """A head forged under one dedup_key, naming a pending proposal of another key as if it
    were old content there: a newcomer under that key supersedes nothing of the victim's."""
    client = MeshClient(nc, svc)
    victim = (await client.propose(skill_proposal(svc, name="victim"))).proposal_id
    newcomer = skill_proposal(svc, name="newcomer")
    dedup = propose.identify(newcomer)[1]
    kv = await nc.jetstream().key_value(S.BUCKET_DEDUP)
    await kv.put(S.dedup_key_of(svc, dedup), to_json({"proposal_id": victim, "created_at": 0}))
    pid = (await client.propose(newcomer)).proposal_id
    assert (await client.triage(pid)).cause == "awaiting_operator"
    await publish(nc, S.inbound_review(svc), review(victim))
    await eventually(lambda: _status_is(client, victim, "approved"))
    assert not any(t.get("verdict") == "superseded" for t in await trailers(daemon, svc, victim))
