"""Operator authority end to end: signed reviews, L3 grants bound to a content hash, and every
kind of act that must be refused — with its reason on the chain and the state unmoved."""

from __future__ import annotations

import asyncio
import base64

import msgspec
import pytest

from improved.client.sdk import MeshClient
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import Review, to_json
from tests.bus import Applier, applied_at_l2, eventually, publish, trailers
from tests.factories import grant, now_ms, review, skill_proposal
from tests.keys import ALICE, MALLORY

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def setup(nc, svc):
    client = MeshClient(nc, svc)
    applier = Applier()
    sub = await client.serve_apply(applier)
    return client, applier, sub


async def wait_trailers(daemon, svc, pid, n):
    async def enough():
        chain = await trailers(daemon, svc, pid)
        return chain if len(chain) >= n else None

    return await eventually(enough)


async def test_approval_then_grant_then_drift_then_revoke(daemon, nc, svc):
    client, applier, sub = await setup(nc, svc)
    first = skill_proposal(svc, change_class="L2")
    pid = (await client.propose(first)).proposal_id
    assert (await client.triage(pid)).cause == "awaiting_operator"

    # A signed approval applies it once, under alice's authority.
    await publish(nc, S.inbound_review(svc), review(pid))
    outcome = await eventually(lambda: client.outcome(pid))
    assert outcome.ok and outcome.authority == "operator:alice"
    assert applier.orders == [pid]
    state = await client.state(pid)
    assert state.status == "applied"
    chain = await trailers(daemon, svc, pid)
    assert [(t["to_stage"], t.get("verdict")) for t in chain] == [
        ("propose", None), ("triage", "defer"), ("triage", "approve"), ("apply", "dispatched"),
        ("apply", "applied")]
    assert chain[2]["observer_type"] == "human" and chain[2]["actor"] == "operator:alice"

    # A grant for exactly this content makes the next L3 proposal of it auto-apply.
    identity = canonical.skill_identity(first.proposal_data["skill"])
    name, sha = identity.split(":")
    await publish(nc, S.GRANTS, grant(identity, proposal=pid))

    async def granted():
        data = await daemon.store.last(S.grant_record(name, sha))
        return data and msgspec.json.decode(data)["active"]

    await eventually(granted)
    again = skill_proposal(svc, change_class="L3")
    pid3 = (await client.propose(again)).proposal_id
    decision = await client.triage(pid3)
    assert (decision.verdict, decision.gate_class) == ("accept", "L3")
    outcome3 = await eventually(lambda: client.outcome(pid3))
    assert outcome3.ok and outcome3.authority == "policy:auto"
    assert (await trailers(daemon, svc, pid3))[-1]["observer_type"] == "rec:policy"

    # One byte changed in the instructions: another hash, gated as L2.
    drifted = skill_proposal(svc, change_class="L3",
                             instructions=first.proposal_data["skill"]["instructions"] + "!")
    pid_d = (await client.propose(drifted)).proposal_id
    decision = await client.triage(pid_d)
    assert (decision.verdict, decision.cause, decision.gate_class) == ("defer", "no_grant", "L2")

    # A revocation makes the original hash wait again.
    await publish(nc, S.GRANTS, grant(identity, op="revoke"))

    async def revoked():
        data = await daemon.store.last(S.grant_record(name, sha))
        return data and not msgspec.json.decode(data)["active"]

    await eventually(revoked)
    pid_r = (await client.propose(skill_proposal(svc, change_class="L3"))).proposal_id
    decision = await client.triage(pid_r)
    assert (decision.cause, decision.gate_class) == ("no_grant", "L2")
    await asyncio.sleep(0.3)
    assert applier.orders == [pid, pid3]
    grant_chain = [b for _, b in await daemon.store.read_chain_at(S.grant_audit(sha))]
    assert [t["verdict"] for t in grant_chain] == ["grant", "revoke"]
    await sub.unsubscribe()


async def refused_with(daemon, svc, pid, n_before, code):
    chain = await wait_trailers(daemon, svc, pid, n_before + 1)
    last = chain[-1]
    assert last["verdict"] == "refused", last
    assert f"({code})" in last["reason"], last
    return chain


@pytest.mark.parametrize("case", ["unknown_key", "bad_signature", "unsigned",
                                  "principal_mismatch", "expired"])
async def test_forged_or_stale_approvals_are_refused_and_change_nothing(daemon, nc, svc, case):
    client, applier, sub = await setup(nc, svc)
    pid = (await client.propose(skill_proposal(svc))).proposal_id
    await client.triage(pid)
    before = await client.state(pid)
    if case == "unknown_key":
        env = review(pid, who=MALLORY)
    elif case == "bad_signature":
        env = review(pid)
        tampered = msgspec.json.decode(base64.b64decode(env.payload))
        tampered["reason"] = "approved, honest"
        env = msgspec.structs.replace(env, payload=base64.b64encode(
            msgspec.json.encode(tampered)).decode())
    elif case == "unsigned":
        env = Review(proposal_id=pid, verdict="approve", principal=ALICE[0], reason="trust me",
                     at=now_ms())
    elif case == "principal_mismatch":
        env = review(pid, principal="operator:bob")
    else:
        env = review(pid, at=now_ms() - 3 * 24 * 3600 * 1000)
    await publish(nc, S.inbound_review(svc), env)
    await refused_with(daemon, svc, pid, 2, case)
    after = await client.state(pid)
    assert (after.status, after.stage) == (before.status, "triage")
    assert after.status == "pending"
    assert applier.orders == []
    await sub.unsubscribe()


async def approved_once(daemon, nc, svc):
    """An L2 approved by ALICE and applied: (applier, subscription, proposal id, the approval's
    envelope, the chain's length after the apply) — what a replay then plays back."""
    client, applier, sub = await setup(nc, svc)
    pid = (await client.propose(skill_proposal(svc, target_ref="skill:summarize"))).proposal_id
    await client.triage(pid)
    env = review(pid)
    await publish(nc, S.inbound_review(svc), env)
    await eventually(lambda: client.outcome(pid))
    return applier, sub, pid, env, len(await trailers(daemon, svc, pid))


async def test_a_reused_envelope_is_refused_as_a_replay(daemon, nc, svc):
    applier, sub, pid, env, n = await approved_once(daemon, nc, svc)
    await publish(nc, S.inbound_review(svc), env)
    await refused_with(daemon, svc, pid, n, "replayed")
    await asyncio.sleep(0.2)
    assert applier.orders == [pid]
    assert (await MeshClient(nc, svc).state(pid)).status == "applied"
    await sub.unsubscribe()


async def test_an_approval_of_a_superseded_proposal_is_refused(daemon, nc, svc):
    client, applier, sub = await setup(nc, svc)
    old = (await client.propose(skill_proposal(svc))).proposal_id
    await client.triage(old)
    newer = skill_proposal(svc, instructions="Read it twice, then write three bullet points.")
    new = (await client.propose(newer)).proposal_id
    assert new != old
    chain = await wait_trailers(daemon, svc, old, 3)
    assert chain[2]["verdict"] == "superseded"  # marked when the new content arrived
    await publish(nc, S.inbound_review(svc), review(old))
    await refused_with(daemon, svc, old, 3, "superseded")
    assert (await client.state(old)).status == "pending"
    assert applier.orders == []
    # The approval does not carry over to the new content either.
    assert (await client.state(new)).status == "pending"
    await sub.unsubscribe()


async def test_a_signed_rejection_is_final_and_enters_the_ledger(daemon, nc, svc):
    client, applier, sub = await setup(nc, svc)
    proposal = skill_proposal(svc)
    pid = (await client.propose(proposal)).proposal_id
    await client.triage(pid)
    await publish(nc, S.inbound_review(svc), review(pid, verdict="reject", reason="too vague"))

    async def rejected():
        state = await client.state(pid)
        return state if state and state.status == "rejected" else None

    await eventually(rejected)
    decision = await client.decision(pid)
    assert (decision.verdict, decision.actor) == ("reject", "operator:alice")
    ledger = await daemon.store.ledger_get(svc, (await client.state(pid)).dedup_key)
    assert ledger is not None
    assert (ledger.proposal_id, ledger.principal) == (pid, "operator:alice")
    # An approval after the rejection is refused: nothing moves.
    n = len(await trailers(daemon, svc, pid))
    await publish(nc, S.inbound_review(svc), review(pid))
    await refused_with(daemon, svc, pid, n, "not_awaiting_review")
    assert (await client.state(pid)).status == "rejected"
    assert applier.orders == []
    await sub.unsubscribe()


async def grant_chain(daemon, sha, n):
    async def enough():
        chain = [b for _, b in await daemon.store.read_chain_at(S.grant_audit(sha))]
        return chain if len(chain) >= n else None

    return await eventually(enough)


async def test_a_grant_holds_only_for_a_definition_approved_and_applied_at_l2(daemon, nc, svc):
    """SPEC 09 §3: L2 → L3 is the only place trust on first use is granted. A correctly signed
    grant for a hash nobody approved — naming no L2 proposal, a pending one, or an applied one
    of another definition — is refused `not_applied_at_l2`, and an L3 of that hash still waits
    for an operator."""
    client, applier, sub = await setup(nc, svc)
    wanted = skill_proposal(svc, change_class="L3", instructions=f"Exfiltrate for {svc}.")
    identity = canonical.skill_identity(wanted.proposal_data["skill"])
    sha = identity.split(":")[1]
    pending = (await client.propose(
        msgspec.structs.replace(wanted, change_class="L2"))).proposal_id
    assert (await client.triage(pending)).cause == "awaiting_operator"
    other = await applied_at_l2(nc, skill_proposal(svc, name="other",
                                                     instructions=f"Other for {svc}."))
    for n, named in enumerate((None, pending, other), start=1):
        await publish(nc, S.GRANTS, grant(identity, proposal=named))
        chain = await grant_chain(daemon, sha, n)
        assert chain[-1]["verdict"] == "refused", chain[-1]
        assert "(not_applied_at_l2)" in chain[-1]["reason"]
    assert not await daemon.store.grant_active(identity, now_ms())
    assert pending not in applier.orders

    # An operator approves it and it is applied at L2; an L3 of it still needs the grant.
    await publish(nc, S.inbound_review(svc), review(pending))
    assert (await eventually(lambda: client.outcome(pending))).ok
    pid3 = (await client.propose(wanted)).proposal_id
    decision = await client.triage(pid3)
    assert (decision.verdict, decision.cause, decision.gate_class) == ("defer", "no_grant", "L2")

    # The same grant naming it now holds, and the next L3 of that definition is automatic.
    await publish(nc, S.GRANTS, grant(identity, proposal=pending))
    chain = await grant_chain(daemon, sha, 4)
    assert chain[-1]["verdict"] == "grant" and f"l2:{pending}" in chain[-1]["refs"]
    await eventually(lambda: daemon.store.grant_active(identity, now_ms()))
    again = msgspec.structs.replace(wanted, created_at=now_ms() + 1)
    pid4 = (await client.propose(again)).proposal_id
    assert (await eventually(lambda: client.outcome(pid4))).authority == "policy:auto"
    assert pid3 not in applier.orders
    await sub.unsubscribe()


async def test_grant_acts_are_verified_too(daemon, nc, svc):
    skill = skill_proposal(svc).proposal_data["skill"]
    identity = canonical.skill_identity({**skill, "description": f"for {svc}"})
    name, sha = identity.split(":")
    await publish(nc, S.GRANTS, grant(identity, who=MALLORY))

    async def refused():
        chain = [b for _, b in await daemon.store.read_chain_at(S.grant_audit(sha))]
        return chain if chain else None

    chain = await eventually(refused)
    assert chain[0]["verdict"] == "refused" and "(unknown_key)" in chain[0]["reason"]
    assert await daemon.store.last(S.grant_record(name, sha)) is None
    assert not await daemon.store.grant_active(identity, now_ms())


async def test_a_revocation_stops_an_apply_that_was_already_accepted(daemon, nc, svc):
    """Accepted under a grant while its service is down; revoked before the service returns:
    the apply never happens and the proposal waits as L2."""
    client = MeshClient(nc, svc)
    proposal = skill_proposal(svc, change_class="L3", instructions=f"Summarise for {svc}.")
    identity = canonical.skill_identity(proposal.proposal_data["skill"])
    name, sha = identity.split(":")

    async def grant_is(active):
        data = await daemon.store.last(S.grant_record(name, sha))
        return data is not None and msgspec.json.decode(data)["active"] is active

    applier = Applier()
    sub = await client.serve_apply(applier)
    l2 = await applied_at_l2(nc, proposal)
    await sub.unsubscribe()
    await publish(nc, S.GRANTS, grant(identity, proposal=l2))
    await eventually(lambda: grant_is(True))
    pid = (await client.propose(proposal)).proposal_id
    assert (await client.triage(pid)).verdict == "accept"
    await publish(nc, S.GRANTS, grant(identity, op="revoke"))
    await eventually(lambda: grant_is(False))

    applier = Applier()
    sub = await client.serve_apply(applier)
    decision = await client.triage(pid)
    assert (decision.verdict, decision.cause, decision.gate_class) == ("defer", "no_grant", "L2")
    await asyncio.sleep(0.3)
    assert applier.orders == []
    assert (await client.state(pid)).status == "pending"
    await sub.unsubscribe()


async def test_audit_rebuild_finds_retained_records_that_disagree_with_the_chain(
        daemon, nc, svc, nats_url):
    """Status is derived from the chain: a forged retained state is found and republished."""
    import subprocess
    import sys

    client = MeshClient(nc, svc)
    pid = (await client.propose(skill_proposal(svc))).proposal_id
    await client.triage(pid)
    state = await client.state(pid)
    await nc.jetstream().publish(S.proposal_state(svc, pid),
                                 to_json(msgspec.structs.replace(state, status="applied")),
                                 stream=S.STREAM_RECORDS)

    def rebuild(*extra):
        return subprocess.run([sys.executable, "-m", "improved.cli", "audit", "rebuild",
                               "--nats", nats_url, *extra], capture_output=True, text=True,
                              timeout=60)

    found = await asyncio.to_thread(rebuild)
    assert f"DIFFERS {pid}: the retained records say applied/triage, the chain says " \
        "pending/triage" in found.stdout
    assert found.returncode == 1
    fixed = await asyncio.to_thread(rebuild, "--write")
    assert "retained records republished" in fixed.stdout
    again = await asyncio.to_thread(rebuild)
    assert pid not in again.stdout
    assert (await client.state(pid)) == state


async def test_a_store_verifying_acceptance_applies_only_what_the_loop_accepted(daemon, nc, svc):
    """The skills store with the gate in the store: an operator-approved L2 and a granted L3
    apply through the loop (the chain shows their acceptance); a hand-sent order for content
    nobody approved is refused `not_accepted` and changes nothing."""
    from improved.core.propose import identify
    from improved.protocol.model import ApplyOrder
    from improved_reference.skills_store import SkillsStore
    from tests.bus import send

    store = SkillsStore(nc, svc, verify_acceptance=True)
    await store.start()
    try:
        client = MeshClient(nc, svc)
        own = f"Summarise for {svc}."  # grants are mesh-wide: a definition of this test's own
        first = skill_proposal(svc, instructions=own)
        pid = (await client.propose(first)).proposal_id
        await client.triage(pid)
        await publish(nc, S.inbound_review(svc), review(pid))
        out = await eventually(lambda: client.outcome(pid))
        assert out.ok, out.error
        identity = canonical.skill_identity(first.proposal_data["skill"])
        await publish(nc, S.GRANTS, grant(identity, proposal=pid))
        await eventually(lambda: daemon.store.grant_active(identity, now_ms()))
        again = skill_proposal(svc, change_class="L3", instructions=own)  # an L3 re-execution
        pid3 = (await client.propose(again)).proposal_id
        assert (await eventually(lambda: client.outcome(pid3))).ok
        stranger = skill_proposal(svc, name="unreviewed")
        sid, _ = identify(stranger)
        result, _ = await send(nc, svc, ApplyOrder(proposal_id=sid, proposal=stranger,
                                                   authority=ALICE[0], attempt=1))
        assert not result.ok and result.error.startswith("not_accepted:")
        assert store.applies == 1  # the L3 re-execution of the same definition wrote nothing
    finally:
        await store.stop()


async def test_replays_and_junk_do_not_grow_a_chain_without_bound(daemon, nc, svc):
    """A captured approval replayed a hundred times is recorded as a replay once; a hundred
    distinct unsigned reviews leave at most MAX_REFUSED_ACTS refusals. Nothing is applied
    twice, and the chain stays short."""
    from improved.core.authority import MAX_REFUSED_ACTS

    applier, sub, pid, env, n = await approved_once(daemon, nc, svc)
    for _ in range(100):
        await publish(nc, S.inbound_review(svc), env)
    for i in range(100):
        await publish(nc, S.inbound_review(svc),
                      {"proposal_id": pid, "verdict": "reject", "reason": f"junk {i}"})
    await asyncio.sleep(2.0)
    chain = await trailers(daemon, svc, pid)
    replays = [t for t in chain if "replayed" in t.get("reason", "")]
    assert len(replays) == 1
    assert n + 10 < len(chain) <= n + MAX_REFUSED_ACTS  # the junk was read, and capped
    assert applier.orders == [pid]
    await sub.unsubscribe()


async def test_an_approved_proposal_is_not_rejected(daemon, nc, svc):
    """OMS has no approved → rejected: an operator's reject of an approved proposal is refused
    on its chain (`not_awaiting_review`) and the approval stands; once applied, a rollback is
    the way back. Nothing serves `svc`'s apply, so the approval waits there."""
    from improved.core import signing

    client = MeshClient(nc, svc)
    pid = (await client.propose(skill_proposal(svc))).proposal_id
    assert (await client.triage(pid)).cause == "awaiting_operator"
    await publish(nc, S.inbound_review(svc), review(pid))

    async def approved():
        state = await client.state(pid)
        return state if state and state.status == "approved" else None

    await eventually(approved)
    reject = review(pid, verdict="reject", reason="changed my mind")
    await publish(nc, S.inbound_review(svc), reject)
    act = f"act:{signing.envelope_digest(reject)}"

    async def answered():
        chain = await trailers(daemon, svc, pid)
        return next((t for t in chain if act in t.get("refs", [])), None)

    refused = await eventually(answered)
    assert refused["verdict"] == "refused" and "(not_awaiting_review)" in refused["reason"]
    assert "approved" in refused["reason"] and "rollback" in refused["reason"]
    chain = await trailers(daemon, svc, pid)
    assert ("triage", "reject") not in [(t["to_stage"], t.get("verdict")) for t in chain]
    assert (await client.state(pid)).status == "approved"


@pytest.mark.parametrize("remembered", [True, False])
async def test_an_approval_on_another_services_subject_applies_nothing_whatever_is_cached(
        daemon, nc, svc, remembered):
    """`improve.triage.<svc>` names the service whose proposal a review decides: one published
    on another service's subject finds no such proposal there, whether or not this daemon
    happens to hold the record in memory, and moves nothing; on the right subject it does."""
    applier = Applier()
    client = MeshClient(nc, svc)
    sub = await client.serve_apply(applier)
    pid = (await client.propose(skill_proposal(svc))).proposal_id
    assert (await client.triage(pid)).cause == "awaiting_operator"
    if not remembered:
        daemon.engine.records.cache.clear()  # as another replica, or after a restart
    await publish(nc, S.inbound_review(f"{svc}-other"), review(pid))
    await asyncio.sleep(0.8)
    assert applier.orders == []
    assert not [t for t in await trailers(daemon, svc, pid) if t.get("verdict") == "approve"]
    assert (await client.state(pid)).status == "pending"
    await publish(nc, S.inbound_review(svc), review(pid))

    async def sent():
        return applier.orders

    await eventually(sent)
    await sub.unsubscribe()
