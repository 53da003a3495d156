"""The operator's queue survives broker restarts (issue 20).

A daemon with a few hundred proposals of history and proposals waiting for an operator or a
quorum of several ages (awaiting_operator, no_grant, awaiting_quorum, quorum_dissent); the
nats-server under it is stopped and started again on the same store and port, ten times, and
each time one new proposal is published while the daemon reconnects. Every time, within a few
seconds of the broker being back, `improved review` (its own query) lists every proposal the
chains say is waiting — the old ones and the new — and the pending-reviews metric agrees.

An earlier version's queue was read from a cache in memory that vanished with the broker; the
proposal published during the reconnect landed in the new, empty cache first, and a cache-loss
check that looked for an empty bucket took that one record for a full cache and never refilled
it: the older waiting proposals vanished from the queue for good. `review` reads the review
index, retained in the records stream on file storage with its completeness marker, so a
restart loses neither and nothing is refilled."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from improved.cli.queries import review_queue, review_view
from improved.client import connection
from improved.client.config import Policy
from improved.client.sdk import MeshClient
from improved.protocol import subjects as S
from improved.runtime.daemon import Daemon
from tests.bus import amendment, eventually, publish, quorum_config, quorum_reads, value
from tests.factories import skill_proposal, swap, vote
from tests.harness import Publisher, mix, wait_records

HISTORY = 300  # settled proposals (rejected at triage) around the waiting ones
ROUNDS = 10
BACK_S = 5.0  # the queue is whole again this soon after the broker is back


async def _queue(url: str) -> list[dict] | None:
    try:
        return await review_queue(url)
    except Exception:  # the broker still starting, the buckets not yet there
        return None


async def _propose_during_reconnect(client: MeshClient, svc: str, n: int) -> str:
    """One new L2 proposal, sent until the daemon has it (it is content-addressed, so a
    retry is the same proposal)."""
    proposal = skill_proposal(svc, name=f"late{n}")
    deadline = time.monotonic() + 30
    while True:
        try:
            return (await client.propose(proposal)).proposal_id
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


@pytest.mark.slow  # broker restarts, one after another: with the fault suites
@pytest.mark.timeout(150)
@pytest.mark.asyncio(loop_scope="session")
async def test_review_lists_every_waiting_proposal_after_each_broker_restart(own_server):
    config = quorum_config(await amendment(own_server.url))
    dnc = await connection.connect(own_server.url, "review-restart-daemon")
    daemon = Daemon(dnc, config)
    await daemon.start()
    nc = await connection.connect(own_server.url, "review-restart-client")
    svc = "waitsvc"
    client = MeshClient(nc, svc, timeout=1.0)
    waiting: dict[str, str] = {}  # proposal id -> the cause it waits for

    async def waits(proposal, cause: str) -> str:
        pid = await client.publish(proposal)
        d = await eventually(lambda: client.decision(pid, proposal.service))
        assert (d.verdict, d.cause) == ("defer", cause)
        waiting[pid] = cause
        return pid

    try:
        # Waiting proposals of several ages, with settled history around them.
        history = mix("histsvc", HISTORY, random.Random(20), l0=0.0, l2=0.0)
        filler = Publisher(nc)
        third = HISTORY // 3
        await waits(skill_proposal(svc, name="oldest"), "awaiting_operator")
        await filler.run(history[:third], rate=None)
        await waits(skill_proposal(svc, name="ungranted", change_class="L3"), "no_grant")
        await waits(swap("waitq", {"a": '{"v": 2}'}), "awaiting_quorum")
        await filler.run(history[third:2 * third], rate=None)
        dissented = await waits(swap("dissentq", {"b": '{"v": 2}'}), "awaiting_quorum")
        reads = await quorum_reads(daemon, "dissentq", dissented)
        await publish(nc, S.QUORUM, vote(reads, "agent-a", "model-x", "dissent"))
        await eventually(lambda: _decided(client, dissented, "dissentq", "quorum_dissent"))
        waiting[dissented] = "quorum_dissent"
        await filler.run(history[2 * third:], rate=None)
        await waits(skill_proposal(svc, name="newest"), "awaiting_operator")
        assert not await wait_records(nc, filler.acked, 60)
        queue = await eventually(lambda: _listing(own_server.url, waiting))
        assert {q["proposal_id"] for q in queue} == set(waiting)

        took = []
        for n in range(ROUNDS):
            await asyncio.to_thread(own_server.stop)
            await asyncio.to_thread(own_server.start)
            back = time.monotonic()
            pid = await _propose_during_reconnect(client, svc, n)
            waiting[pid] = "awaiting_operator"
            try:
                queue = await eventually(lambda: _listing(own_server.url, waiting),
                                         timeout=BACK_S)
            except AssertionError:
                listed = {q["proposal_id"] for q in (await _queue(own_server.url) or [])}
                missing = {p: c for p, c in waiting.items() if p not in listed}
                pytest.fail(f"round {n}: {len(missing)} of {len(waiting)} waiting proposals "
                            f"missing from the review queue {BACK_S}s after the broker came "
                            f"back: {missing}")
            took.append(time.monotonic() - back)
            assert {q["proposal_id"] for q in queue} == set(waiting)
            assert all(q["cause"] == waiting[q["proposal_id"]] for q in queue)
            # and `review` reads the review index (kept over the restart), and finds them all
            assert await eventually(lambda: _indexed(own_server.url, waiting), timeout=BACK_S)
            # the pending-reviews metric counts the same proposals
            async def counted():
                return value(daemon.engine.metrics, "improved_pending_reviews") == len(waiting)

            await eventually(counted, timeout=BACK_S)
        print(f"queue whole after each restart in {max(took):.2f}s at most "
              f"({HISTORY} proposals of history, {len(waiting)} waiting)")
    finally:
        await daemon.stop()
        await connection.close(nc)
        await connection.close(dnc)


async def _decided(client: MeshClient, pid: str, svc: str, cause: str):
    d = await client.decision(pid, svc)
    return d if d is not None and d.cause == cause else None


async def _indexed(url: str, waiting: dict[str, str]) -> bool:
    try:
        queue, source = await review_view(url, Policy())
    except Exception:
        return False
    return source == "index" and {q["proposal_id"] for q in queue} == set(waiting)


async def _listing(url: str, waiting: dict[str, str]) -> list[dict] | None:
    queue = await _queue(url)
    if queue is None or not set(waiting) <= {q["proposal_id"] for q in queue}:
        return None
    return queue
