"""Status is derived from the chain alone: a store with hundreds of proposals in every status
rebuilds, from the chains only, to exactly the live state."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter

from improved.client import connection
from improved.client.sdk import MeshClient
from improved.protocol import subjects as S
from improved.protocol.model import ApplyResult
from improved.runtime.daemon import Daemon
from tests.bus import daemon_config, eventually, publish
from tests.factories import rank_proposal, review, skill_proposal


async def test_rebuild_from_the_chains_equals_the_live_state(own_server):
    nc = await connection.connect(own_server.url, "rebuild")
    daemon = Daemon(nc, daemon_config())
    await daemon.start()
    svc = "rb"
    client = MeshClient(nc, svc)
    async def applier(order):
        return ApplyResult(ok=True, applied_id=f"a{order.proposal_id[:6]}",
                           inverse={"undo": order.proposal_id[:6]}, rollbackable=True)

    sub = await client.serve_apply(applier)
    expected: dict[str, str] = {}
    try:
        for i in range(60):  # applied
            p = rank_proposal(svc, key=f"a{i}")
            expected[(await client.propose(p)).proposal_id] = "applied"
        for i in range(60):  # pending, awaiting an operator
            p = skill_proposal(svc, name=f"w{i}")
            expected[(await client.propose(p)).proposal_id] = "pending"
        for i in range(40):  # rejected at triage
            p = skill_proposal(svc, name=f"r{i}", change_class="L0")
            expected[(await client.propose(p)).proposal_id] = "rejected"
        for i in range(40):  # expired
            p = rank_proposal(svc, key=f"e{i}", valid_to=1000)
            expected[(await client.propose(p)).proposal_id] = "expired"
        rejected, approved, rolled = [], [], []
        down = MeshClient(nc, "rb-down")
        for i in range(30):
            rejected.append((await client.propose(skill_proposal(svc, name=f"x{i}")))
                            .proposal_id)
            # no service serves "rb-down": its approved proposals stay approved
            approved.append((await MeshClient(nc, "rb-down").propose(
                skill_proposal("rb-down", name=f"y{i}"))).proposal_id)
        for pid in rejected:
            await publish(nc, S.inbound_review(svc), review(pid, verdict="reject"))
            expected[pid] = "rejected"
        for pid in approved:
            await publish(nc, S.inbound_review("rb-down"), review(pid))
            expected[pid] = "approved"
        applied = [pid for pid, s in expected.items() if s == "applied"][:30]
        for pid in applied:
            await publish(nc, S.inbound_review(svc), review(pid, verdict="rollback"))
            rolled.append(pid)
            expected[pid] = "rolled_back"

        async def settled():
            states = {pid: await (down if pid in approved else client).state(pid)
                      for pid in expected}
            return all(s is not None and s.status == expected[pid] for pid, s in states.items())

        await eventually(settled, timeout=60)

        async def given_up():  # rb-down's orders retried until the deliveries ran out
            outcomes = [await down.outcome(pid) for pid in approved]
            return all(o is not None and (o.error or "").startswith("unreachable")
                       for o in outcomes)

        await eventually(given_up, timeout=60)
        assert len(expected) == 260
        assert set(Counter(expected.values())) == {
            "applied", "pending", "approved", "rejected", "expired", "rolled_back"}

        result = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "improved.cli", "audit", "rebuild",
                             "--nats", own_server.url], capture_output=True, text=True,
            timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"{len(expected)} proposals rebuilt from their chains alone: " \
               f"{len(expected)} equal to the retained records, 0 differ, 0 not published" \
            in result.stdout
        # and the retained records say the same as the chains
        for pid, status in expected.items():
            assert (await (down if pid in approved else client).state(pid)).status == status
    finally:
        await sub.unsubscribe()
        await daemon.stop()
        await connection.close(nc)
