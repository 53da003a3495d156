"""The circuit breaker and the autonomy switch, on a daemon of their own (they are mesh-wide:
tripping the session daemon's breaker would hold every other test back)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import msgspec

from improved.client import connection
from improved.client.sdk import MeshClient
from improved.core.breaker import AUTONOMY_ID
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import ApplyResult
from improved.runtime.daemon import Daemon
from tests.bus import applied_at_l2, daemon_config, eventually, publish, value
from tests.factories import grant, rank_proposal, review, skill_proposal


async def _status(client, pid, status):
    state = await client.state(pid)
    return state if state is not None and state.status == status else None


async def test_three_autonomous_rollbacks_hold_the_fourth_l3_back(own_server):
    nc = await connection.connect(own_server.url, "breaker")
    daemon = Daemon(nc, daemon_config())
    await daemon.start()
    svc = "brk"
    client = MeshClient(nc, svc)

    async def applier(order):
        return ApplyResult(ok=True, applied_id=f"v-{order.proposal_id[:8]}",
                           inverse={"undo": order.proposal_id}, rollbackable=True)

    sub = await client.serve_apply(applier)
    try:
        skill = skill_proposal(svc, change_class="L3").proposal_data["skill"]
        identity = canonical.skill_identity(skill)
        l2 = await applied_at_l2(nc, skill_proposal(svc))
        await publish(nc, S.GRANTS, grant(identity, proposal=l2))

        async def granted():
            return await daemon.store.grant_active(identity, int(time.time() * 1000))

        await eventually(granted)
        for _ in range(3):
            pid = (await client.propose(skill_proposal(svc, change_class="L3"))).proposal_id
            await eventually(lambda pid=pid: _status(client, pid, "applied"))
            await publish(nc, S.inbound_review(svc), review(pid, verdict="rollback",
                                                            reason="regressed"))
            await eventually(lambda pid=pid: _status(client, pid, "rolled_back"))
        fourth = (await client.propose(skill_proposal(svc, change_class="L3"))).proposal_id
        decision = await client.triage(fourth)
        assert (decision.verdict, decision.cause) == ("defer", "circuit_open")
        # an operator-gated proposal is not held back by the breaker
        l2 = (await client.propose(rank_proposal(svc, change_class="L2", target_ref="config:a",
                                                 scope="operation"))).proposal_id
        assert (await client.triage(l2)).cause == "awaiting_operator"
        chain = [b for _, b in await daemon.store.read_chain_at(S.autonomy_audit(AUTONOMY_ID))]
        assert [t["verdict"] for t in chain] == ["rollback"] * 3
        shown = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "improved.cli", "status", "--nats",
                             own_server.url], capture_output=True, text=True, timeout=30)
        status = json.loads(shown.stdout)
        assert status["breaker"].startswith("open until")
        assert status["autonomous_rollbacks_in_window"] == 3
        # what the dashboard and the breaker alert read (deploy/grafana, deploy/prometheus)
        m = daemon.engine.metrics
        assert value(m, "improved_breaker_paused_until_timestamp_seconds") > time.time()
        assert value(m, "improved_breaker_rollbacks") == value(m, "improved_breaker_threshold") == 3
        assert value(m, "improved_autonomy", state="circuit_open") == 1
        assert value(m, "improved_rollbacks_total", result="rolled_back", **{"class": "L3"}) == 3
        assert value(m, "improved_crisis_open") == 0
    finally:
        await sub.unsubscribe()
        await daemon.stop()
        await connection.close(nc)


async def test_autonomy_off_holds_l0_back_until_it_is_on_again(own_server):
    nc = await connection.connect(own_server.url, "autonomy")
    off = msgspec.structs.replace(daemon_config(), policy=msgspec.structs.replace(
        daemon_config().policy, autonomy="off"))
    daemon = Daemon(nc, off)
    await daemon.start()
    svc = "aut"
    client = MeshClient(nc, svc)
    applied: list[str] = []

    async def applier(order):
        applied.append(order.proposal_id)
        return ApplyResult(ok=True, applied_id="x", rollbackable=False)

    sub = await client.serve_apply(applier)
    try:
        pid = (await client.propose(rank_proposal(svc))).proposal_id
        assert (await client.triage(pid)).cause == "autonomy_off"
        assert applied == []
        await daemon.stop()

        daemon = Daemon(nc, daemon_config())  # autonomy on again, recorded on the chain
        await daemon.start()
        decision = await client.triage(pid)
        assert decision.verdict == "accept"
        await eventually(lambda: _status(client, pid, "applied"))
        assert applied == [pid]
        chain = [b for _, b in await daemon.store.read_chain_at(S.autonomy_audit(AUTONOMY_ID))]
        assert [t["verdict"] for t in chain] == ["autonomy_off", "autonomy_on"]
    finally:
        await sub.unsubscribe()
        await daemon.stop()
        await connection.close(nc)
