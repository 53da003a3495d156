"""Replicas agree (issue 16 item 6): daemon replicas sharing one inbound consumer each see part
of the signals, yet fold them into the same analyzer windows and rank by the same learned
weights, which a restart keeps (runtime/observing.py, KV improved_windows and improved_learned).
Each test runs its own broker: the session daemon would otherwise be a third replica."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.api import DiscardPolicy

from improved.client import connection
from improved.client.sdk import MeshClient
from improved.core import observe, propose
from improved.core.authority import Act
from improved.core.signing import envelope_digest
from improved.protocol import subjects as S
from improved.protocol.model import ApplyResult, Signal
from improved.runtime import inbound as inbound_module
from improved.runtime.daemon import Daemon
from improved.runtime.provisioning import WINDOWS_MAX_KEYS
from tests.bus import daemon_config, eventually
from tests.factories import now_ms, review, signal

REGRESSION = observe.RegressionAnalyzer().id
STALE = observe.StaleSkillAnalyzer().id


async def replicas(url: str, n: int = 2) -> list[Daemon]:
    started = []
    for i in range(n):  # one after the other: the first creates the streams
        d = Daemon(await connection.connect(url, f"replica-{i}"), daemon_config())
        await d.start()
        started.append(d)
    return started


async def stop(*daemons: Daemon) -> None:
    for d in daemons:
        await d.stop()
        await connection.close(d.nc)


def negatives(svc: str, target: str, sessions: range, kind: str = "metric") -> list[Signal]:
    at = now_ms()
    return [signal(svc, f"mcp:watch-{i}:1", positive=False, kind=kind, target_ref=target,
                   name="ctr", value=0.1, at=at + i) for i in sessions]


async def proposals_of(d: Daemon, svc: str, analyzer: str) -> list[str]:
    """The ids of the proposals registered for `svc` by `analyzer`, from the audit chains."""
    chains = await d.store.all_chains()
    return sorted(pid for (s, pid), chain in chains.items() if s == svc
                  and f"analyzer:{analyzer}" in chain[0].get("refs", ()))


async def settled(d: Daemon, svc: str, analyzer: str, count: int) -> list[str]:
    """Wait for `count` proposals, then make sure no more come (the consumer idle a moment)."""
    found = await eventually(lambda: _at_least(d, svc, analyzer, count), timeout=15)
    await asyncio.sleep(1.0)
    assert await proposals_of(d, svc, analyzer) == found
    return found


async def _at_least(d: Daemon, svc: str, analyzer: str, count: int) -> list[str] | None:
    found = await proposals_of(d, svc, analyzer)
    return found if len(found) >= count else None


@pytest.mark.timeout(120)
async def test_three_sessions_split_across_two_replicas_make_one_proposal(own_server):
    """Negative metric signals from three sessions, two observed by one replica and one by the
    other (the shared consumer's split, made certain here): one L1 investigation, the same one
    a single process would have made. Then the same race at once, over twenty targets with a
    fourth session each: still exactly one proposal per target."""
    a, b = await replicas(own_server.url)
    try:
        svc = "split"
        s1, s2, s3 = negatives(svc, "rank:split.boost", range(3))
        await a.inbound.observe(svc, s1)
        await b.inbound.observe(svc, s2)
        await a.inbound.observe(svc, s3)
        (pid,) = await settled(a, svc, REGRESSION, 1)
        (alone,), _ = _fold(observe.RegressionAnalyzer(), [s1, s2, s3], svc)
        assert pid == _identify(alone)
        assert (await MeshClient(a.nc, svc).decision(pid)).gate_class == "L1"

        racing = "race"
        signals = [s for t in range(20) for s in negatives(racing, f"rank:race.{t}", range(4))]
        await asyncio.gather(*((a if i % 2 else b).inbound.observe(racing, s)
                               for i, s in enumerate(signals)))
        made = await settled(a, racing, REGRESSION, 20)
        assert len(made) == 20
    finally:
        await stop(a, b)


@pytest.mark.timeout(120)
async def test_signals_through_the_shared_consumer_make_one_proposal_per_target(
        own_server, monkeypatch):
    """Both replicas pulling one message at a time from the shared consumer, so the signals
    of a target are split between them: one proposal per target all the same."""
    monkeypatch.setattr(inbound_module, "PULL_BATCH", 1)
    a, b = await replicas(own_server.url)
    seen: dict[str, set[str]] = {}
    for d in (a, b):
        observed = d.inbound.observe

        async def noted(svc, sig, d=d, observed=observed):
            seen.setdefault(sig.target_ref, set()).add(d.actor)
            await observed(svc, sig)

        d.inbound.observe = noted
    try:
        svc = "viabus"
        client = MeshClient(a.nc, svc)
        for t in range(10):
            for s in negatives(svc, f"rank:bus.{t}", range(3)):
                await client.signal(s)
        assert len(await settled(a, svc, REGRESSION, 10)) == 10
        assert any(len(by) == 2 for by in seen.values()), seen  # some target was split
    finally:
        await stop(a, b)


@pytest.mark.timeout(120)
async def test_a_restart_between_signals_keeps_the_window(own_server):
    """Two signals, the daemon stopped and a new one started, the third signal: the window
    was in the bucket, not in the stopped process, and the proposal is made."""
    (first,) = await replicas(own_server.url, 1)
    svc = "restarted"
    s1, s2, s3 = negatives(svc, "rank:restart.boost", range(3))
    try:
        await first.inbound.observe(svc, s1)
        await first.inbound.observe(svc, s2)
    finally:
        await stop(first)
    (second,) = await replicas(own_server.url, 1)
    try:
        await second.inbound.observe(svc, s3)
        assert len(await settled(second, svc, REGRESSION, 1)) == 1
        # the window was spent on the proposal: it holds its evidence, no pending signals
        key = S.window_key(REGRESSION, svc, "rank:restart.boost")
        data, _ = await second.store.kv_read(second.store.windows, S.BUCKET_WINDOWS, key)
        window = observe.decode(data, observe.EMPTY)
        assert window.signals == () and window.proposed == tuple(sorted(
            (s1, s2, s3), key=lambda s: s.at))
        info = await second.store.js.stream_info(f"KV_{S.BUCKET_WINDOWS}")
        assert (info.config.max_msgs, info.config.max_msgs_per_subject) == (WINDOWS_MAX_KEYS, 1)
        assert info.config.discard == DiscardPolicy.OLD
    finally:
        await stop(second)


@pytest.mark.timeout(120)
async def test_an_approval_recorded_by_one_replica_is_in_the_others_weight(own_server):
    """A stale skill's archive proposal (L2) approved by an operator through replica A: replica
    B ranks by the same counts, a daemon started afterwards too, and counting the same trailer
    again (a retried write) changes nothing."""
    a, b = await replicas(own_server.url)
    svc = "weights"
    client = MeshClient(a.nc, svc)

    async def applied(order):
        return ApplyResult(ok=True, applied_id=f"archived:{order.proposal_id[:8]}")

    await client.serve_apply(applied)
    try:
        for s in negatives(svc, "skill:tired", range(3), kind="check"):
            await a.inbound.observe(svc, s)
        (pid,) = await settled(a, svc, STALE, 1)
        await eventually(lambda: _status(client, pid, "pending"))
        assert await b.observer.counts(STALE) == observe.NO_COUNTS
        env = review(pid)  # ALICE's signed approval, handled by replica A: A commits it
        handled = await a.acts.review(svc, pid, env, Act(envelope_digest(env), 1))
        assert handled.record.approved_by is not None
        counts = await b.observer.counts(STALE)
        assert (counts.accepted, counts.rejected) == (1, 0)
        assert await b.observer.weight(STALE) == pytest.approx(2 / 3)
        approve = next(t for t in await _trailers(a, svc, pid) if t.get("verdict") == "approve")
        assert counts.counted == (approve["hash"],)
        await b.observer.learn(STALE, True, approve["hash"])  # the same trailer, again
        assert await a.observer.counts(STALE) == counts
    finally:
        await stop(a, b)
    (later,) = await replicas(own_server.url, 1)
    try:
        assert await later.observer.counts(STALE) == counts
    finally:
        await stop(later)


def _fold(analyzer, signals, svc):
    window, found = observe.EMPTY, []
    for s in signals:
        window, candidates = analyzer.step(svc, window, s)
        found += candidates
    return found, window


def _identify(candidate) -> str:
    return propose.identify(candidate.proposal)[0]


async def _status(client: MeshClient, pid: str, status: str):
    state = await client.state(pid)
    return state is not None and state.status == status


async def _trailers(d: Daemon, svc: str, pid: str) -> list[dict]:
    return [body for _, body in await d.store.read_chain(svc, pid)]
