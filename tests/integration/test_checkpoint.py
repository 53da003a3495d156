"""Tamper evidence beyond single chains on a live daemon: the crisis a broken log puts the daemon
in until an operator's signed act resolves it (the checkpoints' pure rules are in
tests/unit/test_checkpoint.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import msgspec

from improved.client import connection
from improved.client.sdk import MeshClient
from improved.core.breaker import AUTONOMY_ID
from improved.core.signing import PAYLOAD_TYPES, sign
from improved.protocol import subjects as S
from improved.protocol.model import ApplyResult, CrisisAct, to_json
from improved.runtime.daemon import Daemon
from tests.bus import daemon_config, eventually, value
from tests.cli import improved
from tests.factories import rank_proposal
from tests.keys import ALICE, MALLORY


def resolve(crisis: str, who=ALICE):
    act = CrisisAct(op="resolve", crisis=crisis, principal=who[0], reason="log restored",
                    at=int(time.time() * 1000))
    return sign(PAYLOAD_TYPES["crisis"], to_json(act), who[1])


async def test_a_broken_log_means_crisis_until_an_operator_resolves_it(own_server, tmp_path):
    config = msgspec.structs.replace(daemon_config(), checkpoint_interval_s=0.0,
                                     data_dir=tmp_path / "data")
    nc = await connection.connect(own_server.url, "crisis")
    daemon = Daemon(nc, config)
    await daemon.start()
    svc = "cri"
    client = MeshClient(nc, svc)
    orders: list[str] = []

    async def applier(order):
        orders.append(order.proposal_id)
        return ApplyResult(ok=True, applied_id="x", rollbackable=False)

    sub = await client.serve_apply(applier)
    js = nc.jetstream()
    try:
        first = (await client.propose(rank_proposal(svc, key="a"))).proposal_id
        await eventually(lambda: _applied(client, first))
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None
        m = daemon.engine.metrics  # what the dashboard and the alerts read
        assert value(m, "improved_checkpoint_verified") == 1
        assert value(m, "improved_checkpoint_last_timestamp_seconds") > time.time() - 60

        # Someone with write access forges a trailer onto the proposal's chain.
        forged = {"proposal_id": first, "seq": 3, "from_stage": "apply", "to_stage": "apply",
                  "gate_class": "L0", "scope": "knowledge", "actor": "mallory",
                  "observer_type": "rec:system", "reason": "nothing to see", "at": 1,
                  "prev": "0" * 64, "hash": "0" * 64}
        await js.publish(S.audit(svc, first), to_json(forged))
        problem = await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key)
        assert problem is not None and first in problem
        state = await daemon.engine.autonomy.state(2**62)
        assert state.crisis.startswith("crisis-")
        assert value(m, "improved_crisis_open") == 1
        assert value(m, "improved_checkpoint_verified") == 0
        assert value(m, "improved_checkpoints_total", result="broken") == 1

        # No apply while in crisis, whatever the class.
        second = (await client.propose(rank_proposal(svc, key="b"))).proposal_id
        assert (await client.triage(second)).verdict == "accept"
        await asyncio.sleep(0.5)
        assert orders == [first]
        verify = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "improved.cli", "audit", "verify", "--nats",
                             own_server.url], capture_output=True, text=True, timeout=30)
        assert verify.returncode == 1 and "BROKEN" in verify.stdout

        # An untrusted key cannot resolve it (the refusal is only logged: `crisis resolve`
        # sees no verdict in time); a trusted operator can, and the command says so.
        await js.publish(S.GRANTS, to_json(resolve(state.crisis, who=MALLORY)))
        await asyncio.sleep(0.5)
        assert (await daemon.engine.autonomy.state(2**62)).crisis == state.crisis
        mallory = await _resolve_from_the_terminal(own_server.url, state.crisis, MALLORY,
                                                   tmp_path, "--timeout", "0.5")
        assert mallory.returncode == 1 and "no verdict within 0.5 s" in mallory.stderr
        assert "`improved status`" in mallory.stderr
        alice = await _resolve_from_the_terminal(own_server.url, state.crisis, ALICE, tmp_path)
        assert alice.returncode == 0, alice.stderr
        assert alice.stdout == (f"accepted: resolution of {state.crisis} signed by "
                                f"{ALICE[0]}: resolved; applies resume\n")
        assert not (await daemon.engine.autonomy.state(2**62)).crisis
        assert value(m, "improved_crisis_open") == 0
        await client.triage(second)
        await eventually(lambda: _applied(client, second))
        chain = [b for _, b in await daemon.store.read_chain_at(S.autonomy_audit(AUTONOMY_ID))]
        assert [t["verdict"] for t in chain][-2:] == ["crisis", "crisis_resolved"]
        assert chain[-1]["actor"] == "operator:alice"
    finally:
        await sub.unsubscribe()
        await daemon.stop()
        await connection.close(nc)


async def _resolve_from_the_terminal(url: str, crisis: str, who, tmp_path, *more: str):
    from cryptography.hazmat.primitives import serialization

    key = tmp_path / f"{who[0].replace(':', '_')}.pem"
    key.write_bytes(who[1].private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
    return await asyncio.to_thread(improved, "crisis", "resolve", crisis, "--reason",
                                   "investigated", "--key", str(key), "--principal", who[0],
                                   "--nats", url, *more)


async def _applied(client, pid):
    state = await client.state(pid)
    return state if state is not None and state.status == "applied" else None


async def test_a_full_verify_reads_on_past_a_broken_chain_holding_few_chains(
        own_server, tmp_path, monkeypatch):
    """The whole-log verify streams: with room for the state of only two chains at once it
    still verifies every chain (a dropped one is re-read when met again), names the broken one
    and reads on to the end, and counts every chain once."""
    from improved.cli.audit import chain_trust
    from improved.client import checkpointing

    config = msgspec.structs.replace(daemon_config(), checkpoint_interval_s=0.0,
                                     data_dir=tmp_path / "data")
    nc = await connection.connect(own_server.url, "stream-verify")
    daemon = Daemon(nc, config)
    await daemon.start()
    svc = "streamverify"
    client = MeshClient(nc, svc)

    async def applier(order):
        return ApplyResult(ok=True, applied_id="x", rollbackable=False)

    sub = await client.serve_apply(applier)
    try:
        # proposed together, so their trailers interleave and a dropped chain is met again
        replies = await asyncio.gather(*(client.propose(rank_proposal(svc, key=k))
                                         for k in "abcdefgh"))
        pids = [reply.proposal_id for reply in replies]
        for pid in pids:
            await eventually(lambda pid=pid: _applied(client, pid))
        forged = {"proposal_id": pids[1], "seq": 3, "from_stage": "apply", "to_stage": "apply",
                  "gate_class": "L0", "scope": "knowledge", "actor": "mallory",
                  "observer_type": "rec:system", "reason": "nothing to see", "at": 1,
                  "prev": "0" * 64, "hash": "0" * 64}
        await nc.jetstream().publish(S.audit(svc, pids[1]), to_json(forged))
        # a fifth chain after the forgery: the read goes on past the broken one
        last = (await client.propose(rank_proposal(svc, key="z"))).proposal_id
        await eventually(lambda: _applied(client, last))
    finally:
        await sub.unsubscribe()
        await daemon.stop()

    store = daemon.store
    view = await store.audit_view()
    trusted = daemon.engine.trust.trusted_daemons(daemon._checkpoint_key)
    trust = chain_trust([], trusted, config)

    opened = 0
    real_open = checkpointing._open

    async def counting_open(*args):
        nonlocal opened
        opened += 1
        return await real_open(*args)

    monkeypatch.setattr(checkpointing, "_open", counting_open)

    async def verify(max_runs: int) -> tuple[checkpointing.Since, list[str]]:
        nonlocal opened
        opened = 0
        monkeypatch.setattr(checkpointing, "MAX_RUNS", max_runs)
        named: list[str] = []
        since = await checkpointing.verify_since(
            store, checkpointing.empty_base(view), view, trust, trusted, [],
            every_chain=True, report=named.append)
        return since, named

    roomy, roomy_named = await verify(10_000)
    roomy_opened = opened
    tight, tight_named = await verify(2)
    assert opened > roomy_opened  # chains were dropped and met again
    await connection.close(nc)
    for since, named in ((roomy, roomy_named), (tight, tight_named)):
        assert since.broken == 1 and len(named) == 1 and pids[1] in named[0], named
        # read to the end, past the forgery: every trailer (a commit carries several)
        assert since.last_seq == view.last_seq and since.read >= view.last_seq
    # every chain of the shared server's log counted once, however little was held
    assert tight.chains == roomy.chains and tight.broken == roomy.broken
    assert tight.tree.root() == roomy.tree.root()
