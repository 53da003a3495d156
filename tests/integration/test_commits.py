"""One message per pass, through the real bus: an automatic L0 is registered, triaged and its
dispatch recorded in one commit, then applied in a second; every trailer of a commit is still
hashed, linked and daemon-signed, and what a bus participant appends as a commit is judged
trailer by trailer like anything else on the chain."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.client.sdk import MeshClient
from improved.core import audit, evidence
from improved.core.record import ChainHead
from improved.protocol import subjects as S
from improved.protocol.model import ApplyResult, TrailerCommit, to_json
from improved.runtime.store import Store
from tests.bus import eventually
from tests.cli import improved
from tests.factories import rank_proposal, skill_proposal
from tests.integration.test_forgery import SVC, _approval, _config, _running, _verify


async def _messages(nc, subject: str) -> list[tuple[int, object]]:
    """Every message on `subject` of the audit stream, raw: (stream sequence, JSON body)."""
    out, seq = [], 1
    js = nc.jetstream()
    while True:
        try:
            msg = await js.get_msg(S.STREAM_AUDIT, seq=seq, subject=subject, next=True)
        except Exception:
            return out
        out.append((msg.seq, msgspec.json.decode(msg.data)))
        seq = msg.seq + 1


async def test_an_l0_is_one_commit_up_to_its_dispatch_and_one_for_its_outcome(
        daemon, nc, nats_url, svc):
    client = MeshClient(nc, svc)
    orders: list[str] = []

    async def applier(order) -> ApplyResult:
        orders.append(order.proposal_id)
        return ApplyResult(ok=True, applied_id=f"rank:{order.proposal_id[:8]}")

    sub = await client.serve_apply(applier)
    try:
        pid = await client.publish(rank_proposal(svc, key="one-commit"))
        async def applied() -> bool:
            state = await client.state(pid)
            return state is not None and state.status == "applied"

        await eventually(applied, what="the proposal applied")
    finally:
        await sub.unsubscribe()
    messages = await _messages(nc, S.audit(svc, pid))
    assert len(messages) == 2, messages
    (_, first), (_, second) = messages
    assert set(first) == {"trailers"}
    stages = [(t["to_stage"], t.get("verdict")) for t in first["trailers"]]
    assert stages == [("propose", None), ("triage", "accept"), ("apply", "dispatched")]
    assert (second["to_stage"], second["verdict"]) == ("apply", "applied")
    chain = [*first["trailers"], second]
    # one signature a message, on its last trailer: the links vouch for the rest of a commit
    assert ["sig" in t for t in chain] == [False, False, True, True]
    assert audit.verify_links(pid, chain) is None
    # the order went out after its intent was on the chain, once
    assert orders == [pid]
    verify = await asyncio.to_thread(improved, "audit", "verify", pid, "--nats", nats_url,
                                     "--checkpoint",
                                     str(daemon.config.data_dir / "last-checkpoint.json"))
    assert verify.returncode == 0, verify.stdout + verify.stderr


async def _waiting_l2(client: MeshClient, svc: str) -> str:
    pid = (await client.propose(skill_proposal(svc))).proposal_id
    assert (await client.triage(pid)).cause == "awaiting_operator"
    return pid


async def _forge_commit(nc, svc: str, pid: str, drafts, *, sign_last: bool) -> None:
    """Append `drafts` to the chain of `pid` as one commit, sealed and linked as a daemon would,
    with the expected last sequence; unsigned (the daemon's key is not the attacker's) but for
    the last one when `sign_last` — with a key no daemon config trusts."""
    store = Store(nc)
    subject = S.audit(svc, pid)
    chain = await store.read_chain_at(subject)
    last_seq, last = chain[-1]
    head = ChainHead(length=last["seq"] + 1, last_hash=last["hash"], stream_seq=last_seq)
    trailers = []
    for draft in drafts:
        t = audit.seal_next(draft, pid, head, last["gate_class"], last["scope"], last["at"] + 1)
        trailers.append(t)
        head = ChainHead(length=t.seq + 1, last_hash=t.hash, stream_seq=last_seq)
    if sign_last:
        trailers[-1] = evidence.sign(trailers[-1], Ed25519PrivateKey.generate())
    await nc.jetstream().publish(subject, to_json(TrailerCommit(trailers=trailers)),
                                 headers={"Nats-Expected-Last-Subject-Sequence": str(last_seq)})


async def test_a_forged_commit_is_a_break_trailer_by_trailer(own_server, tmp_path):
    """A bus participant appends a commit of an approval and a dispatch to a waiting L2, its
    last trailer signed by a key of its own: a commit proves nothing its trailers do not, so
    its first trailer is named, nothing is applied, and the daemon will not decide on the
    chain."""
    config = _config(tmp_path)
    async with _running(own_server.url, config) as (nc, daemon, client, applier):
        pid = await _waiting_l2(client, SVC)
        dispatch = audit.Draft(from_stage="triage", to_stage="apply", actor="improved:x",
                               observer_type="rec:policy", verdict="dispatched",
                               reason="dispatched")
        await _forge_commit(nc, SVC, pid, [_approval(pid), dispatch], sign_last=True)
        # the approval is vouched for by the commit's last signature, which is no daemon's;
        # and it carries no signed act of an operator's: named first
        daemon.engine.records.cache.clear()  # as after a restart: the chain is read again
        reply = await nc.request(S.triage_request(SVC), msgspec.json.encode(
            {"proposal_id": pid}), timeout=5)
        assert msgspec.json.decode(reply.data)["error"]["code"] == "chain_broken"
        assert applier.orders == []
        verify = await _verify(own_server.url, config, pid)
        assert verify.returncode == 1
        assert f"BROKEN {pid} trailer 2: the approve carries no signed act" in verify.stdout, \
            verify.stdout


def _dispatch(verdict: str = "dispatched") -> audit.Draft:
    return audit.Draft(from_stage="triage", to_stage="apply", actor="improved:x",
                       observer_type="rec:policy", verdict=verdict, reason=verdict)


@pytest.mark.parametrize("sign_last", [False, True])
async def test_a_commit_no_trusted_daemon_signed_is_a_break_at_its_last_trailer(
        own_server, tmp_path, sign_last):
    """Unsigned, or signed by a key of the attacker's own: the commit's first trailer is
    vouched for only through its last, and the last is named."""
    config = _config(tmp_path)
    async with _running(own_server.url, config) as (nc, daemon, client, applier):
        pid = await _waiting_l2(client, SVC)
        await _forge_commit(nc, SVC, pid, [_dispatch(), _dispatch("undelivered")],
                            sign_last=sign_last)
        verify = await _verify(own_server.url, config, pid)
        assert verify.returncode == 1
        why = "which is not a trusted daemon key" if sign_last else "not signed by a daemon"
        assert f"BROKEN {pid} trailer 3: " in verify.stdout and why in verify.stdout, \
            verify.stdout
        daemon.engine.records.cache.clear()
        reply = await nc.request(S.triage_request(SVC), msgspec.json.encode(
            {"proposal_id": pid}), timeout=5)
        assert msgspec.json.decode(reply.data)["error"]["code"] == "chain_broken"
        assert applier.orders == []


async def test_a_commit_replaying_the_daemons_own_trailers_is_a_break(own_server, tmp_path):
    """Every trailer of the replayed commit carries a valid daemon signature; it is the place
    on the chain that is wrong, and that is named."""
    config = _config(tmp_path)
    async with _running(own_server.url, config) as (nc, daemon, client, applier):
        pid = await _waiting_l2(client, SVC)
        messages = await _messages(nc, S.audit(SVC, pid))
        (last_seq, first), = messages  # registration and decision: one commit
        assert len(first["trailers"]) == 2
        await nc.jetstream().publish(S.audit(SVC, pid), msgspec.json.encode(first), headers={
            "Nats-Expected-Last-Subject-Sequence": str(last_seq)})
        verify = await _verify(own_server.url, config, pid)
        assert verify.returncode == 1
        assert f"BROKEN {pid} trailer 2: sequence jumps to 0" in verify.stdout, verify.stdout
        daemon.engine.records.cache.clear()
        reply = await nc.request(S.triage_request(SVC), msgspec.json.encode(
            {"proposal_id": pid}), timeout=5)
        assert msgspec.json.decode(reply.data)["error"]["code"] == "chain_broken"
        assert applier.orders == []
