"""Expiry as a computed status, end to end through the broker (issue 19, item 6).

A proposal waiting for an operator with a short `valid_to` is shown expired by `show` and is
no longer listed by `review` from its `valid_to` on; the daemon records the expiry on its chain
at `valid_to` (its sweep of the review index, not a later pass) so it leaves the index, the
retained state says expired, and an approval after `valid_to` is refused."""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.js.errors import NotFoundError

from improved.cli.queries import review_view
from improved.client import connection
from improved.client.sdk import MeshClient
from improved.core import signing
from improved.core.policy import Policy
from improved.protocol import subjects as S
from improved.runtime.daemon import Daemon
from tests.bus import Applier, daemon_config, eventually, publish, trailers
from tests.cli import improved
from tests.factories import now_ms, review, skill_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def _listed(url: str, svc: str) -> set[str]:
    queue, _ = await review_view(url, Policy())
    return {q["proposal_id"] for q in queue if q["service"] == svc}


async def _shown_status(url: str, pid: str) -> tuple[str, str]:
    """(the status `improved show` prints for a person, the one its JSON says)."""
    text = await asyncio.to_thread(improved, "show", "--nats", url, pid, "--format", "text")
    assert text.returncode == 0, text.stderr
    line = next(s for s in text.stdout.splitlines() if s.startswith("  state "))
    data = await asyncio.to_thread(improved, "show", "--nats", url, pid)
    assert data.returncode == 0, data.stderr
    return line.split()[1], json.loads(data.stdout)["status"]


async def _indexed(nc, svc: str, pid: str) -> bool:
    try:
        msg = await nc.jetstream().get_msg(S.STREAM_RECORDS, subject=S.review_entry(svc, pid),
                                           direct=True)
    except NotFoundError:
        return False
    return bool(msg.data)  # an empty message is the tombstone


async def _expiry_recorded(nc, svc: str, pid: str):
    from improved.runtime.store import Store

    chain = [b for _, b in await Store(nc).read_chain(svc, pid)]
    return next((t for t in chain if (t["to_stage"], t.get("verdict"), t.get("cause"))
                 == ("triage", "reject", "expired")), None)


async def test_a_waiting_proposal_expires_at_valid_to_and_leaves_the_queue(daemon, nc,
                                                                           nats_url, svc):
    client = MeshClient(nc, svc)
    applier = Applier()
    sub = await client.serve_apply(applier)
    valid_to = now_ms() + 6000  # room for two `improved show` runs on a loaded machine
    pid = (await client.propose(skill_proposal(svc, valid_to=valid_to))).proposal_id
    assert (await client.triage(pid)).cause == "awaiting_operator"
    assert pid in await _listed(nats_url, svc) and await _indexed(nc, svc, pid)
    assert await _shown_status(nats_url, pid) == ("pending", "pending")
    assert (await client.state(pid)).status == "pending"

    await asyncio.sleep(max(0.0, (valid_to - now_ms()) / 1000) + 0.05)
    # from valid_to on: expired wherever it is shown, and out of the queue
    assert pid not in await _listed(nats_url, svc)
    assert await _shown_status(nats_url, pid) == ("expired", "expired")

    # the daemon recorded it from its sweep at valid_to, not at a later pass; the bound leaves
    # room for a loaded machine, and is still under the periodic recount's CACHE_CHECK_S
    recorded = await eventually(lambda: _expiry_recorded(nc, svc, pid), timeout=5)
    assert valid_to <= recorded["at"] <= valid_to + 4000, recorded["at"] - valid_to
    assert recorded["observer_type"] == "rec:system"
    await eventually(lambda: _not(_indexed(nc, svc, pid)))
    state = await eventually(lambda: _status(client, pid, "expired"))
    assert state.status == "expired"

    # an approval after valid_to is refused on the chain, and nothing is applied
    late = review(pid)
    await publish(nc, S.inbound_review(svc), late)
    act = f"act:{signing.envelope_digest(late)}"

    async def answered():
        return next((t for t in await trailers(daemon, svc, pid) if act in t.get("refs", [])),
                    None)

    refused = await eventually(answered)
    assert refused["verdict"] == "refused" and "(not_awaiting_review)" in refused["reason"]
    assert (await client.state(pid)).status == "expired"
    assert applier.orders == []
    await sub.unsubscribe()


async def _not(check) -> bool:
    return not await check


async def _status(client: MeshClient, pid: str, status: str):
    state = await client.state(pid)
    return state if state is not None and state.status == status else None


async def test_with_no_daemon_running_expiry_is_still_shown_then_recorded_at_start(own_server):
    """The status is computed: with no daemon to record the expiry, `show` and `review` say
    it all the same; an approval sent meanwhile is refused once a daemon reads it, and the
    daemon's first sweep records the expiry and takes the proposal out of the index."""
    url = own_server.url
    config = daemon_config()
    conn = await connection.connect(url, "expiry-first")
    first = Daemon(conn, config)
    await first.start()
    svc = "expirysvc"
    client = MeshClient(conn, svc)
    valid_to = now_ms() + 1500
    pid = (await client.propose(skill_proposal(svc, valid_to=valid_to))).proposal_id
    assert (await client.triage(pid)).cause == "awaiting_operator"
    await eventually(lambda: _indexed(conn, svc, pid))
    await first.stop()
    await connection.close(conn)

    await asyncio.sleep(max(0.0, (valid_to - now_ms()) / 1000) + 0.05)
    nc = await connection.connect(url, "expiry-client")
    try:
        assert await _expiry_recorded(nc, svc, pid) is None  # nobody recorded it
        assert await _indexed(nc, svc, pid)  # the index still names it
        assert pid not in await _listed(url, svc)
        assert await _shown_status(url, pid) == ("expired", "expired")
        late = review(pid)
        await publish(nc, S.inbound_review(svc), late)

        conn = await connection.connect(url, "expiry-second")
        second = Daemon(conn, config)
        await second.start()
        try:
            await eventually(lambda: _expiry_recorded(nc, svc, pid), timeout=15)
            await eventually(lambda: _not(_indexed(nc, svc, pid)), timeout=15)
            act = f"act:{signing.envelope_digest(late)}"
            chain = await eventually(lambda: _with(second, svc, pid, act), timeout=15)
            verdicts = [(t["to_stage"], t.get("verdict")) for t in chain]
            assert ("triage", "approve") not in verdicts
            assert (await MeshClient(nc, svc).state(pid)).status == "expired"
        finally:
            await second.stop()
            await connection.close(conn)
    finally:
        await connection.close(nc)


async def _with(daemon, svc, pid, act):
    chain = await trailers(daemon, svc, pid)
    mine = [t for t in chain if act in t.get("refs", [])]
    if not mine:
        return None
    assert mine[0]["verdict"] == "refused" and "(not_awaiting_review)" in mine[0]["reason"]
    return chain
