"""A closed proposal's retained records leave the bus after `records_ttl_days`; an open one's
stay. The chain keeps everything, so `improved show` still shows the closed proposal."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from nats.js.errors import NotFoundError

from improved.protocol import subjects as S
from tests.bus import daemon_with_records_ttl, eventually
from tests.cli import improved
from tests.factories import rank_proposal, skill_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")

SVC = "ttl"
TTL_S = 2


async def ttl_of(js, subject: str) -> str | None:
    """The Nats-TTL header of the retained record on `subject` ("" without one), or None when
    the subject holds nothing."""
    try:
        msg = await js.get_last_msg(S.STREAM_RECORDS, subject)
    except NotFoundError:
        return None
    return (msg.headers or {}).get("Nats-TTL", "")


async def test_records_of_a_closed_proposal_expire_and_an_open_ones_stay(own_server):
    async with daemon_with_records_ttl(own_server.url, SVC, TTL_S, "records-ttl") as (
            _, nc, client):
        js = nc.jetstream()
        done = (await client.propose(rank_proposal(SVC))).proposal_id
        waiting = (await client.propose(skill_proposal(SVC))).proposal_id
        await eventually(lambda: client.outcome(done))
        closed = [S.proposal_state(SVC, done), S.triage_decision(SVC, done),
                  S.apply_outcome(SVC, done)]

        async def all_carry_the_ttl():
            return all([await ttl_of(js, s) == str(TTL_S) for s in closed])

        await eventually(all_carry_the_ttl)  # the decision too, sent again at the close
        assert await ttl_of(js, S.proposal_state(SVC, waiting)) == ""
        assert await ttl_of(js, S.triage_decision(SVC, waiting)) == ""

        async def gone():
            return all([await ttl_of(js, s) is None for s in closed])

        await eventually(gone, timeout=TTL_S + 5)
        assert await client.state(done) is None
        assert (await client.state(waiting)).status == "pending"  # open: still retained
        shown = await asyncio.to_thread(improved, "show", done, "--json", "--nats",
                                        own_server.url)
        assert shown.returncode == 0, shown.stderr
        assert msgspec.json.decode(shown.stdout)["status"] == "applied"  # from its chain
