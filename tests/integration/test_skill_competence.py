"""Skill competence over the bus: the skills store counts, once each, the independent outcomes
the daemon recorded on an applied skill proposal's verified chain, as OMS supersessions of the
proposer's competence; it is asked on `<svc>.skills.practice` or woken by the learn-back
record, and answers competence and transfer requests. Forged evidence counts for nothing."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import pytest_asyncio

from improved.client import connection
from improved.client.sdk import MeshClient
from improved.core import signing
from improved.core.audit import Draft
from improved.core.trailers import ref
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import Origin, to_json
from improved.runtime.daemon import Daemon
from improved_reference.skill_competence import ALPHA
from improved_reference.skills_store import SkillsStore
from tests.bus import approve, daemon_config, daemon_key, eventually, outcome
from tests.factories import signal, skill_proposal
from tests.integration.test_forgery import _forge
from tests.keys import CHECK, EVALUATOR

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session")
async def store(nc, svc):
    """The test's own skills store, trusting the bus for who wrote its chains."""
    s = SkillsStore(nc, svc)
    await s.start()
    yield s
    await s.stop()

BOB = "did:key:z6MkBob"


async def ask(nc, subject: str, body) -> dict:
    data = body if isinstance(body, bytes) else to_json(body)
    return msgspec.json.decode((await nc.request(subject, data, timeout=5)).data)


async def applied_skill(nc, svc) -> tuple[str, str, str]:
    """An L2 skill proposed by `mcp:<svc>-agent:1` of `svc`, approved and applied: (pid,
    identity, holder)."""
    client = MeshClient(nc, svc)
    proposal = skill_proposal(svc, instructions=f"Summarise for {svc}.")
    pid = (await client.propose(proposal)).proposal_id
    await approve(nc, client, svc, pid)
    assert (await outcome(client, pid)).ok
    holder = f"service:{svc}/{proposal.origin.actor}"  # the agent, under its verified service
    return pid, canonical.skill_identity(proposal.proposal_data["skill"]), holder


async def competence(nc, svc, identity, holder, history=0) -> dict:
    return await ask(nc, S.skills_competence(svc),
                     {"skill": identity, "holder": holder, "history": history})


async def test_independent_outcomes_move_the_proposers_proficiency_once_each(daemon, nc, svc, store):
    pid, identity, holder = await applied_skill(nc, svc)
    client = MeshClient(nc, svc)
    # the proposer's own praise is recorded on the chain and counts for nothing
    mine = await client.refine(signal(svc, f"mcp:{svc}-agent:2", proposal_id=pid))
    assert mine.counted and not mine.independent
    # an evaluator of another service, signing: practice; the learn-back record wakes the
    # store, which reads the chain itself
    other = await client.refine(signal(svc, EVALUATOR[0], proposal_id=pid),
                                key=EVALUATOR[1])
    assert other.independent

    async def practised(n):
        head = (await competence(nc, svc, identity, holder))["competence"]
        return head if head and head["practice_count"] == n else None

    first = await eventually(lambda: practised(1))
    assert first["proficiency"] == pytest.approx(ALPHA)
    assert first["holder_did"] == holder and first["confidence"] == first["proficiency"]
    # a failure seen by a signed check lowers it, by a new grain, never in place
    await client.signal(signal(svc, CHECK[0], proposal_id=pid, positive=False,
                               kind="check"), key=CHECK[1])
    second = await eventually(lambda: practised(2))
    assert second["proficiency"] == pytest.approx(ALPHA * (1 - ALPHA))

    # asking again, or the record again, counts nothing twice
    again = await ask(nc, S.skills_practice(svc), {"proposal_id": pid})
    assert (again["outcomes"], again["counted_now"]) == (2, 0)
    assert again["holder"] == holder and again["skill"] == identity
    await nc.publish(S.learn_back(svc, pid), b"{}")
    await asyncio.sleep(0.5)
    chain = await competence(nc, svc, identity, holder, history=10)
    assert [g["practice_count"] for g in chain["history"]] == [1, 2]
    assert chain["history"][1]["derived_from"] == [canonical.content_address(
        chain["history"][0], canonical.SKILL)]


async def test_outcomes_before_the_apply_are_not_practice(daemon, nc, svc, store):
    """An independent signal that released the proposal is evidence about it, not practice."""
    client = MeshClient(nc, svc)
    proposal = skill_proposal(svc, instructions=f"Early {svc}.")
    pid = (await client.propose(proposal)).proposal_id
    await client.refine(signal(svc, EVALUATOR[0], proposal_id=pid), key=EVALUATOR[1])
    await approve(nc, client, svc, pid)
    assert (await outcome(client, pid)).ok
    reply = await ask(nc, S.skills_practice(svc), {"proposal_id": pid})
    assert (reply["outcomes"], reply["counted_now"], reply["competence"]) == (0, 0, None)


def _independent_outcome() -> Draft:
    """A learn-back trailer claiming an independent success, without any signal behind it."""
    return Draft(from_stage="learn-back", to_stage="learn-back", actor="agent:x:forger",
                 observer_type="rec:agent", verdict="signal", reason="forged success",
                 refs=(ref("signal", "0" * 64), ref("kind", "check"), ref("positive", True),
                       ref("independent", True), ref("at", 1), ref("emitter", "check:ci")))


async def test_a_forged_outcome_on_the_chain_counts_for_nothing_to_a_store_that_knows_the_daemon(
        own_server):
    """A correctly hashed trailer a bus participant appended, unsigned or signed by another
    key: a store told the daemon's key id (`--trust-daemon`) refuses the chain and counts
    nothing. (On a server of its own: the forged chain is a crisis for the daemon.)"""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    nc = await connection.connect(own_server.url, "competence-forgery")
    daemon = Daemon(nc, daemon_config())
    await daemon.start()
    svc = "skills-forged"
    store = SkillsStore(nc, svc)
    await store.start()
    store.daemons = frozenset({signing.keyid_of(signing.raw_public(daemon_key().public_key()))})
    try:
        pid, identity, holder = await applied_skill(nc, svc)
        honest = await ask(nc, S.skills_practice(svc), {"proposal_id": pid})
        assert (honest["outcomes"], honest["counted_now"]) == (0, 0)  # the chain verifies
        await _forge(nc, S.audit(svc, pid), pid, _independent_outcome())
        reply = await ask(nc, S.skills_practice(svc), {"proposal_id": pid})
        assert reply["error"]["code"] == "not_practice"
        assert "not signed by a daemon" in reply["error"]["message"]
        await _forge(nc, S.audit(svc, pid), pid, _independent_outcome(),
                     key=Ed25519PrivateKey.generate())
        reply = await ask(nc, S.skills_practice(svc), {"proposal_id": pid})
        assert reply["error"]["code"] == "not_practice"
        assert (await competence(nc, svc, identity, holder))["competence"] is None
    finally:
        await store.stop()
        await daemon.stop()
        await connection.close(nc)


async def test_a_forged_learn_back_record_is_only_a_wake_up(daemon, nc, svc, store):
    """Anyone may publish a learn-back record: the store reads the chain, which holds only the
    proposer's own signal, and counts nothing."""
    pid, identity, holder = await applied_skill(nc, svc)
    await MeshClient(nc, svc).refine(signal(svc, f"mcp:{svc}-agent:3", proposal_id=pid))
    await nc.publish(S.learn_back(svc, pid), to_json(
        {"proposal_id": pid, "verdict": "confirmed", "independent": 5}))
    await asyncio.sleep(0.5)
    assert (await competence(nc, svc, identity, holder))["competence"] is None


async def test_transfer_over_the_bus_gives_the_recipe_not_the_track_record(daemon, nc, svc, store):
    pid, identity, holder = await applied_skill(nc, svc)
    none = await ask(nc, S.skills_transfer(svc), {"skill": identity, "from": holder,
                                                  "to": BOB})
    assert none["error"]["code"] == "not_found"  # nothing practised yet: nothing to hand on
    await MeshClient(nc, svc).refine(signal(svc, EVALUATOR[0], proposal_id=pid),
                                     key=EVALUATOR[1])
    await eventually(lambda: _has_competence(nc, svc, identity, holder))
    moved = await ask(nc, S.skills_transfer(svc), {"skill": identity, "from": holder,
                                                   "to": BOB})
    grain = moved["grain"]
    assert (grain["holder_did"], grain["proficiency"], grain["practice_count"]) == \
        (BOB, 0.0, 0)
    assert grain["origin_did"] == holder
    held = (await competence(nc, svc, identity, BOB))["competence"]
    assert held == grain


async def _has_competence(nc, svc, identity, holder):
    return (await competence(nc, svc, identity, holder))["competence"]


@pytest.mark.parametrize("subject, body", [
    ("practice", b"not json"), ("practice", {}), ("practice", {"proposal_id": 7}),
    ("practice", {"proposal_id": "x" * 64}), ("practice", {"proposal_id": "a", "more": 1}),
    ("competence", {"skill": "sum"}), ("competence", {"skill": "s:1", "holder": "h"}),
    ("competence", {"skill": "s:" + "0" * 64, "holder": "h", "history": -1}),
    ("transfer", {"skill": "s:" + "0" * 64, "from": "a"}),
    ("transfer", {"skill": "nope", "from": "a", "to": "b"}),
])
async def test_malformed_requests_get_one_error_and_change_nothing(nc, svc, store, subject, body):
    reply = await ask(nc, f"{svc}.skills.{subject}", body)
    assert set(reply) == {"error"}, reply
    assert reply["error"]["code"] in ("invalid_value", "not_practice", "not_found")
    assert reply["error"]["message"] and "\n" not in reply["error"]["message"]


async def test_dependencies_must_be_skill_addresses(daemon, nc, svc):
    """OMS: each dependencies entry MUST be a Skill grain's content address; a name is
    refused at propose, naming the entry."""
    client = MeshClient(nc, svc)
    bad = skill_proposal(svc, name="composite")
    bad.proposal_data["skill"]["dependencies"] = ["mg:sha256:" + "a" * 64, "threat_modeling"]
    error = (await client.propose_raw(to_json(bad)))["error"]
    assert error["code"] == "invalid_value"
    assert error["field"] == "proposal_data.skill.dependencies[1]"
    assert "threat_modeling" in error["message"]
    good = skill_proposal(svc, name="composite")
    good.proposal_data["skill"]["dependencies"] = ["mg:sha256:" + "a" * 64, "b" * 64]
    assert (await client.propose(good)).proposal_id


async def test_a_proposer_cannot_move_another_services_agents_competence(daemon, nc, svc,
                                                                          store):
    """`origin.actor` is only recorded: a proposal of `svc` naming another service's agent
    practises `service:<svc>/<that name>`, a holder of `svc`'s own, never the other agent's."""
    other_agent = "mcp:billing-agent:1"
    client = MeshClient(nc, svc)
    proposal = skill_proposal(svc, instructions=f"Impersonate for {svc}.",
                              origin=Origin(actor=other_agent, service=svc))
    pid = (await client.propose(proposal)).proposal_id
    await approve(nc, client, svc, pid)
    assert (await outcome(client, pid)).ok
    await client.refine(signal(svc, EVALUATOR[0], proposal_id=pid, positive=False),
                        key=EVALUATOR[1])
    reply = await eventually(lambda: _counted(nc, svc, pid))
    assert reply["holder"] == f"service:{svc}/{other_agent}"
    identity = canonical.skill_identity(proposal.proposal_data["skill"])
    assert (await competence(nc, svc, identity, other_agent))["competence"] is None


async def _counted(nc, svc, pid):
    reply = await ask(nc, S.skills_practice(svc), {"proposal_id": pid})
    return reply if reply.get("outcomes") else None
