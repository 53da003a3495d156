"""L4 end to end through the real bus (SPEC 09 §6–§8): the last-known-good check before
anything changes, the all-or-none swap in the reference artefact store, the reversal recorded
before apply and run without a second approval, constitution edits prepared but never applied,
and the signed quorum."""

from __future__ import annotations

import asyncio
import sys

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.client.sdk import MeshClient
from improved.core import signing
from improved.protocol import subjects as S
from improved.protocol.model import (
    QuorumRecord,
    Vote,
    to_json,
)
from tests.bus import (
    approve,
    charter,
    eventually,
    outcome,
    publish,
    quorum_case,
    quorum_reads,
    started,
    trailers,
    trusted_service,
)
from tests.factories import now_ms, review, sha, swap, vote
from tests.keys import ALICE

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_an_unhealthy_last_known_good_refuses_the_apply_before_anything_changes(
        daemon, nc, svc):
    store = await started(nc, svc, {"a": '{"v": 1}', "b": "not json: the LKG is broken"})
    before = await store.manifest()
    client = MeshClient(nc, svc)
    pid = await client.publish(swap(svc, {"a": '{"v": 2}', "b": '{"v": 2}'}))
    await approve(nc, client, svc, pid)
    out = await outcome(client, pid)
    assert out.ok is False and out.error.startswith("lkg:") and "b" in out.error
    assert out.revert_proposal_id is None
    assert await store.manifest() == before
    assert store.orders == 0  # no ApplyOrder was ever sent
    verdicts = [t.get("verdict") for t in await trailers(daemon, svc, pid)]
    assert verdicts[-1] == "failed" and "lkg_verified" not in verdicts
    await store.stop()


async def test_a_failure_in_the_second_artefact_leaves_both_at_their_previous_version(
        daemon, nc, svc):
    store = await started(nc, svc, {"a": '{"v": 1}', "b": '{"v": 1}'})
    before = await store.manifest()
    client = MeshClient(nc, svc)
    # `b`'s new content fails its smoke test: the store swaps nothing
    pid = await client.publish(swap(svc, {"a": '{"v": 2}', "b": "{broken"}))
    await approve(nc, client, svc, pid)
    out = await outcome(client, pid)
    assert out.ok is False and "b" in out.error
    assert await store.manifest() == before
    assert await store.content("a") == b'{"v": 1}' and await store.content("b") == b'{"v": 1}'
    await store.stop()


async def test_a_successful_l4_apply_is_reverted_without_a_second_approval(daemon, nc, svc):
    store = await started(nc, svc, {"a": '{"v": 1}', "b": '{"v": 1}'})
    before = await store.manifest()
    client = MeshClient(nc, svc)
    pid = await client.publish(swap(svc, {"a": '{"v": 2}', "b": '{"v": 2}'}))
    await approve(nc, client, svc, pid)
    out = await outcome(client, pid)
    assert out.ok, out.error
    assert out.revert_proposal_id is not None
    assert await store.content("a") == b'{"v": 2}' and await store.content("b") == b'{"v": 2}'
    # the reversal was recorded on the chain before the apply
    chain = await trailers(daemon, svc, pid)
    verdicts = [t.get("verdict") for t in chain]
    assert verdicts.index("lkg_verified") < verdicts.index("applied")
    record = await daemon.engine.records.truth(svc, pid)
    assert record.revert_id == out.revert_proposal_id

    # anyone may publish the recorded reversal; it runs under alice's approval
    rev_id = await client.publish(record.revert)
    assert rev_id == out.revert_proposal_id
    rev_out = await outcome(client, rev_id)
    assert rev_out.ok, rev_out.error
    assert rev_out.authority == ALICE[0]
    assert await store.manifest() == before
    rev_chain = await trailers(daemon, svc, rev_id)
    assert "inherit" in [t.get("verdict") for t in rev_chain]
    assert not [t for t in rev_chain if t.get("verdict") == "approve"]  # no second approval
    state = await eventually(lambda: _status(client, pid, "rolled_back"))
    assert state.status == "rolled_back"
    await store.stop()


async def test_an_applied_reversal_emits_its_own_revert_proposal_id(daemon, nc, svc):
    """SPEC 09 §7.3: every applied L4 emits its revert_proposal_id, the reversal too; its own
    reversal, published by anyone, runs under the same approval and reinstalls the change."""
    store = await started(nc, svc, {"a": '{"v": 1}'})
    client = MeshClient(nc, svc)
    pid = await client.publish(swap(svc, {"a": '{"v": 2}'}))
    await approve(nc, client, svc, pid)
    out = await outcome(client, pid)
    assert out.ok, out.error
    rev_id = await client.publish((await daemon.engine.records.truth(svc, pid)).revert)
    rev_out = await outcome(client, rev_id)
    assert rev_out.ok, rev_out.error
    assert await store.content("a") == b'{"v": 1}'
    assert rev_out.revert_proposal_id is not None
    applied = [t for t in await trailers(daemon, svc, rev_id) if t.get("verdict") == "applied"]
    assert f"revert_proposal_id:{rev_out.revert_proposal_id}" in applied[0]["refs"]

    rev_record = await daemon.engine.records.truth(svc, rev_id)
    assert rev_record.revert_id == rev_out.revert_proposal_id
    again = await client.publish(rev_record.revert)
    assert again == rev_out.revert_proposal_id
    again_out = await outcome(client, again)
    assert again_out.ok and again_out.authority == ALICE[0], again_out.error
    assert again_out.revert_proposal_id is not None
    assert await store.content("a") == b'{"v": 2}'
    await store.stop()


async def _status(client, pid, wanted):
    state = await client.state(pid)
    return state if state is not None and state.status == wanted else None


async def test_a_look_alike_reversal_needs_its_own_approval(daemon, nc, svc):
    """Only the reversal recorded before apply inherits; other content under the same
    analyzer is an ordinary L4 proposal."""
    store = await started(nc, svc, {"a": '{"v": 1}'})
    client = MeshClient(nc, svc)
    pid = await client.publish(swap(svc, {"a": '{"v": 2}'}))
    await approve(nc, client, svc, pid)
    assert (await outcome(client, pid)).ok
    record = await daemon.engine.records.truth(svc, pid)
    forged = msgspec.structs.replace(record.revert, proposal_data={"restore": {"a": sha("evil")}})
    fid = await client.publish(forged)
    decision = await eventually(lambda: client.decision(fid))
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_operator")
    await store.stop()


async def test_an_operator_rollback_of_l4_runs_the_recorded_reversal(daemon, nc, svc):
    store = await started(nc, svc, {"a": '{"v": 1}'})
    before = await store.manifest()
    client = MeshClient(nc, svc)
    pid = await client.publish(swap(svc, {"a": '{"v": 2}'}))
    await approve(nc, client, svc, pid)
    assert (await outcome(client, pid)).ok
    await publish(nc, S.inbound_review(svc), review(pid, verdict="rollback"))
    await eventually(lambda: _status(client, pid, "rolled_back"))
    assert await store.manifest() == before
    await store.stop()


async def test_a_constitution_edit_is_prepared_and_never_applied(daemon, nc, svc):
    client = MeshClient(nc, svc)
    orders = []

    async def applier(order):
        orders.append(order)
        raise AssertionError("a constitution edit must never be dispatched")

    sub = await client.serve_apply(applier)
    proposal = charter(svc, amends="VII: IV.2 tiers")
    pid = (await client.propose(proposal)).proposal_id
    decision = await client.triage(pid)
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_operator")
    assert "never applies" in decision.rationale
    await publish(nc, S.inbound_review(svc), review(pid))
    await eventually(lambda: _status(client, pid, "approved"))
    await asyncio.sleep(0.5)
    assert orders == [] and await client.outcome(pid) is None
    without = msgspec.structs.replace(proposal, amends=None, created_at=now_ms())
    d2 = await client.triage((await client.propose(without)).proposal_id)
    assert (d2.verdict, d2.cause) == ("reject", "forbidden_target")
    await sub.unsubscribe()


async def test_an_l4_swap_that_fails_its_health_window_ends_rolled_back_and_not_applied(
        own_server, tmp_path):
    """The artefact store runs `app` (a Python program) and gives a swap a health window; the
    approved new version crashes at once. A daemon of its own: its order timeout leaves room
    for the window (the session daemon's is 1s)."""
    from improved.client import connection
    from improved.client.config import ApplySettings
    from improved.runtime.daemon import Daemon
    from improved_reference.artefact_store import ArtefactStore, digest_of
    from tests.bus import daemon_config

    svc = "health"
    nc = await connection.connect(own_server.url, "health")
    daemon = Daemon(nc, daemon_config(apply=ApplySettings(timeout_s=10.0, attempts=2,
                                                          max_deliveries=3)))
    await daemon.start()
    seen = tmp_path / "seen"
    good = f"import time\nopen({str(seen)!r}, 'a').write('v1\\n')\nwhile True: time.sleep(1)\n"
    bad = f"import sys\nopen({str(seen)!r}, 'a').write('v2\\n')\nsys.exit(1)\n"
    store = ArtefactStore(nc, svc, run={"app": f"{sys.executable} {{path}}"}, health_window=1.5)
    try:
        await store.start()
        await store.seed({"app": good})
        await eventually(lambda: _seen(seen, ["v1"]))
        client = MeshClient(nc, svc)
        pid = await client.publish(swap(svc, {"app": bad}, smoke={"app": "nonempty"}))
        await approve(nc, client, svc, pid)
        out = await outcome(client, pid)
        lkg = digest_of(good.encode())
        assert out.ok is False
        assert out.error == ("artefact app unhealthy after the swap: exited with code 1 within "
                             f"the 1.5s health window; rolled back, app is back at {lkg}")
        assert (await client.state(pid)).status != "applied"
        verdicts = [t.get("verdict") for t in await trailers(daemon, svc, pid)]
        assert "applied" not in verdicts and verdicts[-1] == "failed", verdicts
        assert await store.manifest() == {"app": lkg}
        await eventually(lambda: _seen(seen, ["v1", "v2", "v1"]))
        assert store.supervision.artefacts["app"].proc.returncode is None  # the LKG runs on
    finally:
        await store.stop()
        await daemon.stop()
        await connection.close(nc)


async def _seen(path, versions: list[str]) -> bool:
    """The artefact versions started so far (each appends its own) are `versions`."""
    return path.exists() and path.read_text().splitlines() == versions


# -- the quorum (policy.quorum on; a daemon of its own) -----------------------------------------

async def votes_counted(daemon, svc, pid, n):
    async def enough():
        chain = await trailers(daemon, svc, pid)
        done = [t for t in chain if t.get("verdict") in ("vote", "refused")]
        return chain if len(done) >= n else None

    return await eventually(enough)


async def nothing_applied(client, store, pid) -> None:
    """Watch a moment for what must not happen: the quorum did not approve, nothing ran."""
    await asyncio.sleep(0.3)
    assert (await client.state(pid)).status == "pending" and store.orders == 0


async def test_two_votes_do_not_apply_three_non_correlated_do(quorum_daemon):
    nc, daemon = quorum_daemon
    svc = "q3"
    store, client, pid = await quorum_case(nc, daemon, svc)
    reads = await quorum_reads(daemon, svc, pid)
    await publish(nc, S.QUORUM, vote(reads, "agent-a", "model-x"))
    await publish(nc, S.QUORUM, vote(reads, "agent-b", "model-y"))
    await votes_counted(daemon, svc, pid, 2)
    await nothing_applied(client, store, pid)
    await publish(nc, S.QUORUM, vote(reads, "agent-c", "operator-origin-z"))
    out = await outcome(client, pid)
    assert out.ok, out.error
    assert out.authority.startswith("quorum:")
    assert await store.content("a") == b'{"v": 2}'
    data = await daemon.store.last(S.quorum_record(pid))
    record = msgspec.json.decode(data, type=QuorumRecord)
    assert record.outcome == "approved" and record.approvals == 3
    assert sorted(v.voter for v in record.votes) == ["agent-a", "agent-b", "agent-c"]
    assert all(v.sig and v.keyid.startswith("ed25519:") for v in record.votes)
    # immutable: it cannot be overwritten
    await daemon.store.publish_once(S.quorum_record(pid), {"forged": True})
    assert await daemon.store.last(S.quorum_record(pid)) == data
    await store.stop()


async def test_the_same_key_voting_three_times_does_not_apply(quorum_daemon):
    nc, daemon = quorum_daemon
    svc = "qk"
    store, client, pid = await quorum_case(nc, daemon, svc)
    reads = await quorum_reads(daemon, svc, pid)
    for session in ("s1", "s2", "s3"):
        await publish(nc, S.QUORUM, vote(reads, "agent-a", session))
    chain = await votes_counted(daemon, svc, pid, 3)
    assert [t.get("verdict") for t in chain if t.get("verdict") in ("vote", "refused")] == \
        ["vote", "refused", "refused"]
    assert any("same_key" in t["reason"] for t in chain)
    await nothing_applied(client, store, pid)
    await store.stop()


async def test_the_proposers_session_and_correlated_sessions_never_add_up(quorum_daemon):
    nc, daemon = quorum_daemon
    svc = "qs"
    store, client, pid = await quorum_case(nc, daemon, svc)
    reads = await quorum_reads(daemon, svc, pid)
    await publish(nc, S.QUORUM, vote(reads, "agent-a", "agentd:run-7"))  # the proposer's
    await publish(nc, S.QUORUM, vote(reads, "agent-b", "model-x"))
    await publish(nc, S.QUORUM, vote(reads, "agent-c", "model-x"))  # same session, other key
    chain = await votes_counted(daemon, svc, pid, 3)
    reasons = [t["reason"] for t in chain if t.get("verdict") == "refused"]
    assert any("proposer_session" in r for r in reasons)
    assert any("correlated_session" in r for r in reasons)
    await nothing_applied(client, store, pid)
    await store.stop()


async def test_one_dissent_among_four_defers_to_the_operator(quorum_daemon):
    nc, daemon = quorum_daemon
    svc = "qd"
    store, client, pid = await quorum_case(nc, daemon, svc)
    reads = await quorum_reads(daemon, svc, pid)
    await publish(nc, S.QUORUM, vote(reads, "agent-a", "s1"))
    await publish(nc, S.QUORUM, vote(reads, "agent-b", "s2", "dissent"))
    await publish(nc, S.QUORUM, vote(reads, "agent-c", "s3"))
    await publish(nc, S.QUORUM, vote(reads, "agent-d", "s4"))
    await votes_counted(daemon, svc, pid, 4)
    decision = await client.decision(pid)
    assert (decision.verdict, decision.cause) == ("defer", "quorum_dissent")
    await asyncio.sleep(0.3)
    assert store.orders == 0
    record = msgspec.json.decode(await daemon.store.last(S.quorum_record(pid)),
                                 type=QuorumRecord)
    assert record.outcome == "deferred" and record.dissents == 1
    # the operator decides now
    await publish(nc, S.inbound_review(svc), review(pid))
    assert (await outcome(client, pid)).ok
    assert await store.content("a") == b'{"v": 2}'
    await store.stop()


async def test_a_vote_from_an_unknown_key_is_refused(quorum_daemon):
    nc, daemon = quorum_daemon
    svc = "qu"
    store, client, pid = await quorum_case(nc, daemon, svc)
    body = Vote(proposal_id=pid, vote="approve", voter="agent-a", session="s1",
                read=await quorum_reads(daemon, svc, pid), at=now_ms())
    env = signing.sign(signing.PAYLOAD_TYPES["vote"], to_json(body), Ed25519PrivateKey.generate())
    await publish(nc, S.QUORUM, env)
    chain = await votes_counted(daemon, svc, pid, 1)
    assert "unknown_key" in chain[-1]["reason"]
    await store.stop()


async def test_an_l4_service_without_the_lkg_check_gets_no_order(daemon, nc, svc):
    """No answer on `<svc>.improve.lkg` is "not now": the proposal stays approved and
    retryable, the outcome says why, and no ApplyOrder is sent."""
    client = MeshClient(nc, svc)
    orders = []

    async def applier(order):
        orders.append(order)
        raise AssertionError("no order may come before the last-known-good check")

    sub = await client.serve_apply(applier)
    pid = await client.publish(swap(svc, {"a": '{"v": 2}'}))
    await approve(nc, client, svc, pid)
    out = await eventually(lambda: client.outcome(pid), timeout=20)
    assert out.ok is False and out.error.startswith("unreachable:")
    assert S.lkg_request(svc) in out.error
    assert orders == [] and (await client.state(pid)).status == "approved"
    await sub.unsubscribe()


async def test_an_l4_regression_proposes_the_recorded_reversal_which_runs_unapproved(
        daemon, nc, svc):
    """Learn-back: the metric regresses after an approved L4 apply (the owning service,
    asked at review_after, answers 40 against a baseline of 100); the rollback proposed is
    the reversal recorded before the apply, and it runs under the original's approval."""
    from improved.protocol.model import MetricSnapshot

    key = await trusted_service(daemon, svc)  # only the service's own measurement counts
    store = await started(nc, svc, {"a": '{"v": 1}'}, key=key)
    before = await store.manifest()
    client = MeshClient(nc, svc, key=key)

    async def throughput(request) -> float:
        return 40.0

    meter = await client.serve_measure(throughput)
    change = msgspec.structs.replace(swap(svc, {"a": '{"v": 2}'}), metric_snapshot=MetricSnapshot(
        metric="throughput_rps", baseline=100.0, review_after=now_ms() + 300))
    pid = await client.publish(change)
    await approve(nc, client, svc, pid)
    out = await outcome(client, pid)
    assert out.ok
    await eventually(lambda: _status(client, pid, "rolled_back"), timeout=15)
    assert await store.manifest() == before
    chain = await trailers(daemon, svc, pid)
    regressed = next(t for t in chain if t.get("verdict") == "regressed")
    assert f"rollback_proposal:{out.revert_proposal_id}" in regressed["refs"]
    rev_chain = await trailers(daemon, svc, out.revert_proposal_id)
    assert "inherit" in [t.get("verdict") for t in rev_chain]
    await meter.unsubscribe()
    await store.stop()


async def test_a_crash_between_the_reversal_and_the_rollback_mark_is_finished_later(
        daemon, nc, svc, monkeypatch):
    """The reversal's apply trailer is written, then the process dies before the original is
    marked rolled back: the next pass over the reversal finishes it."""
    store = await started(nc, svc, {"a": '{"v": 1}'})
    client = MeshClient(nc, svc)
    pid = await client.publish(swap(svc, {"a": '{"v": 2}'}))
    await approve(nc, client, svc, pid)
    out = await outcome(client, pid)
    record = await daemon.engine.records.truth(svc, pid)
    real = daemon.engine.rolled_back
    crashes = []

    async def crash_once(*args, **kwargs):
        if not crashes:
            crashes.append(args)
            raise RuntimeError("died between the two trailers")
        return await real(*args, **kwargs)

    monkeypatch.setattr(daemon.engine, "rolled_back", crash_once)
    await client.publish(record.revert)
    rev = await outcome(client, out.revert_proposal_id)
    assert rev.ok
    await eventually(lambda: _status(client, pid, "rolled_back"), timeout=15)
    assert crashes  # it did die once, and the redelivery finished the job
    await store.stop()
