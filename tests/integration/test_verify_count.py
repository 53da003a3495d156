"""What a proposal costs in signature checks: the daemon trusts what it wrote itself (the
record it committed, in its memory) and checks only what arrives from outside. An automatic
L0 costs no Ed25519 verification at all; an L2 costs one, the operator's signed review."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from improved.client.sdk import MeshClient
from improved.core import evidence, signing
from improved.protocol import subjects as S
from tests.bus import eventually, publish, serving_daemon
from tests.factories import rank_proposal, review, skill_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")

SVC = "vcount"


async def _status(client: MeshClient, pid: str, want: str) -> bool:
    state = await client.state(pid)
    return state is not None and state.status == want


async def test_a_proposal_costs_only_the_checks_of_what_came_from_outside(
        own_server, monkeypatch):
    checks: Counter[str] = Counter()
    writer_problem, verify = evidence.writer_problem, signing.TrustStore.verify

    def counted_writer(*args, **kwargs):
        checks["trailer"] += 1
        return writer_problem(*args, **kwargs)

    def counted_envelope(self, *args, **kwargs):
        checks["envelope"] += 1
        return verify(self, *args, **kwargs)

    monkeypatch.setattr(evidence, "writer_problem", counted_writer)
    monkeypatch.setattr(signing.TrustStore, "verify", counted_envelope)
    async with serving_daemon(own_server.url, SVC, "verify-count") as (_, nc, client):
        await asyncio.sleep(1.0)  # the start's own checks (indexes, checkpoint) are done
        checks.clear()
        l0 = [(await client.propose(rank_proposal(SVC, key=f"v{i}"))).proposal_id
              for i in range(20)]
        for pid in l0:
            await eventually(lambda pid=pid: _status(client, pid, "applied"))
        assert checks == Counter()  # nothing from outside but the proposals, which are bare

        l2 = [(await client.propose(skill_proposal(SVC, name=f"v{i}"))).proposal_id
              for i in range(10)]
        for pid in l2:
            await publish(nc, S.inbound_review(SVC), review(pid))
        for pid in l2:
            await eventually(lambda pid=pid: _status(client, pid, "applied"))
        assert checks == Counter(envelope=10)  # each operator's review, once
