"""Idempotency on the proposal id: the same proposal twice, a redelivery, and a daemon killed
with SIGKILL mid-flight all end with one proposal, one decision, at most one apply, and a chain
without a duplicate trailer."""

from __future__ import annotations

import asyncio
import os
import signal as signals
import subprocess
import sys
from collections import Counter

import pytest

from improved.client import connection
from improved.client.sdk import MeshClient
from improved.core import audit, propose
from improved.protocol import subjects as S
from improved.protocol.model import to_json
from improved_reference.ranking_store import RankingStore
from tests.bus import eventually
from tests.factories import rank_proposal, skill_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")


def assert_clean_chain(pid: str, trailers: list[dict]) -> None:
    """One registration, one decision per triage event, at most one apply, no repeats."""
    assert audit.verify_chain(pid, trailers) is None
    stages = Counter(t["to_stage"] for t in trailers)
    assert stages["propose"] == 1
    assert sum(1 for t in trailers if t.get("verdict") == "applied") <= 1
    assert [t["seq"] for t in trailers] == list(range(len(trailers)))


async def test_the_same_proposal_published_twice_is_one_proposal(daemon, nc, svc):
    store = RankingStore(nc, svc)
    await store.start()
    client = MeshClient(nc, svc)
    proposal = rank_proposal(svc, value=4)
    first = await client.propose(proposal)
    second = await client.propose(proposal)
    assert first.proposal_id == second.proposal_id
    # And twice more straight onto the stream, once past the broker's duplicate window id.
    await client.publish(proposal)
    await daemon.store.js.publish(S.inbound_proposal(svc), to_json(proposal),
                                  headers={"Nats-Msg-Id": "a-different-message-id"})
    pid = first.proposal_id
    await eventually(lambda: client.outcome(pid))
    await asyncio.sleep(0.5)
    trailers = [b for _, b in await daemon.store.read_chain(svc, pid)]
    assert_clean_chain(pid, trailers)
    assert [t.get("verdict") for t in trailers] == [None, "accept", "dispatched", "applied"]
    assert store.applies == 1
    await store.stop()


async def test_a_squatted_message_id_does_not_make_a_proposal_vanish(daemon, nc, svc):
    """Someone publishes junk first under the ids a victim's proposal might use — its
    proposal id, and its id with any suffix — : the victim's proposal, published after, is
    still taken and applied (the id names the exact bytes; junk cannot take it)."""
    store = RankingStore(nc, svc)
    await store.start()
    client = MeshClient(nc, svc)
    proposal = rank_proposal(svc, key="squatted", value=9)
    pid, _ = propose.identify(proposal)
    for squat in (pid, f"{pid}.{'0' * 32}", S.message_id(pid, b"junk")):
        await daemon.store.js.publish(S.inbound_proposal(svc), b"junk",
                                      headers={"Nats-Msg-Id": squat})
    assert await client.publish(proposal) == pid
    assert (await eventually(lambda: client.outcome(pid))).ok
    assert store.applies == 1
    await store.stop()


async def test_a_redelivered_message_applies_nothing_twice(daemon, nc, svc):
    """The first deliveries find no service (nak → redelivery); the apply happens once the
    service is up, and the redeliveries leave no extra trailer."""
    client = MeshClient(nc, svc)
    pid = await client.publish(rank_proposal(svc, value=5))
    await eventually(lambda: client.decision(pid))
    await asyncio.sleep(0.6)  # at least one failed delivery
    store = RankingStore(nc, svc)
    await store.start()
    await eventually(lambda: _ok(client, pid), timeout=20)
    await asyncio.sleep(0.5)
    trailers = [b for _, b in await daemon.store.read_chain(svc, pid)]
    assert_clean_chain(pid, trailers)
    assert store.applies == 1
    await store.stop()


async def _ok(client, pid):
    outcome = await client.outcome(pid)
    return outcome if outcome is not None and outcome.ok else None


# -- a daemon process killed with SIGKILL and started again -------------------------------------


def start_daemon(url: str, tmp_path) -> subprocess.Popen:
    log = open(tmp_path / "daemon.log", "ab")  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "improved.cli", "--log-level", "warning", "run", "--nats", url,
         "--data-dir", str(tmp_path / "data")],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL,
        env={**os.environ, "IMPROVED_CONFIG": ""})


async def wait_ready(nc) -> None:
    async def answers():
        try:
            await nc.request(S.SPEC_GET, b"{}", timeout=0.5)
            return True
        except Exception:
            return False

    await eventually(answers, timeout=20)



async def test_a_daemon_killed_mid_flight_neither_loses_nor_repeats_a_step(own_server, tmp_path):
    nc = await connection.connect(own_server.url, "kill-test")
    svc = "killsvc"
    proc = start_daemon(own_server.url, tmp_path)
    try:
        await wait_ready(nc)
        store = RankingStore(nc, svc)
        await store.start()
        client = MeshClient(nc, svc)
        proposals = [rank_proposal(svc, key=f"k{i}", value=i) if i % 3 else
                     skill_proposal(svc, name=f"s{i}") for i in range(60)]
        pids = [await client.publish(p) for p in proposals]
        await asyncio.sleep(0.15)
        proc.send_signal(signals.SIGKILL)
        proc.wait()
        # Redeliver everything as well, as a publisher retrying after the crash would.
        for p in proposals[:20]:
            await client.publish(p)
        proc = start_daemon(own_server.url, tmp_path)
        await wait_ready(nc)

        async def all_final():
            states = [await client.state(pid) for pid in pids]
            return all(s is not None and (s.status == "applied" or s.change_class == "L2")
                       and s.stage in ("apply", "triage") for s in states)

        await eventually(all_final, timeout=60)
        await asyncio.sleep(0.5)
        from improved.runtime.store import Store

        reader = Store(nc)
        for pid, proposal in zip(pids, proposals, strict=True):
            trailers = [b for _, b in await reader.read_chain(svc, pid)]
            assert_clean_chain(pid, trailers)
            decisions = [t for t in trailers if t["to_stage"] == "triage"]
            assert len(decisions) == 1
            applied = await store.apply_count(pid)
            assert applied == (1 if proposal.change_class == "L0" else 0)
        assert store.applies == 40
        await store.stop()
    finally:
        proc.send_signal(signals.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        await connection.close(nc)


async def test_a_stopped_daemon_exits_zero_and_a_second_start_is_harmless(own_server, tmp_path):
    nc = await connection.connect(own_server.url, "restart-test")
    first = start_daemon(own_server.url, tmp_path)
    second = start_daemon(own_server.url, tmp_path)
    try:
        await wait_ready(nc)

        async def both_ready():
            return (tmp_path / "daemon.log").read_text().count("ready as improved:") == 2

        await eventually(both_ready, timeout=30)
        client = MeshClient(nc, "twice")
        reply = await client.propose(skill_proposal("twice"))
        assert reply.status == "pending"
        info = await nc.jetstream().stream_info(S.STREAM_AUDIT)
        assert info.config.deny_delete  # purged only to remove an exported, sealed epoch
    finally:
        for proc in (first, second):
            proc.send_signal(signals.SIGTERM)
        codes = [proc.wait(20) for proc in (first, second)]
        await connection.close(nc)
    assert codes == [0, 0]
    log = (tmp_path / "daemon.log").read_text()
    assert "Traceback" not in log, log


@pytest.mark.timeout(60)
async def test_a_message_held_past_the_ack_wait_is_kept_not_redelivered(own_server):
    """An apply that takes longer than the inbound consumer's ack wait (5 s): the daemon tells
    the broker the message is in progress, so it is never redelivered, and the service gets
    one order."""
    from improved.client.config import ApplySettings
    from improved.protocol.model import ApplyResult
    from improved.runtime.daemon import Daemon
    from improved.runtime.provisioning import INBOUND_ACK_WAIT_S
    from tests.bus import daemon_config

    conn = await connection.connect(own_server.url, "held-daemon")
    daemon = Daemon(conn, daemon_config(apply=ApplySettings(timeout_s=15.0, attempts=1)))
    nc = await connection.connect(own_server.url, "held-client")
    svc = "heldsvc"
    orders: Counter[str] = Counter()

    async def slow(order) -> ApplyResult:
        orders[order.proposal_id] += 1
        await asyncio.sleep(INBOUND_ACK_WAIT_S + 2)
        return ApplyResult(ok=True, applied_id="slow", inverse={"undo": 1}, rollbackable=True)

    try:
        await daemon.start()
        client = MeshClient(nc, svc)
        await client.serve_apply(slow)
        proposal = rank_proposal(svc)
        pid = propose.identify(proposal)[0]
        data = to_json(proposal)  # through the inbound stream, as the mesh publishes
        await nc.jetstream().publish(S.inbound_proposal(svc), data,
                                     headers={"Nats-Msg-Id": S.message_id(pid, data)})
        outcome = await eventually(lambda: client.outcome(pid), timeout=30)
        assert outcome.ok
        info = await nc.jetstream().consumer_info(S.STREAM_INBOUND, S.CONSUMER_INBOUND)
        # every delivery numbers the consumer's sequence; a redelivery numbers one more
        assert info.delivered.consumer_seq == info.delivered.stream_seq, info.delivered
        assert orders == {pid: 1}
    finally:
        await daemon.stop()
        await connection.close(conn)
        await connection.close(nc)
