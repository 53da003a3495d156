"""Forged authority on the chain (issue 13, items 1 and 2), played as a bus participant with
publish rights on the audit subjects would: a correctly hashed but unsigned `approve` trailer
appended to a waiting L2's chain — with the daemon running and with it stopped — and a hand-made
`crisis_resolved` on the autonomy chain. A trailer no trusted daemon key signed, or authority no
signed act backs, is a break: nothing is applied, the daemon opens a crisis, and
`improved audit verify` names the trailer. A compromised daemon key still cannot make up an
operator's approval: the approval must carry the operator's signed act."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
import structlog.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.client import connection
from improved.client.sdk import MeshClient
from improved.core import audit, breaker, evidence
from improved.core.audit import Draft
from improved.core.record import ChainHead
from improved.core.trailers import ref
from improved.protocol import subjects as S
from improved.protocol.model import ApplyResult
from improved.runtime.daemon import Daemon
from improved.runtime.store import Store
from tests.bus import Applier, approve, daemon_config, daemon_key, eventually, logged
from tests.cli import improved
from tests.factories import rank_proposal, skill_proposal

SVC = "forge"


def _config(tmp_path: Path):
    return msgspec.structs.replace(daemon_config(), checkpoint_interval_s=0.0,
                                   data_dir=tmp_path / "data")


async def _forge(nc, subject: str, chain_id: str, draft: Draft, *,
                 key: Ed25519PrivateKey | None = None) -> None:
    """Append `draft` to the chain on `subject` exactly as a daemon would — sealed, linked,
    with the expected last sequence — signed with `key` (None: unsigned)."""
    store = Store(nc)
    store.signer = key
    chain = await store.read_chain_at(subject)
    last_seq, last = chain[-1]
    head = ChainHead(length=last["seq"] + 1, last_hash=last["hash"], stream_seq=last_seq)
    t = audit.seal_next(draft, chain_id, head, last["gate_class"], last["scope"], last["at"] + 1)
    await store.append_to(subject, t, last_seq)


def _approval(pid: str, actor: str = "operator:alice") -> Draft:
    """What an approval trailer says, without the signed act behind it."""
    return Draft(from_stage="triage", to_stage="triage", actor=actor, observer_type="human",
                 verdict="approve", reason=f"approved by {actor}: looks fine",
                 refs=(ref("act", "0" * 64), ref("act_seq", 999)))


async def _waiting_l2(client: MeshClient) -> str:
    pid = (await client.propose(skill_proposal(SVC))).proposal_id
    decision = await client.triage(pid)
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_operator")
    return pid


async def _verify(url: str, config, *extra: str):
    return await asyncio.to_thread(
        improved, "audit", "verify", "--nats", url, "--checkpoint",
        str(config.data_dir / "last-checkpoint.json"), *extra)


async def _in_crisis(daemon) -> str:
    return (await daemon.engine.autonomy.state(2**62)).crisis


@asynccontextmanager
async def _running(url: str, config):
    """A daemon on `url` with `config`, and the service SVC's client and applier."""
    nc = await connection.connect(url, "forge")
    daemon = Daemon(nc, config)
    await daemon.start()
    client = MeshClient(nc, SVC)
    applier = Applier()
    sub = await client.serve_apply(applier)
    try:
        yield nc, daemon, client, applier
    finally:
        await sub.unsubscribe()
        await daemon.stop()
        await connection.close(nc)


async def test_an_unsigned_approval_on_a_running_daemon_applies_nothing(own_server, tmp_path):
    config = _config(tmp_path)
    async with _running(own_server.url, config) as (nc, daemon, client, applier):
        pid = await _waiting_l2(client)
        await _forge(nc, S.audit(SVC, pid), pid, _approval(pid))
        daemon.engine.records.cache.clear()  # as after a restart: the chain is read again
        reply = await nc.request(S.triage_request(SVC), msgspec.json.encode(
            {"proposal_id": pid}), timeout=5)
        await asyncio.sleep(0.5)
        assert applier.orders == []
        assert msgspec.json.decode(reply.data)["error"]["code"] == "chain_broken"
        assert await _in_crisis(daemon)
        # the honest path stays shut too: a crisis refuses every apply
        with structlog.testing.capture_logs() as logs:
            other = (await client.propose(rank_proposal(SVC, key="after"))).proposal_id
            assert (await client.triage(other)).verdict == "accept"
            await logged(logs, "applies refused", proposal_id=other)
        assert applier.orders == []
        verify = await _verify(own_server.url, config)
        assert verify.returncode == 1
        assert f"BROKEN {pid} trailer 2: not signed by a daemon" in verify.stdout, verify.stdout


async def test_an_unsigned_approval_while_the_daemon_was_stopped_is_a_crisis_at_start(
        own_server, tmp_path):
    config = _config(tmp_path)
    nc = await connection.connect(own_server.url, "forge")
    daemon = Daemon(nc, config)
    await daemon.start()
    client = MeshClient(nc, SVC)
    pid = await _waiting_l2(client)
    await daemon.stop()
    await _forge(nc, S.audit(SVC, pid), pid, _approval(pid))

    daemon = Daemon(nc, config)
    await daemon.start()
    applier = Applier()
    sub = await client.serve_apply(applier)
    try:
        assert await _in_crisis(daemon)
        await nc.request(S.triage_request(SVC), msgspec.json.encode({"proposal_id": pid}),
                         timeout=5)
        await asyncio.sleep(0.5)
        assert applier.orders == []
        verify = await _verify(own_server.url, config, pid)
        assert verify.returncode == 1 and "not signed by a daemon" in verify.stdout
    finally:
        await sub.unsubscribe()
        await daemon.stop()
        await connection.close(nc)


async def test_a_daemon_key_alone_cannot_make_up_an_operators_approval(own_server, tmp_path):
    """The attacker holds a trusted daemon key: the trailer is signed, but the approval carries
    no signed act of alice's, so it is still a break and nothing is applied."""
    config = _config(tmp_path)
    async with _running(own_server.url, config) as (nc, daemon, client, applier):
        pid = await _waiting_l2(client)
        await _forge(nc, S.audit(SVC, pid), pid, _approval(pid), key=daemon_key())
        daemon.engine.records.cache.clear()
        await nc.request(S.triage_request(SVC), msgspec.json.encode({"proposal_id": pid}),
                         timeout=5)
        await asyncio.sleep(0.5)
        assert applier.orders == []
        assert await _in_crisis(daemon)
        verify = await _verify(own_server.url, config, pid)
        assert "the approve carries no signed act" in verify.stdout, verify.stdout


async def test_a_forged_crisis_resolution_keeps_the_crisis(own_server, tmp_path):
    config = _config(tmp_path)
    async with _running(own_server.url, config) as (nc, daemon, client, applier):
        await daemon.engine.autonomy.chain_broken("a test opens a crisis")
        crisis = await _in_crisis(daemon)
        assert crisis
        subject = S.autonomy_audit(breaker.AUTONOMY_ID)
        resolved = breaker.draft(breaker.in_crisis(await daemon.engine.autonomy.state(2**62), ""),
                                 "crisis_resolved", "operator:alice", "human",
                                 f"{crisis} resolved by operator:alice: fine",
                                 breaker.Marks(resolved=crisis))
        await _forge(nc, subject, breaker.AUTONOMY_ID, resolved)
        assert await _in_crisis(daemon)  # the head is not believed
        # `improved status` reads the head as the daemon does: the crisis it holds
        keyed = tmp_path / "keyed.toml"
        keyed.write_text(f'data_dir = "{config.data_dir}"\n'
                         f'checkpoint_key = "{config.checkpoint_key}"\n')
        status = await _status(own_server.url, keyed)
        daemon.engine.autonomy.forget()  # read the chain afresh
        assert status["crisis"] == await _in_crisis(daemon), status
        assert status["autonomy_chain"].startswith("BROKEN: ")
        assert "not signed by a daemon" in status["autonomy_chain"]
        # where no daemon key is known, it says it could not check, not that all is well
        assert (await _status(own_server.url))["autonomy_chain"].startswith(
            "not verified: no daemon key here")
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is not None
        with structlog.testing.capture_logs() as logs:
            pid = (await client.propose(rank_proposal(SVC, key="after"))).proposal_id
            assert (await client.triage(pid)).verdict == "accept"
            await logged(logs, "applies refused", proposal_id=pid)
        assert applier.orders == []
        verify = await _verify(own_server.url, config)
        assert "not signed by a daemon" in verify.stdout, verify.stdout
        # the crisis is back on the chain, daemon-signed: `improved status` shows it
        assert (await _status(own_server.url, keyed))["crisis"] == await _in_crisis(daemon)


async def _status(url: str, config_file: Path | None = None) -> dict:
    args = ("--config", str(config_file)) if config_file else ()
    seen = await asyncio.to_thread(improved, "status", "--nats", url, *args)
    assert seen.returncode == 0, seen.stderr
    return json.loads(seen.stdout)


async def test_signed_approvals_verify_from_the_chain_and_an_old_act_after_key_rotation(
        own_server, tmp_path):
    """The honest path: alice approves, the order goes out, the chain verifies with the signed
    act on it. Alice's key is then removed from the trust store: the trust chain records it,
    and her earlier approval still verifies against the key trusted when it was accepted."""
    config = _config(tmp_path)
    async with _running(own_server.url, config) as (nc, daemon, client, applier):
        pid = await _waiting_l2(client)
        await approve(nc, client, SVC, pid)

        async def ordered():
            return applier.orders

        await eventually(ordered)
        assert applier.authorities == ["operator:alice"]
        chain = await Store(nc).read_chain(SVC, pid)
        approval = next(body for _, body in chain if body.get("verdict") == "approve")
        assert approval["envelope"]["payloadType"] == "application/vnd.improved.review+json"
    rotated = msgspec.structs.replace(config, trust=msgspec.structs.replace(
        config.trust, operators={}))
    async with _running(own_server.url, rotated) as (nc, daemon, _, _):
        trust = await Store(nc).read_chain_at(S.trust_audit(evidence.TRUST_ID))
        assert len(trust) == 2 and "removed" in trust[-1][1]["reason"]
        assert "operator:alice" in trust[-1][1]["reason"]
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None
        verify = await _verify(own_server.url, config)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert "daemon signatures and signed acts" in verify.stdout


async def test_a_forged_grant_after_a_revocation_is_not_taken_from_a_remembered_grant(
        own_server, tmp_path):
    """The daemon remembers a verified grant chain by its last trailer (`Store._current_grant`)
    and re-reads it only when that end moves. A bus participant who appends a correctly linked
    "grant" trailer after a revocation moves the end: the chain is read and verified again,
    the forged trailer is refused, and the next re-execution is not applied."""
    from improved.protocol import canonical
    from tests.bus import applied_at_l2, publish
    from tests.factories import grant, now_ms

    config = _config(tmp_path)
    async with _running(own_server.url, config) as (nc, daemon, client, applier):
        first = skill_proposal(SVC, change_class="L3")
        l2 = await applied_at_l2(nc, first)
        identity = canonical.skill_identity(first.proposal_data["skill"])
        sha = identity.split(":", 1)[1]
        await publish(nc, S.GRANTS, grant(identity, proposal=l2))
        await eventually(lambda: daemon.store.grant_active(identity, now_ms(),
                                                           daemon.engine.trust.chain_trust))
        pid3 = (await client.propose(first)).proposal_id  # the memo is warm after this one
        assert (await eventually(lambda: client.outcome(pid3))).ok

        await publish(nc, S.GRANTS, grant(identity, op="revoke"))

        async def revoked():
            chain = await daemon.store.read_chain_at(S.grant_audit(sha))
            return chain[-1][1]["verdict"] == "revoke"

        await eventually(revoked)
        forged = Draft(from_stage="apply", to_stage="apply", actor="operator:alice",
                       observer_type="human", verdict="grant",
                       reason="granted by operator:alice", refs=(ref("act", "0" * 64),))
        await _forge(nc, S.grant_audit(sha), sha, forged)
        pid_again = (await client.propose(skill_proposal(SVC, change_class="L3"))).proposal_id
        decision = await client.triage(pid_again)
        await asyncio.sleep(0.5)
        assert pid_again not in applier.orders
        assert (decision.verdict, decision.gate_class) != ("accept", "L3"), decision


async def test_a_daemon_signed_transition_the_lifecycle_forbids_is_broken_to_every_reader(
        own_server, tmp_path):
    """A rejected proposal, then a correctly hashed `applied` trailer signed with the daemon's
    own key (a stolen key, or a daemon bug): every writer is trusted, but OMS has no rejected →
    applied. `improved show` and `improved audit verify` (the whole log and the one chain)
    call it broken, as the daemon does, not verified."""
    config = _config(tmp_path)
    async with _running(own_server.url, config) as (nc, daemon, client, applier):
        pid = (await client.propose(rank_proposal(SVC, key="x", change_class="L3"))).proposal_id
        assert (await client.triage(pid)).verdict == "reject"
        await _forge(nc, S.audit(SVC, pid), pid, Draft(
            from_stage="apply", to_stage="apply", actor="policy:auto", observer_type="rec:policy",
            verdict="applied", reason="applied", refs=(ref("applied", "x"),)),
            key=daemon_key())
    for extra in ((), (pid,)):
        verify = await _verify(own_server.url, config, *extra)
        assert verify.returncode == 1, verify.stdout
        assert "the lifecycle forbids rejected → applied" in verify.stdout, verify.stdout
    shown = await asyncio.to_thread(improved, "show", pid, "--json", "--nats", own_server.url)
    chain = msgspec.json.decode(shown.stdout)["chain"]
    assert chain.startswith("BROKEN") and "the lifecycle forbids rejected → applied" in chain


async def test_a_chain_copied_under_another_services_subject_is_a_break(own_server, tmp_path):
    """Every trailer of a chain is daemon-signed, so a copy verifies trailer by trailer; filed
    under another service's subject it would be a second chain for one proposal, one that
    service's messages find. A chain is its own proposal's service's: the copy is named, and
    the daemon's checkpoint opens a crisis on it."""
    config = _config(tmp_path)
    async with _running(own_server.url, config) as (nc, daemon, client, applier):
        pid = await _waiting_l2(client)
        js = nc.jetstream()
        for _, body in await daemon.store.read_chain(SVC, pid):
            await js.publish(S.audit("elsewhere", pid), msgspec.json.encode(body),
                             stream=S.STREAM_AUDIT)
        verify = await _verify(own_server.url, config)
        assert verify.returncode == 1
        assert f"filed under service 'elsewhere', but its registration is a proposal of " \
               f"'{SVC}'" in verify.stdout, verify.stdout
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is not None  # noqa: SLF001
        assert await _in_crisis(daemon)


@pytest.mark.parametrize("put_back", [True, False])
async def test_a_limit_set_on_the_audit_stream_stops_applies_before_the_next_checkpoint(
        own_server, tmp_path, put_back):
    """On an open bus anyone may set a limit on IMPROVE_AUDIT — and take it back before the
    next checkpoint looks: the oldest trailers (whole chains, a crisis on the autonomy chain)
    are gone, and a proposal whose chain is gone reads as never seen. Every pass looks at the
    stream first, in O(1): one that forgot what the last checkpoint covered, or keeps a
    limit, is a crisis at once, and nothing more is applied."""
    from nats.js.api import StreamConfig

    config = _config(tmp_path)
    async with _running(own_server.url, config) as (nc, daemon, _, _):
        svc, orders = "forge-rank", []

        async def applier(order) -> ApplyResult:
            orders.append(order.proposal_id)
            return ApplyResult(ok=True, applied_id=order.proposal_id[:12])

        client = MeshClient(nc, svc)
        sub = await client.serve_apply(applier)
        first = (await client.propose(rank_proposal(svc, key="before"))).proposal_id

        async def applied():
            return first in orders

        await eventually(applied)
        await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key)  # noqa: SLF001 - covers it
        js = nc.jetstream()
        cfg = (await js.stream_info(S.STREAM_AUDIT)).config
        await js.update_stream(StreamConfig.from_response(
            {**cfg.as_dict(), "max_msgs": 2}))  # the oldest trailers go at once
        if put_back:
            await js.update_stream(cfg)
        await asyncio.sleep(1.1)  # the next pass reads the autonomy state afresh
        with structlog.testing.capture_logs() as logs:
            later = (await client.propose(rank_proposal(svc, key="after"))).proposal_id
            await logged(logs, "applies refused", proposal_id=later)
        assert later not in orders
        assert await _in_crisis(daemon)
        await sub.unsubscribe()
