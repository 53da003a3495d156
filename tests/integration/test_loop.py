"""The five-stage loop end to end, through a real nats-server, a running daemon and the
reference ranking store: what a mesh service sees for each class and guard."""

from __future__ import annotations

import asyncio

import pytest

from improved.client.sdk import MeshClient
from improved.core import audit
from improved_reference.ranking_store import RankingStore
from tests.bus import chain_ids, eventually
from tests.factories import rank_proposal, signal, skill_proposal
from tests.keys import CHECK, EVALUATOR

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def chain(daemon, svc, pid):
    return [body for _, body in await daemon.store.read_chain(svc, pid)]


async def started_store(nc, svc) -> RankingStore:
    store = RankingStore(nc, svc)
    await store.start()
    return store


async def test_l0_is_applied_exactly_once_and_its_chain_verifies(daemon, nc, svc):
    store = await started_store(nc, svc)
    client = MeshClient(nc, svc)
    reply = await client.propose(rank_proposal(svc, value=2.5))
    pid = reply.proposal_id

    outcome = await eventually(lambda: client.outcome(pid))
    assert outcome.ok and outcome.rollbackable
    assert outcome.authority == "policy:auto"
    assert await store.value("search.title_boost") == 2.5
    state = await eventually(lambda: _status(client, pid, "applied"))
    assert state.stage == "apply"

    await asyncio.sleep(0.3)  # the inbound consumer also sees the message: still one apply
    assert store.applies == 1 and await store.apply_count(pid) == 1
    trailers = await chain(daemon, svc, pid)
    assert [(t["to_stage"], t.get("verdict")) for t in trailers] == [
        ("propose", None), ("triage", "accept"), ("apply", "dispatched"), ("apply", "applied")]
    # the dispatch is on the chain before the order leaves, under the authority it names
    assert "authority:policy:auto" in trailers[2]["refs"]
    assert trailers[-1]["observer_type"] == "rec:policy"
    assert audit.verify_chain(pid, trailers) is None
    await store.stop()


async def _status(client, pid, status):
    state = await client.state(pid)
    return state if state is not None and state.status == status else None


async def test_l1_is_surfaced_and_never_applied(daemon, nc, svc):
    store = await started_store(nc, svc)
    client = MeshClient(nc, svc)
    reply = await client.propose(rank_proposal(svc, change_class="L1"))
    decision = await client.triage(reply.proposal_id)
    assert decision.verdict == "accept" and decision.cause is None
    assert decision.gate_class == "L1"
    await asyncio.sleep(0.5)
    assert store.orders == 0
    state = await client.state(reply.proposal_id)
    assert state.status == "pending" and state.stage == "triage"
    await store.stop()


async def test_l2_waits_for_an_operator(daemon, nc, svc):
    store = await started_store(nc, svc)
    client = MeshClient(nc, svc)
    reply = await client.propose(skill_proposal(svc, change_class="L2"))
    decision = await client.triage(reply.proposal_id)
    assert (decision.verdict, decision.cause, decision.gate_class) == \
        ("defer", "awaiting_operator", "L2")
    await asyncio.sleep(0.3)
    assert store.orders == 0
    assert (await client.state(reply.proposal_id)).status == "pending"
    await store.stop()


async def test_l3_without_a_grant_is_gated_as_l2(daemon, nc, svc):
    client = MeshClient(nc, svc)
    reply = await client.propose(skill_proposal(svc, change_class="L3"))
    decision = await client.triage(reply.proposal_id)
    assert (decision.verdict, decision.cause, decision.gate_class) == ("defer", "no_grant", "L2")
    state = await client.state(reply.proposal_id)
    assert state.change_class == "L3" and state.gate_class == "L2"


@pytest.mark.parametrize("change_class", ["L0", "L1", "L2", "L3", "L4"])
async def test_a_forbidden_target_is_rejected_whatever_the_class(daemon, nc, svc, change_class):
    store = await started_store(nc, svc)
    client = MeshClient(nc, svc)
    sneaky = ["notes/../_spec/2026-04-20-00-constitution.md"]
    proposal = (skill_proposal(svc, change_class=change_class, target_files=sneaky)
                if change_class == "L3" else
                rank_proposal(svc, change_class=change_class, target_files=sneaky))
    reply = await client.propose(proposal)
    assert reply.status == "rejected"
    decision = await client.triage(reply.proposal_id)
    assert (decision.verdict, decision.cause) == ("reject", "forbidden_target")
    assert "_spec/2026-04-20-00-constitution.md" in decision.rationale
    await asyncio.sleep(0.2)
    assert store.orders == 0
    await store.stop()


@pytest.mark.parametrize(("make", "change_class"), [
    (skill_proposal, "L0"),       # skills need at least L2
    (rank_proposal, "L3"),        # L3 fits skills only
])
async def test_a_class_below_the_minimum_is_rejected(daemon, nc, svc, make, change_class):
    client = MeshClient(nc, svc)
    reply = await client.propose(make(svc, change_class=change_class))
    decision = await client.triage(reply.proposal_id)
    assert (decision.verdict, decision.cause) == ("reject", "class_mismatch")
    assert (await client.state(reply.proposal_id)).status == "rejected"


async def test_a_scope_that_does_not_fit_the_target_is_rejected(daemon, nc, svc):
    client = MeshClient(nc, svc)
    reply = await client.propose(rank_proposal(svc, scope="operation"))
    decision = await client.triage(reply.proposal_id)
    assert (decision.verdict, decision.cause) == ("reject", "scope_mismatch")


async def test_an_expired_proposal_is_never_applied(daemon, nc, svc):
    store = await started_store(nc, svc)
    client = MeshClient(nc, svc)
    reply = await client.propose(rank_proposal(svc, valid_to=1_000))
    assert reply.status == "expired"
    assert (await client.triage(reply.proposal_id)).cause == "expired"
    await asyncio.sleep(0.2)
    assert store.orders == 0
    await store.stop()


async def test_self_confirmed_proposal_waits_for_an_independent_signal(daemon, nc, svc):
    store = await started_store(nc, svc)
    client = MeshClient(nc, svc)
    origin = f"mcp:{svc}-agent"
    proposal = rank_proposal(svc, value=7, signals=[
        signal(svc, f"{origin}:2", positive=True),
        signal(svc, f"{origin}:3", positive=True, kind="check"),
    ])
    reply = await client.propose(proposal)
    pid = reply.proposal_id
    decision = await client.triage(pid)
    assert (decision.verdict, decision.cause) == ("defer", "feedback_collapse")

    # More self-confirmation changes nothing, whatever actor it claims: unsigned, on the
    # proposer's own subject, it proves no other identity.
    for actor in (f"{origin}:9", f"mcp:{svc.upper()}-AGENT:9", "mcp:made-up-uuid:1", svc,
                  "operator:alice"):
        same = await client.refine(signal(svc, actor, proposal_id=pid))
        assert same.counted and not same.independent, actor
    world = await client.refine(signal(svc, "mcp:x:1", proposal_id=pid, kind="world",
                                       service="billing"))
    assert world.counted and not world.independent
    assert (await client.triage(pid)).cause == "feedback_collapse"
    await asyncio.sleep(0.3)
    assert store.orders == 0

    # An evaluator of another service, signing with its key, lets it through; applied once.
    other = await client.refine(signal(svc, EVALUATOR[0], proposal_id=pid), key=EVALUATOR[1])
    assert other.counted and other.independent
    outcome = await eventually(lambda: client.outcome(pid))
    assert outcome.ok
    assert await store.value("search.title_boost") == 7
    assert store.applies == 1
    learn = await client.learn_back(pid)
    assert learn.signals_counted == 9 and learn.independent == 1
    assert learn.verdict == "confirmed"
    trailers = await chain(daemon, svc, pid)
    assert [t["to_stage"] for t in trailers] == [
        "propose", "triage", *["learn-back"] * 7, "triage", "apply", "apply"]
    signed = trailers[-4]
    assert signed["envelope"]["payloadType"] == "application/vnd.improved.signal+json"
    assert f"emitter:{EVALUATOR[0]}" in signed["refs"]
    assert audit.verify_chain(pid, trailers) is None
    await store.stop()


async def test_an_independent_signal_on_the_outcomes_stream_also_releases_it(daemon, nc, svc):
    store = await started_store(nc, svc)
    client = MeshClient(nc, svc)
    proposal = rank_proposal(svc, value=3, signals=[signal(svc, f"mcp:{svc}-agent:5")])
    pid = (await client.propose(proposal)).proposal_id
    assert (await client.triage(pid)).cause == "feedback_collapse"
    await client.signal(signal(svc, CHECK[0], proposal_id=pid, kind="check"), key=CHECK[1])
    outcome = await eventually(lambda: client.outcome(pid))
    assert outcome.ok and store.applies == 1
    await store.stop()


async def test_a_refused_apply_fails_cleanly_and_changes_nothing(daemon, nc, svc):
    store = await started_store(nc, svc)
    client = MeshClient(nc, svc)
    bad = rank_proposal(svc, proposal_data={"set": {"key": "other.key", "value": 1}})
    pid = (await client.propose(bad)).proposal_id
    outcome = await eventually(lambda: client.outcome(pid))
    assert not outcome.ok and outcome.error
    assert await store.value("other.key") is None
    state = await client.state(pid)
    assert state.status == "pending" and state.stage == "apply"
    await store.stop()


async def test_an_unreachable_service_leaves_the_proposal_retryable(daemon, nc, svc):
    client = MeshClient(nc, svc)
    pid = (await client.propose(rank_proposal(svc, value=9))).proposal_id
    # No service serves <svc>.improve.apply: the daemon retries, then gives up for now.
    outcome = await eventually(lambda: client.outcome(pid), timeout=20)
    assert not outcome.ok and "unreachable" in outcome.error
    state = await client.state(pid)
    assert state.status == "pending"
    # each delivery recorded its dispatch and, since no service was there to receive the
    # order, withdrew it: nothing was applied, and the proposal is open to a decision
    verdicts = [t.get("verdict") for t in await chain(daemon, svc, pid)]
    assert verdicts[:2] == [None, "accept"] and len(verdicts) > 2
    assert verdicts[2:] == ["dispatched", "undelivered"] * ((len(verdicts) - 2) // 2)

    # The service comes up; a triage request carries the proposal on to its apply.
    store = await started_store(nc, svc)
    await client.triage(pid)
    outcome = await eventually(lambda: _applied(client, pid))
    assert store.applies == 1 and await store.value("search.title_boost") == 9
    await store.stop()


async def _applied(client, pid):
    outcome = await client.outcome(pid)
    return outcome if outcome is not None and outcome.ok else None


async def test_the_daemon_advertises_its_capabilities(daemon, nc):
    import msgspec

    reply = await nc.request("improved.spec.get", b"{}", timeout=5)
    spec = msgspec.json.decode(reply.data)
    assert "<svc>.improve.propose" in spec["capabilities"]
    # a proposal may come signed: the advertisement says how
    assert "DSSE envelope" in spec["capabilities"]["<svc>.improve.propose"]
    assert spec["topics"]["audit"] == "improve.audit.*.*"


async def test_observe_turns_independent_regressions_into_a_surfaced_proposal(daemon, nc, svc):
    """Three sessions report a negative metric on one target: the regression analyzer proposes
    an L1 investigation, which is surfaced (accepted) and never applied."""
    client = MeshClient(nc, svc)
    target = "rank:search.title_boost"
    for i in range(3):
        await client.signal(signal(svc, f"mcp:watcher-{i}:1", positive=False, kind="metric",
                                   target_ref=target, name="ctr", value=0.1 * i))

    async def surfaced():
        ids = await chain_ids(daemon, svc)
        if len(ids) != 1:
            return None
        return await client.decision(ids[0])

    decision = await eventually(surfaced)
    assert (decision.verdict, decision.gate_class) == ("accept", "L1")
    state = await client.state(decision.proposal_id)
    assert state.summary_text == f"investigate 3 negative ctr signals on {target}"
    assert state.status == "pending"


async def test_a_learn_back_signal_republishes_only_the_records_it_changes(daemon, nc, svc):
    """After an apply, a signal changes the proposal's state and its learn-back record; the
    decision and the outcome stay the messages they were (one retained message each, not one
    per later transition), and they still read as before."""
    from improved.protocol import subjects as S

    store = await started_store(nc, svc)
    client = MeshClient(nc, svc)
    pid = (await client.propose(rank_proposal(svc, value=4.5))).proposal_id
    await eventually(lambda: client.outcome(pid))
    js = nc.jetstream()

    async def seq(subject):
        return (await js.get_msg(S.STREAM_RECORDS, subject=subject, direct=True)).seq

    decision, outcome = await seq(S.triage_decision(svc, pid)), await seq(S.apply_outcome(svc, pid))
    state = await seq(S.proposal_state(svc, pid))
    await client.signal(signal(svc, CHECK[0], proposal_id=pid, kind="check"), key=CHECK[1])
    summary = await eventually(lambda: client.learn_back(pid))
    assert summary.signals_counted >= 1
    assert await seq(S.proposal_state(svc, pid)) > state
    assert await seq(S.triage_decision(svc, pid)) == decision
    assert await seq(S.apply_outcome(svc, pid)) == outcome
    assert (await client.outcome(pid)).ok and (await client.triage(pid)).verdict == "accept"
    await store.stop()
