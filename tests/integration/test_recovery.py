"""Retained records are derived state: when they are lost — memory storage across a broker
restart, or a purge — the daemon republishes them, and the review index, from the audit
chains. A daemon's own memory of a record is not refilled: it reads the chain when it needs it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from improved.cli.queries import review_view
from improved.client import archive, connection
from improved.client.config import AuditSettings
from improved.client.sdk import MeshClient
from improved.core.policy import Policy
from improved.protocol import subjects as S
from improved.runtime.daemon import Daemon
from improved.runtime.store import Store
from improved_reference.ranking_store import RankingStore
from tests.bus import daemon_config, eventually, serving_daemon
from tests.factories import rank_proposal, skill_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")



async def _applied(client, pid):
    state = await client.state(pid)
    return state if state is not None and state.status == "applied" else None


@pytest.mark.slow  # a broker restart and the refill after it: with the fault suites
async def test_memory_records_come_back_after_a_broker_restart(own_server):
    config = msgspec.structs.replace(daemon_config(), records_storage="memory")
    nc = await connection.connect(own_server.url, "recovery-daemon")
    daemon = Daemon(nc, config)
    await daemon.start()
    client_nc = await connection.connect(own_server.url, "recovery-client")
    client = MeshClient(client_nc, "recsvc")
    store = RankingStore(client_nc, "recsvc")
    await store.start()
    try:
        applied = (await client.propose(rank_proposal("recsvc", value=3))).proposal_id
        waiting = (await client.propose(skill_proposal("recsvc"))).proposal_id
        await eventually(lambda: _applied(client, applied))
        before = (await client.state(waiting), await client.decision(waiting))

        own_server.stop()
        own_server.start()

        async def back():
            try:
                return await _applied(client, applied)
            except Exception:
                return None

        assert await eventually(back, timeout=30)
        assert (await client.state(waiting), await client.decision(waiting)) == before
        assert (await client.outcome(applied)).ok
        assert store.applies == 1  # republishing replays records, never applies
        # the memory stream came back empty, so its marker did too: the refill rebuilt the index
        assert await eventually(lambda: _reviewed(own_server.url, waiting))
    finally:
        await store.stop()
        await daemon.stop()
        await connection.close(client_nc)
        await connection.close(nc)


async def _reviewed(url: str, pid: str) -> bool:
    try:
        queue, source = await review_view(url, Policy())
    except Exception:  # the broker still coming back
        return False
    return source == "index" and [q["proposal_id"] for q in queue] == [pid]


async def test_purged_records_are_republished_when_the_daemon_starts(own_server):
    nc = await connection.connect(own_server.url, "purge-daemon")
    daemon = Daemon(nc, daemon_config())
    await daemon.start()
    client = MeshClient(nc, "purgesvc")
    pid = (await client.propose(skill_proposal("purgesvc"))).proposal_id
    state = await client.state(pid)
    await daemon.stop()

    await nc.jetstream().purge_stream(S.STREAM_RECORDS)  # the index and its marker with them
    assert await client.state(pid) is None
    assert (await review_view(own_server.url, Policy()))[1] == "chains"  # not known whole

    again = Daemon(nc, daemon_config())
    await again.start()  # ready at once; the refill follows (it reads every chain)
    try:
        assert (await client.triage(pid)).cause == "awaiting_operator"  # decided from the chain
        assert await eventually(lambda: client.state(pid)) == state
        assert (await client.decision(pid)).cause == "awaiting_operator"
        assert await eventually(lambda: _reviewed(own_server.url, pid))
        # the triage request's pass read the record from the chain, and remembers it
        assert again.engine.records.held("purgesvc", pid)
        assert again.engine.records.cache[pid].status == "pending"
    finally:
        await again.stop()
        await asyncio.sleep(0)
        await connection.close(nc)


async def test_records_a_broker_outage_kept_from_being_published_are_published_again(
        own_server):
    """The chain moved but the retained records did not land (the broker went away between
    the append and the publish): nothing else will ever touch a proposal that now waits for
    an operator, so the daemon publishes its records again on its own."""
    nc = await connection.connect(own_server.url, "unpublished-daemon")
    daemon = Daemon(nc, daemon_config())
    await daemon.start()
    client = MeshClient(nc, "unpubsvc")
    real_send = daemon.store.send_record
    failing = {"on": True}

    async def outage(subject, record, ttl_s=None):
        if failing["on"] and subject.startswith(S.PROPOSALS):
            raise ConnectionError("broker went away")
        return await real_send(subject, record, ttl_s)

    daemon.store.send_record = outage
    try:
        with pytest.raises(Exception):  # noqa: B017 - the request path fails with the outage
            await client.propose(skill_proposal("unpubsvc"))
        [pid] = list(daemon.engine.publisher.unpublished)
        assert await client.state(pid) is None  # the chain holds it; watchers do not see it
        failing["on"] = False
        # what the watch loop (and a reconnect) runs; the inbound job's retry may beat it
        await daemon.engine.republish_unpublished()
        state = await eventually(lambda: client.state(pid))
        assert state.status == "pending"
        assert daemon.engine.publisher.unpublished == {}
    finally:
        daemon.store.send_record = real_send
        await daemon.stop()
        await connection.close(nc)


@dataclass
class _Sealed:
    """A deployment whose log is sealed up to its waiting proposal: `early` applied before
    the seal, `waiting` open (its first trailer holds the seal back), `late` applied after."""

    nc: Any
    config: Any
    client: MeshClient
    early: list[str]
    waiting: str
    state: Any  # the waiting proposal's retained state before any loss
    late: str


@asynccontextmanager
async def _sealed(url: str, tmp_path, svc: str) -> AsyncIterator[_Sealed]:
    """Fill a deployment of its own (daemon stopped once the epoch is sealed): four applied
    L0 proposals, one L2 left waiting, one L0 applied after it; the epoch sealed."""
    config = daemon_config(data_dir=tmp_path / "data", checkpoint_interval_s=0.0,
                           audit=AuditSettings(epoch_trailers=12, retention_days=0.0))
    async with serving_daemon(url, svc, svc, config) as (daemon, _, client):
        early = [(await client.propose(rank_proposal(svc, key=f"e{i}"))).proposal_id
                 for i in range(4)]
        for pid in early:
            await eventually(lambda pid=pid: _applied(client, pid))
        waiting = (await client.propose(skill_proposal(svc))).proposal_id
        late = (await client.propose(rank_proposal(svc, key="late"))).proposal_id
        await eventually(lambda: _applied(client, late))
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None
        await daemon.engine.checkpoints.seal_if_due(daemon._checkpoint_key)
        trusted = daemon.engine.trust.trusted_daemons(daemon._checkpoint_key)
        seal, problem = await archive.last_seal(daemon.store, trusted)
        assert problem is None and seal is not None
        assert seal.upto < (await daemon.store.read_chain(svc, waiting))[0][0]
        state = await client.state(waiting)
    nc = await connection.connect(url, f"{svc}-after")  # the daemon and its service stopped
    try:
        yield _Sealed(nc, config, MeshClient(nc, svc), early, waiting, state, late)
    finally:
        await connection.close(nc)


@asynccontextmanager
async def _refilled(sealed: _Sealed) -> AsyncIterator[tuple[Daemon, list[int]]]:
    """The records purged (the records, the index and the marker, as a broker restart loses
    them on memory storage), then a daemon started and its refill done: (the daemon, the
    chains each refill replayed)."""
    await sealed.nc.jetstream().purge_stream(S.STREAM_RECORDS)
    again = Daemon(sealed.nc, sealed.config)
    replayed: list[int] = []
    original = again.engine.publisher.republish_all

    async def counted(*args, **kw):
        replayed.append(await original(*args, **kw))
        return replayed[-1]

    again.engine.publisher.republish_all = counted  # type: ignore[method-assign]
    await again.start()
    try:
        # the daemon says when its work after ready is done, and the records are whole then
        await asyncio.wait_for(again.settled.wait(), 20)
        assert await again.store.filled()
        yield again, replayed
    finally:
        await again.stop()


async def test_the_refill_reads_the_chains_after_the_last_seal_not_the_history(
        own_server, tmp_path):
    """Every open proposal and every index member is after the last seal (`Scan.cut`), so the
    refill reads from there: what it costs follows the epoch. A chain closed before the seal
    gets no records back (they would have left the bus after `records_ttl_days`); its chain
    keeps everything, and `show` reads it."""
    async with _sealed(own_server.url, tmp_path, "sealsvc") as sealed, \
            _refilled(sealed) as (again, replayed):
        client = sealed.client
        assert replayed == [2]  # the waiting proposal and the late one: the epoch's chains
        assert await client.state(sealed.waiting) == sealed.state
        assert (await client.state(sealed.late)).status == "applied"
        assert await eventually(lambda: _reviewed(own_server.url, sealed.waiting))
        for pid in sealed.early:  # closed before the seal: no records back, the chain has all
            assert await client.state(pid) is None
            assert len(await again.store.read_chain("sealsvc", pid)) >= 2


async def test_a_forged_seal_never_narrows_the_refill(own_server, tmp_path):
    """A bus participant appends a seal of its own making past every chain, as if the log were
    sealed to its end: the refill would then read nothing. Its signature does not verify, so
    the daemon reads from the first trailer instead, and the open proposal's records and
    index entry come back all the same."""
    async with _sealed(own_server.url, tmp_path, "forgesvc") as sealed:
        js = sealed.nc.jetstream()
        _, genuine = await Store(sealed.nc).chain_head(archive.SEAL_SUBJECT)
        assert genuine is not None
        last = (await js.stream_info(S.STREAM_AUDIT)).state.last_seq
        forged = {**genuine, "refs": [f"upto:{last + 1000}" if r.startswith("upto:") else r
                                      for r in genuine["refs"]]}
        assert forged["refs"] != genuine["refs"]
        await js.publish(archive.SEAL_SUBJECT, msgspec.json.encode(forged))
        async with _refilled(sealed) as (_, replayed):
            assert replayed == [6]  # every chain, read from the first trailer
            assert await sealed.client.state(sealed.waiting) == sealed.state
            assert await eventually(lambda: _reviewed(own_server.url, sealed.waiting))
