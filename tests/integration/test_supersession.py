"""Supersession that can't be squatted or back-dated (issue: guards that cannot be sidestepped).
Played as an agent would: a proposal dated far in the future, a newer-dated one that expired,
and older content published after newer content under the same dedup key."""

from __future__ import annotations

import asyncio
import time

from improved.client.sdk import MeshClient
from improved.protocol import subjects as S
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
