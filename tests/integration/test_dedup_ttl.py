"""A closed proposal's dedup head leaves the dedup bucket after `records_ttl_days`; an open
one's stays, and so does a head a newer proposal wrote. A proposal under the same dedup_key
after the head left is what its author expects: new, superseding nothing, and still refused
when an operator rejected the same idea on the same evidence (the ledger does not expire)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from nats.js import api as jsapi
from nats.js.errors import NotFoundError

from improved.client import connection
from improved.core import propose
from improved.protocol import subjects as S
from improved.runtime.store import Store
from tests.bus import daemon_with_records_ttl, eventually, publish, trailers
from tests.cli import improved
from tests.factories import rank_proposal, review, skill_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")

SVC = "dedupttl"
TTL_S = 2
STREAM = f"KV_{S.BUCKET_DEDUP}"


def dedup_of(proposal) -> str:
    return propose.identify(proposal)[1]


async def head(js, dedup: str) -> tuple[str, str] | None:
    """(the proposal the head under `dedup` names, its Nats-TTL header or ""), or None when
    the key is gone."""
    try:
        msg = await js.get_last_msg(STREAM, f"$KV.{S.BUCKET_DEDUP}.{S.dedup_key_of(SVC, dedup)}")
    except NotFoundError:
        return None
    return msgspec.json.decode(msg.data)["proposal_id"], (msg.headers or {}).get("Nats-TTL", "")


async def status_is(client, pid, status):
    state = await client.state(pid)
    return state is not None and state.status == status


@pytest.fixture
async def ttl_daemon(own_server):
    async with daemon_with_records_ttl(own_server.url, SVC, TTL_S, "dedup-ttl") as running:
        yield running


async def test_a_closed_proposals_dedup_key_leaves_and_an_open_ones_stays(ttl_daemon):
    daemon, nc, client = ttl_daemon
    js = nc.jetstream()
    first = rank_proposal(SVC, key="ttl.boost", value=1.0)
    waiting = skill_proposal(SVC, name="ttlwait")
    done = (await client.propose(first)).proposal_id
    open_ = (await client.propose(waiting)).proposal_id
    await eventually(lambda: client.outcome(done))
    assert (await client.state(done)).status == "applied"

    async def carries_the_ttl():
        return await head(js, dedup_of(first)) == (done, str(TTL_S))

    await eventually(carries_the_ttl)
    assert await head(js, dedup_of(waiting)) == (open_, "")  # open: kept, no TTL

    async def gone():
        return await head(js, dedup_of(first)) is None

    await eventually(gone, timeout=TTL_S + 5)
    assert await head(js, dedup_of(waiting)) == (open_, "")

    # new content under the same dedup_key: a new proposal, superseding nothing, applied
    again = rank_proposal(SVC, key="ttl.boost", value=2.0)
    assert dedup_of(again) == dedup_of(first)
    before = len(await trailers(daemon, SVC, done))
    reply = await client.propose(again)
    assert reply.proposal_id != done
    await eventually(lambda: client.outcome(reply.proposal_id))
    assert (await client.state(reply.proposal_id)).status == "applied"
    chain = await trailers(daemon, SVC, reply.proposal_id)
    assert not any(t.get("verdict") in ("superseded", "reject") for t in chain)
    assert len(await trailers(daemon, SVC, done)) == before  # the closed one is untouched
    assert (await head(js, dedup_of(again)))[0] == reply.proposal_id


async def test_a_rejection_outlives_its_dedup_head(ttl_daemon):
    """The rejection ledger does not expire: the same idea on the same evidence is refused
    after the rejected proposal's head left the bucket; new evidence is a new proposal."""
    daemon, nc, client = ttl_daemon
    js = nc.jetstream()
    first = skill_proposal(SVC, name="ttlrej", derived_from=["sha256:" + "a" * 64])
    pid = (await client.propose(first)).proposal_id
    await client.triage(pid)
    await publish(nc, S.inbound_review(SVC), review(pid, verdict="reject", reason="no"))
    await eventually(lambda: status_is(client, pid, "rejected"))

    async def gone():
        return await head(js, dedup_of(first)) is None

    await eventually(gone, timeout=TTL_S + 5)
    same = skill_proposal(SVC, name="ttlrej", derived_from=["sha256:" + "a" * 64])
    again = await client.propose(same)
    assert again.proposal_id != pid
    decision = await client.triage(again.proposal_id)
    assert (decision.verdict, decision.cause) == ("reject", "duplicate_rejected")

    refreshed = skill_proposal(SVC, name="ttlrej", derived_from=["sha256:" + "b" * 64])
    reply = await client.propose(refreshed)
    assert reply.status == "pending"
    assert (await client.triage(reply.proposal_id)).cause == "awaiting_operator"
    chain = await trailers(daemon, SVC, reply.proposal_id)
    assert not any(t.get("verdict") == "superseded" for t in chain)


async def test_a_head_a_newer_proposal_wrote_gets_no_ttl_from_the_olders_close(ttl_daemon):
    daemon, nc, client = ttl_daemon
    js = nc.jetstream()
    old = (await client.propose(skill_proposal(SVC, name="ttlnew", instructions="a"))).proposal_id
    newer = skill_proposal(SVC, name="ttlnew", instructions="b")
    new = (await client.propose(newer)).proposal_id

    async def superseded():
        return any(t.get("verdict") == "superseded" for t in await trailers(daemon, SVC, old))

    await eventually(superseded)  # the old one is closed: superseded before it ran
    assert await head(js, dedup_of(newer)) == (new, "")
    await eventually(lambda: status_is(client, new, "pending"))
    await asyncio.sleep(TTL_S + 1)
    assert await head(js, dedup_of(newer)) == (new, "")  # still there, and still no TTL


async def test_a_bucket_without_message_ttls_is_given_them(own_server):
    """An earlier version's dedup bucket (no allow_msg_ttl) is brought to take TTLs by a user
    allowed to change it, as `improved provision` is."""
    nc = await connection.connect(own_server.url, "dedup-ttl-ensure")
    try:
        js = nc.jetstream()
        await js.add_stream(jsapi.StreamConfig(
            name=STREAM, subjects=[f"$KV.{S.BUCKET_DEDUP}.>"], allow_rollup_hdrs=True,
            deny_delete=True, discard=jsapi.DiscardPolicy.NEW, max_msgs_per_subject=1,
            allow_direct=True, storage=jsapi.StorageType.FILE))
        assert not (await js.stream_info(STREAM)).config.allow_msg_ttl
        store = Store(nc)
        done = await store.ensure()
        assert f"updated bucket {S.BUCKET_DEDUP} (allow_msg_ttl)" in done
        assert store.dedup_ttl and (await js.stream_info(STREAM)).config.allow_msg_ttl
        again = Store(nc)
        assert f"updated bucket {S.BUCKET_DEDUP} (allow_msg_ttl)" not in await again.ensure()
        assert again.dedup_ttl
    finally:
        await connection.close(nc)


async def test_provision_sweep_gives_keys_closed_before_ttls_theirs(own_server, tmp_path):
    """Keys of proposals closed while daemons kept them for good (records_ttl_days 0) stay
    forever unless swept: `improved provision --sweep-dedup` gives a closed proposal's key the
    configured TTL, leaves an open one's as it is, and believes no head whose chain is missing.
    A second sweep finds nothing more to give."""
    async with daemon_with_records_ttl(own_server.url, SVC, 0, "dedup-sweep") as running:
        _, nc, client = running
        js = nc.jetstream()
        first = rank_proposal(SVC, key="sweep.boost", value=1.0)
        waiting = skill_proposal(SVC, name="sweepwait")
        done = (await client.propose(first)).proposal_id
        open_ = (await client.propose(waiting)).proposal_id
        await eventually(lambda: client.outcome(done))
        await eventually(lambda: status_is(client, done, "applied"))
        forged = "f" * 64  # a head naming a proposal no chain holds
        await js.publish(f"$KV.{S.BUCKET_DEDUP}.{S.dedup_key_of(SVC, 'forged')}",
                         msgspec.json.encode({"proposal_id": forged, "created_at": 1}))
        assert await head(js, dedup_of(first)) == (done, "")  # closed, kept for good

        config = tmp_path / "improved.toml"
        config.write_text(f"records_ttl_days = {TTL_S / 86400!r}\n")
        swept = await asyncio.to_thread(improved, "provision", "--nats", own_server.url,
                                        "--config", str(config), "--sweep-dedup")
        assert swept.returncode == 0, swept.stderr
        assert f"dedup keys: 1 of 3 (their proposals closed) given the TTL of {TTL_S} s" \
            in swept.stdout
        assert await head(js, dedup_of(first)) == (done, str(TTL_S))
        assert await head(js, dedup_of(waiting)) == (open_, "")
        assert await head(js, "forged") == (forged, "")

        again = await asyncio.to_thread(improved, "provision", "--nats", own_server.url,
                                        "--config", str(config), "--sweep-dedup")
        assert "dedup keys: 0 of 3" in again.stdout, again.stdout

        async def gone():
            return await head(js, dedup_of(first)) is None

        await eventually(gone, timeout=TTL_S + 5)
        assert await head(js, dedup_of(waiting)) == (open_, "")


async def test_a_sweep_with_records_kept_for_good_is_refused(own_server, tmp_path):
    config = tmp_path / "improved.toml"
    config.write_text("records_ttl_days = 0\n")
    refused = await asyncio.to_thread(improved, "provision", "--nats", own_server.url,
                                      "--config", str(config), "--sweep-dedup")
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0 and "records_ttl_days" in refused.stderr


async def test_a_proposal_closed_in_the_pass_that_claimed_it_writes_its_dedup_key_once(
        ttl_daemon):
    """The claim's create gives the head a closed proposal's TTL already: an L0 applied in the
    pass that registered it needs no second write at its close. One that stays open has the
    TTL taken off at the end of that pass, and gets it back when it closes."""
    daemon, nc, client = ttl_daemon
    js = nc.jetstream()
    before = (await js.stream_info(STREAM)).state.last_seq
    once = rank_proposal(SVC, key="ttl.once", value=1.0)
    pid = (await client.propose(once)).proposal_id
    await eventually(lambda: status_is(client, pid, "applied"))
    assert await head(js, dedup_of(once)) == (pid, str(TTL_S))
    assert (await js.stream_info(STREAM)).state.last_seq == before + 1

    waiting = skill_proposal(SVC, name="ttllease")
    open_ = (await client.propose(waiting)).proposal_id
    assert await head(js, dedup_of(waiting)) == (open_, "")  # open: the lease taken off
    await asyncio.sleep(TTL_S + 1)
    assert await head(js, dedup_of(waiting)) == (open_, "")  # and it stays
    await publish(nc, S.inbound_review(SVC), review(open_, verdict="reject", reason="no"))
    await eventually(lambda: status_is(client, open_, "rejected"))
    assert await head(js, dedup_of(waiting)) == (open_, str(TTL_S))  # closed: the TTL again


async def test_a_lease_left_by_a_claim_whose_pass_never_ended_is_taken_off(ttl_daemon):
    """A daemon that died between a leased claim and the end of its pass left the head with
    a closed proposal's TTL under a proposal that is not closed: the redelivered proposal's
    claim finds it, and the pass takes the TTL off, so an open proposal's head stays."""
    daemon, nc, client = ttl_daemon
    js = nc.jetstream()
    waiting = skill_proposal(SVC, name="ttlcrash")
    pid, dedup = propose.identify(waiting)[:2]
    await js.publish(f"$KV.{S.BUCKET_DEDUP}.{S.dedup_key_of(SVC, dedup)}",
                     msgspec.json.encode({"proposal_id": pid, "created_at": waiting.created_at}),
                     msg_ttl=3600, headers={"Nats-Expected-Last-Subject-Sequence": "0"})
    assert await head(js, dedup) == (pid, "3600")
    assert (await client.propose(waiting)).proposal_id == pid
    await eventually(lambda: status_is(client, pid, "pending"))
    assert await head(js, dedup) == (pid, "")
