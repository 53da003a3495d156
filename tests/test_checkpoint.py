"""Tamper evidence beyond single chains: signed checkpoints over the whole log, and the crisis
a broken log puts the daemon in until an operator's signed act resolves it."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import subprocess
import sys
import time

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.client.sdk import MeshClient
from improved.core import checkpoint
from improved.core.breaker import AUTONOMY_ID
from improved.core.signing import PAYLOAD_TYPES, sign
from improved.protocol import subjects as S
from improved.protocol.model import ApplyResult, CrisisAct, to_json
from improved.runtime import bus
from improved.runtime.daemon import Daemon

from .conftest import ALICE, MALLORY, daemon_config, eventually
from .factories import rank_proposal


def leaf(i: int) -> str:
    return hashlib.sha256(f"trailer {i}".encode()).hexdigest()


def test_merkle_root_follows_rfc_6962():
    assert checkpoint.merkle_root([]) == hashlib.sha256(b"").hexdigest()
    one = bytes.fromhex(leaf(0))
    assert checkpoint.merkle_root([leaf(0)]) == hashlib.sha256(b"\x00" + one).hexdigest()
    two = bytes.fromhex(leaf(1))
    expected = hashlib.sha256(b"\x01" + hashlib.sha256(b"\x00" + one).digest()
                              + hashlib.sha256(b"\x00" + two).digest()).hexdigest()
    assert checkpoint.merkle_root([leaf(0), leaf(1)]) == expected
    # three leaves split at the largest power of two below: (0, 1) and (2)
    left = bytes.fromhex(expected)
    right = hashlib.sha256(b"\x00" + bytes.fromhex(leaf(2))).digest()
    assert checkpoint.merkle_root([leaf(0), leaf(1), leaf(2)]) == \
        hashlib.sha256(b"\x01" + left + right).hexdigest()


@pytest.mark.parametrize("tamper", ["remove_chain", "alter", "reorder", "truncate", "sig"])
def test_a_checkpoint_detects_every_kind_of_tampering(tamper):
    key = Ed25519PrivateKey.generate()
    log = [leaf(i) for i in range(10)]
    cp = checkpoint.make(log, last_seq=10, at=1, key=key)
    assert checkpoint.check(log, cp) is None
    assert checkpoint.check(log + [leaf(99)], cp) is None  # later trailers are fine
    if tamper == "remove_chain":
        bad, where = [h for i, h in enumerate(log) if i not in (2, 5, 7)], "removed"
    elif tamper == "alter":
        bad, where = log[:4] + [leaf(42)] + log[5:], "altered"
    elif tamper == "reorder":
        bad, where = log[:3] + [log[4], log[3]] + log[5:], "reordered"
    elif tamper == "truncate":
        bad, where = log[:8], "removed"
    else:
        bad, where = log, "signature"
        cp = dataclasses.replace(cp, count=cp.count - 1)  # a forged statement, old signature
    problem = checkpoint.check(bad, cp)
    assert problem is not None and where in problem
    assert checkpoint.check(log, cp, trusted={"ed25519:someone-else"}) is not None



def resolve(crisis: str, who=ALICE):
    act = CrisisAct(op="resolve", crisis=crisis, principal=who[0], reason="log restored",
                    at=int(time.time() * 1000))
    return sign(PAYLOAD_TYPES["crisis"], to_json(act), who[1])


async def test_a_broken_log_means_crisis_until_an_operator_resolves_it(own_server, tmp_path):
    config = msgspec.structs.replace(daemon_config(), checkpoint_interval_s=0.0,
                                     data_dir=tmp_path / "data")
    nc = await bus.connect(own_server.url, "crisis")
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
        assert await daemon.engine.checkpoint(daemon._checkpoint_key) is None

        # Someone with write access forges a trailer onto the proposal's chain.
        forged = {"proposal_id": first, "seq": 3, "from_stage": "apply", "to_stage": "apply",
                  "gate_class": "L0", "scope": "knowledge", "actor": "mallory",
                  "observer_type": "rec:system", "reason": "nothing to see", "at": 1,
                  "prev": "0" * 64, "hash": "0" * 64}
        await js.publish(S.audit(svc, first), to_json(forged))
        problem = await daemon.engine.checkpoint(daemon._checkpoint_key)
        assert problem is not None and first in problem
        state = await daemon.engine.autonomy(2**62)
        assert state.crisis.startswith("crisis-")

        # No apply while in crisis, whatever the class.
        second = (await client.propose(rank_proposal(svc, key="b"))).proposal_id
        assert (await client.triage(second)).verdict == "accept"
        await asyncio.sleep(0.5)
        assert orders == [first]
        verify = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "improved.cli", "audit", "verify", "--nats",
                             own_server.url], capture_output=True, text=True, timeout=30)
        assert verify.returncode == 1 and "BROKEN" in verify.stdout

        # An untrusted key cannot resolve it; a trusted operator can.
        await js.publish(S.GRANTS, to_json(resolve(state.crisis, who=MALLORY)))
        await asyncio.sleep(0.5)
        assert (await daemon.engine.autonomy(2**62)).crisis == state.crisis
        await js.publish(S.GRANTS, to_json(resolve(state.crisis)))

        async def resolved():
            return not (await daemon.engine.autonomy(2**62)).crisis

        await eventually(resolved)
        await client.triage(second)
        await eventually(lambda: _applied(client, second))
        chain = [b for _, b in await daemon.store.read_chain_at(S.autonomy_audit(AUTONOMY_ID))]
        assert [t["verdict"] for t in chain][-2:] == ["crisis", "crisis_resolved"]
        assert chain[-1]["actor"] == "operator:alice"
    finally:
        await sub.unsubscribe()
        await daemon.stop()
        await bus.close(nc)


async def _applied(client, pid):
    state = await client.state(pid)
    return state if state is not None and state.status == "applied" else None
