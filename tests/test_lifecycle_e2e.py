"""The Recommendation lifecycle through the bus (DESIGN §4): supersession, the rejection ledger,
and expiry withdrawing an approval."""

from __future__ import annotations

import asyncio
import time

import pytest

from improved import subjects as S
from services.sdk import MeshClient

from .conftest import eventually
from .factories import skill_proposal
from .test_authority import Applier, publish, review, trailers

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def status_of(client, pid, status):
    state = await client.state(pid)
    return state if state is not None and state.status == status else None


async def test_new_content_supersedes_and_an_approval_never_carries_over(daemon, nc, svc):
    client = MeshClient(nc, svc)
    old = (await client.propose(skill_proposal(svc))).proposal_id
    await client.triage(old)
    await publish(nc, S.inbound_review(svc), review(old))
    await eventually(lambda: status_of(client, old, "approved"))  # no service: not applied

    newer = skill_proposal(svc, instructions="Read the text twice; write three bullets.")
    new = (await client.propose(newer)).proposal_id
    assert (await client.triage(new)).cause == "awaiting_operator"
    assert (await client.state(new)).status == "pending"

    await eventually(lambda: status_of(client, old, "pending"))  # approval withdrawn
    chain = await trailers(daemon, svc, old)
    assert chain[-1]["verdict"] == "superseded" and f"superseded_by:{new}" in chain[-1]["refs"]
    applier = Applier()
    sub = await client.serve_apply(applier)
    await client.triage(old)
    await asyncio.sleep(0.3)
    assert applier.orders == []  # the superseded content is never applied
    await sub.unsubscribe()


async def test_a_rejected_idea_is_not_surfaced_again_on_the_same_evidence(daemon, nc, svc):
    client = MeshClient(nc, svc)
    first = skill_proposal(svc, derived_from=["sha256:" + "a" * 64])
    pid = (await client.propose(first)).proposal_id
    await client.triage(pid)
    await publish(nc, S.inbound_review(svc), review(pid, verdict="reject", reason="no"))
    await eventually(lambda: status_of(client, pid, "rejected"))

    same = skill_proposal(svc, derived_from=["sha256:" + "a" * 64])  # new id, same evidence
    again = await client.propose(same)
    assert again.proposal_id != pid and again.status == "rejected"
    decision = await client.triage(again.proposal_id)
    assert (decision.verdict, decision.cause) == ("reject", "duplicate_rejected")

    refreshed = skill_proposal(svc, derived_from=["sha256:" + "b" * 64])
    reply = await client.propose(refreshed)
    assert reply.status == "pending"
    assert (await client.triage(reply.proposal_id)).cause == "awaiting_operator"


async def test_an_approval_expires_with_its_proposal(daemon, nc, svc):
    client = MeshClient(nc, svc)
    soon = int(time.time() * 1000) + 1500
    pid = (await client.propose(skill_proposal(svc, valid_to=soon))).proposal_id
    await client.triage(pid)
    await publish(nc, S.inbound_review(svc), review(pid))
    await eventually(lambda: status_of(client, pid, "approved"))
    await asyncio.sleep(max(0.0, (soon - time.time() * 1000) / 1000) + 0.2)

    applier = Applier()
    sub = await client.serve_apply(applier)
    decision = await client.triage(pid)
    assert (decision.verdict, decision.cause) == ("reject", "expired")
    assert (await client.state(pid)).status == "expired"
    await asyncio.sleep(0.3)
    assert applier.orders == []
    await sub.unsubscribe()
