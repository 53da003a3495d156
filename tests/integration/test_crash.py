"""SIGKILL the daemon at random moments while thousands of proposals flow through JetStream: an
L0 mix applied by the reference RankingStore (in this process), L2 skills that wait for an
operator, and proposals rejected at triage. Afterwards every acknowledged proposal has reached
exactly one final state, nothing was decided or applied twice, and every chain verifies.

Seeded: `CRASH_SEED=<n>` replays a run (the seed is printed with the figures)."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from improved.client import connection
from improved.runtime import bus
from improved_reference.ranking_store import RankingStore
from tests.harness import (
    DaemonProcess,
    Publisher,
    kill_repeatedly,
    mix,
    settle_and_check,
    write_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

PROPOSALS = 3000
KILLS = 5
PUBLISH_S = 12.0  # publishing is paced over about this long, so the kills land mid-flow


def seeded() -> tuple[int, random.Random]:
    seed = int(os.environ.get("CRASH_SEED") or random.randrange(1 << 32))
    return seed, random.Random(seed)


@pytest.fixture
def durable_server(tmp_path):
    """A server of its own with `sync_interval: always`, as the daemon's embedded one runs."""
    server = bus.EmbeddedServer(tmp_path / "nats", bus.free_port(), sync="always")
    server.start()
    yield server
    server.stop()


def log_errors(daemon: DaemonProcess) -> int:
    return sum(1 for line in daemon.log.read_text(errors="replace").splitlines()
               if '"level": "error"' in line or "Traceback" in line)


@pytest.mark.timeout(300)
async def test_sigkill_at_random_moments_loses_and_repeats_nothing(durable_server, tmp_path):
    seed, rng = seeded()
    nc = await connection.connect(durable_server.url, "crash-test")
    svc = "crash"
    ranking = RankingStore(nc, svc)
    await ranking.start()
    daemon = DaemonProcess(durable_server.url, tmp_path / "daemon.log",
                           write_config(tmp_path / "improved.toml"))
    try:
        daemon.start()
        await daemon.ready()
        publisher = Publisher(nc)
        flow = asyncio.create_task(publisher.run(mix(svc, PROPOSALS, rng),
                                                 rate=PROPOSALS / PUBLISH_S))
        delays = await kill_repeatedly(daemon, KILLS, rng)
        await flow
        kills_done_while_publishing = publisher.last_ack is not None
        figures = await settle_and_check(nc, publisher.acked, ranking, timeout=200,
                                         attempted=publisher.attempted)
        print("\n" + figures.line(
            "crash, one daemon", kills_survived=daemon.kills, seed=seed, kill_delays=delays,
            publish_retries=publisher.retries, service_applies=ranking.applies,
            service_orders=ranking.orders,
            consumer=figures.consumer, log_errors=log_errors(daemon)))
        assert daemon.kills == KILLS and daemon.alive() and kills_done_while_publishing
        assert figures.proposals == PROPOSALS and figures.duplicates == 0
    finally:
        code = daemon.stop()
        await ranking.stop()
        await connection.close(nc)
    assert code == 0


@pytest.mark.timeout(300)
async def test_one_of_two_replicas_killed_repeatedly(durable_server, tmp_path):
    """Two daemon replicas share the consumer; one is SIGKILLed and restarted again and again
    while the other keeps running. The survivor carries the flow; the victim's unacknowledged
    messages come back to whoever fetches them after the ack wait."""
    seed, rng = seeded()
    nc = await connection.connect(durable_server.url, "crash-replicas-test")
    svc = "crash2"
    ranking = RankingStore(nc, svc)
    await ranking.start()
    config = write_config(tmp_path / "improved.toml")
    steady = DaemonProcess(durable_server.url, tmp_path / "steady.log", config, "steady")
    victim = DaemonProcess(durable_server.url, tmp_path / "victim.log", config, "victim")
    try:
        steady.start()
        await steady.ready()  # one after the other: the first creates the streams
        victim.start()
        await victim.ready()
        publisher = Publisher(nc)
        flow = asyncio.create_task(publisher.run(mix(svc, PROPOSALS, rng),
                                                 rate=PROPOSALS / PUBLISH_S))
        delays = await kill_repeatedly(victim, KILLS, rng)
        await flow
        figures = await settle_and_check(nc, publisher.acked, ranking, timeout=200,
                                         attempted=publisher.attempted)
        print("\n" + figures.line(
            "crash, two replicas", kills_survived=victim.kills, seed=seed, kill_delays=delays,
            steady_restarts=steady.starts - 1, publish_retries=publisher.retries,
            service_applies=ranking.applies, service_orders=ranking.orders,
            consumer=figures.consumer,
            log_errors=log_errors(steady) + log_errors(victim)))
        assert victim.kills == KILLS and steady.starts == 1 and steady.alive()
        assert figures.proposals == PROPOSALS and figures.duplicates == 0
    finally:
        codes = [steady.stop(), victim.stop()]
        await ranking.stop()
        await connection.close(nc)
    assert codes == [0, 0]
