"""The review index (issue 16.2): `improved review` reads one retained entry per open item,
not the history; the chain still decides what is listed; a broker restart over file records
refills nothing; the pending-reviews metric is the index's count on every replica."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js.errors import NotFoundError

from improved.cli.queries import review_queue, review_view
from improved.client import connection
from improved.client.sdk import MeshClient
from improved.core.policy import Policy
from improved.protocol import subjects as S
from improved.protocol.model import ReviewEntry, to_json
from improved.runtime.daemon import Daemon
from improved.runtime.provisioning import stream_configs
from improved.runtime.store import Store
from improved.runtime.upkeep import CACHE_CHECK_S
from tests.bus import daemon_config, eventually, publish, value
from tests.factories import now_ms, rank_proposal, review, skill_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def _listed(url: str, svc: str) -> tuple[set[str], str]:
    queue, source = await review_view(url, Policy())
    return {q["proposal_id"] for q in queue if q["service"] == svc}, source


async def _decided(client: MeshClient, pid: str) -> bool:
    return await client.decision(pid) is not None


async def _index_message(nc, svc: str, pid: str):
    try:
        return await nc.jetstream().get_msg(S.STREAM_RECORDS, subject=S.review_entry(svc, pid),
                                            direct=True)
    except NotFoundError:
        return None


async def test_review_lists_exactly_the_queued_proposals_and_drops_each_that_leaves(
        daemon, nc, nats_url, svc):
    client = MeshClient(nc, svc)
    approved = (await client.propose(skill_proposal(svc, name="approved"))).proposal_id
    rejected = (await client.propose(skill_proposal(svc, name="rejected"))).proposal_id
    stays = (await client.propose(skill_proposal(svc, name="stays"))).proposal_id
    surfaced = (await client.propose(skill_proposal(svc, name="idea",
                                                    change_class="L1"))).proposal_id
    superseded = (await client.propose(skill_proposal(svc, name="old",
                                                      instructions="v1"))).proposal_id
    l0 = (await client.propose(rank_proposal(svc))).proposal_id  # accepted; never queued
    open_items = {approved, rejected, stays, surfaced, superseded}
    assert await _listed(nats_url, svc) == (open_items, "index")
    assert await _index_message(nc, svc, l0) is None  # an L0 never costs an index write

    await publish(nc, S.inbound_review(svc), review(approved))
    await publish(nc, S.inbound_review(svc), review(rejected, verdict="reject"))
    newer = (await client.propose(skill_proposal(svc, name="old", instructions="v2",
                                                 created_at=now_ms() + 1))).proposal_id
    left = {approved, rejected, superseded}

    async def dropped():
        listed, _ = await _listed(nats_url, svc)
        return listed == open_items - left | {newer}

    await eventually(dropped)
    for pid in left:  # each is a tombstone now (once its pass settled): empty, with a TTL
        msg = await eventually(lambda pid=pid: _tombstone(nc, svc, pid))
        assert msg.headers["Nats-TTL"]
    assert {(e.service, e.proposal_id) for e in await daemon.store.read_index()
            if e.service == svc} == {(svc, p) for p in open_items - left | {newer}}


async def _tombstone(nc, svc: str, pid: str):
    msg = await _index_message(nc, svc, pid)
    return msg if msg is not None and not msg.data else None


async def test_a_hostile_index_entry_is_not_listed(daemon, nc, nats_url, svc):
    """The index is writable by whoever may publish on the records stream: it says where to
    look, and only what the chain says is queued is listed."""
    client = MeshClient(nc, svc)
    waiting = (await client.propose(skill_proposal(svc, name="waits"))).proposal_id
    done = (await client.propose(skill_proposal(svc, name="done"))).proposal_id
    await publish(nc, S.inbound_review(svc), review(done, verdict="reject"))
    await eventually(lambda: _status(client, done, "rejected"))
    made_up = "f" * 64
    js = nc.jetstream()
    for pid in (done, made_up):
        await js.publish(S.review_entry(svc, pid), to_json(ReviewEntry(
            proposal_id=pid, service=svc, since=now_ms())), stream=S.STREAM_RECORDS)
    await js.publish(S.review_entry(svc, "e" * 64), b"not json", stream=S.STREAM_RECORDS)
    assert await _listed(nats_url, svc) == ({waiting}, "index")


async def _status(client: MeshClient, pid: str, status: str) -> bool:
    state = await client.state(pid)
    return state is not None and state.status == status


async def test_a_tombstone_leaves_the_stream_after_its_ttl(own_server):
    nc = await connection.connect(own_server.url, "ttl-daemon")
    daemon = Daemon(nc, daemon_config())
    daemon.store.tombstone_ttl_s = 1
    await daemon.start()
    try:
        client = MeshClient(nc, "ttlsvc")
        pid = (await client.propose(skill_proposal("ttlsvc"))).proposal_id
        subject = S.review_entry("ttlsvc", pid)
        js = nc.jetstream()
        assert (await _index_message(nc, "ttlsvc", pid)).data
        await publish(nc, S.inbound_review("ttlsvc"), review(pid, verdict="reject"))
        await eventually(lambda: _status(client, pid, "rejected"))
        tombstone = await eventually(lambda: _index_message(nc, "ttlsvc", pid))
        assert not tombstone.data and tombstone.headers["Nats-TTL"] == "1"

        async def gone():
            info = await js.stream_info(S.STREAM_RECORDS, subjects_filter=subject)
            return not info.state.subjects

        await eventually(gone, timeout=10)  # no delete marker is left either
        assert await _index_message(nc, "ttlsvc", pid) is None
        assert await review_queue(own_server.url) == []
    finally:
        await daemon.stop()
        await connection.close(nc)


class _Refills:
    """Counts the daemon's refills (`Publisher.republish_all`)."""

    def __init__(self, daemon: Daemon):
        self.calls = 0
        original = daemon.engine.publisher.republish_all

        async def counted(*args, **kw):
            self.calls += 1
            return await original(*args, **kw)

        daemon.engine.publisher.republish_all = counted  # type: ignore[method-assign]


@pytest.mark.timeout(120)
async def test_a_broker_restart_with_file_records_refills_nothing(own_server):
    nc = await connection.connect(own_server.url, "restart-daemon")
    daemon = Daemon(nc, daemon_config(records_storage="file"))
    refills = _Refills(daemon)
    await daemon.start()
    client_nc = await connection.connect(own_server.url, "restart-client")
    try:
        client = MeshClient(client_nc, "restartsvc", timeout=1.0)
        before = (await client.propose(skill_proposal("restartsvc", name="a"))).proposal_id
        await eventually(lambda: daemon.store.filled())
        calls = refills.calls  # a first start on an empty stream: nothing to refill

        await asyncio.to_thread(own_server.stop)
        await asyncio.to_thread(own_server.start)

        async def proposed():
            try:
                return (await client.propose(skill_proposal("restartsvc", name="b"))).proposal_id
            except Exception:
                return None

        after = await eventually(proposed, timeout=30)

        async def both():
            try:
                return await _listed(own_server.url, "restartsvc") == ({before, after}, "index")
            except Exception:
                return False

        await eventually(both, timeout=10)
        await asyncio.sleep(CACHE_CHECK_S + 1)  # a records check has run since
        assert refills.calls == calls
        assert await daemon.store.filled()
    finally:
        await daemon.stop()
        await connection.close(client_nc)
        await connection.close(nc)


@pytest.mark.timeout(120)
async def test_an_upgrade_without_the_index_refills_once_and_builds_it(own_server):
    nc = await connection.connect(own_server.url, "upgrade")
    js = nc.jetstream()
    # the records stream as an earlier version provisioned it: no index subjects, no TTLs
    old = next(c for c in stream_configs() if c.name == S.STREAM_RECORDS)
    assert old.allow_msg_ttl and old.subject_delete_marker_ttl is None  # no markers left behind
    old.subjects = [s for s in old.subjects if s != S.REVIEW_FILTER]
    old.allow_msg_ttl = None
    await js.add_stream(old)
    changed = await Store(nc).ensure()
    assert any(c.startswith(f"updated stream {S.STREAM_RECORDS}") and "allow_msg_ttl" in c
               for c in changed), changed
    assert (await js.stream_info(S.STREAM_RECORDS)).config.allow_msg_ttl

    first = Daemon(nc, daemon_config())
    await first.start()
    client = MeshClient(nc, "upsvc")
    waiting = (await client.propose(skill_proposal("upsvc"))).proposal_id
    surfaced = (await client.propose(skill_proposal("upsvc", name="idea",
                                                    change_class="L1"))).proposal_id
    await first.stop()
    # what a deployment of the earlier version holds: its records, no index and no marker
    await js.purge_stream(S.STREAM_RECORDS, subject=f"{S.REVIEW}.>")
    assert (await client.state(waiting)) is not None
    assert (await _listed(own_server.url, "upsvc"))[1] == "chains"

    upgraded = Daemon(nc, daemon_config())
    refills = _Refills(upgraded)
    await upgraded.start()
    try:
        await eventually(lambda: upgraded.store.filled(), timeout=20)
        assert refills.calls == 1
        assert await _listed(own_server.url, "upsvc") == ({waiting, surfaced}, "index")
        assert {e.proposal_id for e in await upgraded.store.read_index()} == {waiting, surfaced}
    finally:
        await upgraded.stop()
    again = Daemon(nc, daemon_config())
    refills = _Refills(again)
    await again.start()
    try:
        await asyncio.sleep(0.5)
        assert refills.calls == 0  # once is enough
    finally:
        await again.stop()
        await connection.close(nc)


@pytest.mark.timeout(120)
async def test_the_metric_is_the_review_count_on_every_replica(own_server):
    conns = [await connection.connect(own_server.url, f"replica-{n}") for n in range(2)]
    replicas = [Daemon(c, daemon_config()) for c in conns]
    for d in replicas:
        await d.start()
    try:
        client = MeshClient(conns[0], "metricsvc")
        waiting = (await client.propose(skill_proposal("metricsvc"))).proposal_id
        await client.propose(skill_proposal("metricsvc", name="idea", change_class="L1"))
        await client.propose(rank_proposal("metricsvc"))  # L0: never queued

        async def agree(n: int):
            listed = await review_queue(own_server.url)
            counts = [value(d.engine.metrics, "improved_pending_reviews") for d in replicas]
            return len(listed) == n and counts == [n, n]

        started = time.monotonic()
        await eventually(lambda: agree(2), timeout=15)  # the replica that did not decide
        assert time.monotonic() - started < 15           # learns it at its next recount
        await publish(conns[0], S.inbound_review("metricsvc"), review(waiting, verdict="reject"))
        await eventually(lambda: agree(1), timeout=15)
    finally:
        for d in replicas:
            await d.stop()
        for c in conns:
            await connection.close(c)
