"""Signed proposals through a real nats-server and the session daemon: a proposal signed by a
trusted agent (or the service itself) of the subject's service names a verified proposer; a
forged, unknown or foreign signature is refused and changes nothing; independence and a
skill's holder follow the verified proposer, and only the chain says who that is.

The session daemon trusts AGENT_A and AGENT_B, agents of the service SIGNED, and EVALUATOR,
an agent of another service (tests/keys.py); the tests on SIGNED isolate themselves by target."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid

import msgspec
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.client.sdk import MeshClient
from improved.core import audit, propose, signing
from improved.core.record import ChainHead
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import Envelope, to_json
from improved.runtime.store import Store
from improved_reference.skills_store import SkillsStore
from tests.bus import approve, daemon_key, eventually, outcome, refusal
from tests.cli import improved
from tests.factories import now_ms, signal, skill_proposal
from tests.integration.test_forgery import _config, _running, _verify
from tests.keys import AGENT_A, AGENT_B, CHECK, EVALUATOR, SIGNED

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROPOSAL_TYPE = "application/vnd.improved.proposal+json"


def unique_skill(svc: str = SIGNED, **over):
    """An L2 skill proposal no other test makes (its own name: its own target and dedup key)."""
    name = "s" + uuid.uuid4().hex[:10]
    return skill_proposal(svc, name=name, instructions=f"Do {name}.", **over)


def envelope(proposal, key) -> bytes:
    return to_json(signing.sign(PROPOSAL_TYPE, to_json(proposal), key))


async def chain(daemon, svc, pid):
    return [body for _, body in await daemon.store.read_chain(svc, pid)]


async def test_a_signed_proposal_has_the_unsigned_ones_id_and_names_its_verified_proposer(
        daemon, nc):
    client = MeshClient(nc, SIGNED)
    proposal = unique_skill()
    reply = await client.propose(proposal, key=AGENT_A[1])
    assert reply.proposal_id == propose.identify(proposal)[0]  # the content's id, not the envelope's
    first = (await chain(daemon, SIGNED, reply.proposal_id))[0]
    assert first["envelope"]["payloadType"] == PROPOSAL_TYPE
    assert f"proposer:{AGENT_A[0]}" in first["refs"]
    assert first["actor"] == proposal.origin.actor  # the declared origin is still recorded


@pytest.mark.parametrize("how", ["request", "stream"])
async def test_a_forged_signature_is_refused_and_changes_nothing(daemon, nc, how):
    client = MeshClient(nc, SIGNED)
    proposal = unique_skill()
    pid = propose.identify(proposal)[0]
    env = signing.sign(PROPOSAL_TYPE, to_json(unique_skill()), AGENT_A[1])  # another payload
    forged = to_json(Envelope(payloadType=PROPOSAL_TYPE,
                              payload=base64.b64encode(to_json(proposal)).decode(),
                              signatures=env.signatures))
    if how == "request":
        reply = await client.propose_raw(forged)
        assert reply["error"]["code"] == "bad_signature", reply
    else:
        js = nc.jetstream()
        await js.publish(S.inbound_proposal(SIGNED), forged,
                         headers={"Nats-Msg-Id": S.message_id(pid, forged)})
        refused = await refusal(nc, SIGNED, S.inbound_proposal(SIGNED))
        assert refused["code"] == "bad_signature", refused
    assert await client.state(pid) is None
    assert await daemon.store.read_chain(SIGNED, pid) == []


async def test_a_key_nobody_trusts_is_refused(daemon, nc):
    client = MeshClient(nc, SIGNED)
    proposal = unique_skill()
    reply = await client.propose_raw(envelope(proposal, Ed25519PrivateKey.generate()))
    assert reply["error"]["code"] == "unknown_signer", reply
    assert await daemon.store.read_chain(SIGNED, propose.identify(proposal)[0]) == []


async def test_an_agent_of_one_service_cannot_sign_for_another(daemon, nc, svc):
    # AGENT_A (of SIGNED) on `svc`'s subject; EVALUATOR (of `evaluators`) and a check on
    # SIGNED's: trusted keys all, none of them the subject's service
    for key, target in ((AGENT_A[1], svc), (EVALUATOR[1], SIGNED), (CHECK[1], SIGNED)):
        proposal = unique_skill(target)
        reply = await MeshClient(nc, target).propose_raw(envelope(proposal, key))
        assert reply["error"]["code"] == "signer_mismatch", reply
        assert await daemon.store.read_chain(target, propose.identify(proposal)[0]) == []


async def test_a_verified_agent_confirming_itself_is_still_feedback_collapse(daemon, nc):
    client = MeshClient(nc, SIGNED)
    proposal = unique_skill(signals=[signal(SIGNED, AGENT_B[0])])  # inside: the proposer's own
    pid = (await client.propose(proposal, key=AGENT_A[1])).proposal_id
    assert (await client.triage(pid)).cause == "feedback_collapse"
    own = await client.refine(signal(SIGNED, AGENT_A[0], proposal_id=pid), key=AGENT_A[1])
    assert own.counted and not own.independent
    bare = await client.refine(signal(SIGNED, AGENT_B[0], proposal_id=pid))  # unsigned claim
    assert bare.counted and not bare.independent
    assert (await client.triage(pid)).cause == "feedback_collapse"


async def test_another_verified_agent_of_the_same_service_is_independent(daemon, nc):
    client = MeshClient(nc, SIGNED)
    signed = unique_skill(signals=[signal(SIGNED, AGENT_A[0])])
    pid = (await client.propose(signed, key=AGENT_A[1])).proposal_id
    assert (await client.triage(pid)).cause == "feedback_collapse"
    other = await client.refine(signal(SIGNED, AGENT_B[0], proposal_id=pid), key=AGENT_B[1])
    assert other.counted and other.independent
    assert (await client.triage(pid)).cause == "awaiting_operator"

    # unsigned, the proposer is the whole service: the same agent's word proves nothing new
    bare = unique_skill(signals=[signal(SIGNED, AGENT_A[0])])
    bare_pid = (await client.propose(bare)).proposal_id
    same = await client.refine(signal(SIGNED, AGENT_B[0], proposal_id=bare_pid),
                               key=AGENT_B[1])
    assert same.counted and not same.independent
    assert (await client.triage(bare_pid)).cause == "feedback_collapse"


async def test_the_first_registration_decides_whether_a_proposal_is_signed(daemon, nc):
    """The same content is the same proposal: signing it again later changes nothing."""
    client = MeshClient(nc, SIGNED)
    proposal = unique_skill(signals=[signal(SIGNED, AGENT_A[0])])
    pid = (await client.propose(proposal)).proposal_id
    again = await client.propose(proposal, key=AGENT_A[1])
    assert again.proposal_id == pid
    first = (await chain(daemon, SIGNED, pid))[0]
    assert "envelope" not in first and not any(r.startswith("proposer:")
                                               for r in first["refs"])
    late = await client.refine(signal(SIGNED, AGENT_B[0], proposal_id=pid), key=AGENT_B[1])
    assert not late.independent


async def test_a_forged_state_record_does_not_make_a_proposal_signed(daemon, nc):
    """The retained state is an output anyone on the bus may rewrite: only the chain says who
    proposed."""
    client = MeshClient(nc, SIGNED)
    proposal = unique_skill(signals=[signal(SIGNED, AGENT_A[0])])
    pid = (await client.propose(proposal)).proposal_id
    state = await client.state(pid)
    await nc.jetstream().publish(
        S.proposal_state(SIGNED, pid),
        to_json(msgspec.structs.replace(state, proposer=AGENT_A[0])), stream=S.STREAM_RECORDS)
    daemon.engine.records.cache.pop(pid, None)  # as after a restart: the chain is read again
    late = await client.refine(signal(SIGNED, AGENT_B[0], proposal_id=pid), key=AGENT_B[1])
    assert late.counted and not late.independent


async def test_a_signed_proposal_published_into_the_stream_is_verified_too(daemon, nc):
    client = MeshClient(nc, SIGNED)
    proposal = unique_skill()
    pid = await client.publish(proposal, key=AGENT_B[1])
    assert pid == propose.identify(proposal)[0]
    first = await eventually(lambda: _first(daemon, pid))
    assert f"proposer:{AGENT_B[0]}" in first["refs"]


async def _first(daemon, pid):
    bodies = await chain(daemon, SIGNED, pid)
    return bodies[0] if bodies else None


async def test_a_signed_skill_proposals_competence_is_its_verified_proposers(daemon, nc):
    store = SkillsStore(nc, SIGNED)
    await store.start()
    try:
        client = MeshClient(nc, SIGNED)
        proposal = unique_skill()
        pid = (await client.propose(proposal, key=AGENT_A[1])).proposal_id
        await approve(nc, client, SIGNED, pid)
        assert (await outcome(client, pid)).ok
        other = await client.refine(signal(SIGNED, EVALUATOR[0], proposal_id=pid),
                                    key=EVALUATOR[1])
        assert other.independent
        identity = canonical.skill_identity(proposal.proposal_data["skill"])

        async def practised():
            reply = await nc.request(S.skills_practice(SIGNED), to_json({"proposal_id": pid}),
                                     timeout=5)
            body = msgspec.json.decode(reply.data)
            return body if body.get("competence") else None

        body = await eventually(practised)
        assert body["holder"] == AGENT_A[0]  # not service:<svc>/<origin.actor>
        assert body["skill"] == identity
    finally:
        await store.stop()


async def test_the_cli_signs_a_proposal_with_its_key_file(daemon, nats_url, tmp_path):
    def pem(key, name):
        path = tmp_path / name
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        return str(path)

    proposal = unique_skill()
    file = tmp_path / "proposal.json"
    file.write_bytes(to_json(proposal))
    run = await asyncio.to_thread(improved, "propose", "--json", "--nats", nats_url,
                                  "--key", pem(AGENT_A[1], "a.pem"), str(file))
    assert run.returncode == 0, run.stdout + run.stderr
    pid = json.loads(run.stdout)["proposal_id"]
    assert pid == propose.identify(proposal)[0]
    assert f"proposer:{AGENT_A[0]}" in (await chain(daemon, SIGNED, pid))[0]["refs"]

    other = unique_skill()
    file.write_bytes(to_json(other))
    run = await asyncio.to_thread(improved, "propose", "--json", "--nats", nats_url, "--key",
                                  pem(Ed25519PrivateKey.generate(), "x.pem"), str(file))
    assert run.returncode == 1
    assert json.loads(run.stdout)["error"]["code"] == "unknown_signer"


async def test_audit_verify_names_a_registration_whose_envelope_was_swapped(own_server,
                                                                             tmp_path):
    """Even with the daemon's key (compromised), a chain cannot claim a signed proposer the
    envelope beside it does not prove: `improved audit verify` names it, and the daemon
    decides nothing on it."""
    config = _config(tmp_path)
    async with _running(own_server.url, config) as (nc, daemon, _, _):
        client = MeshClient(nc, SIGNED)
        seen = unique_skill()  # honestly signed by AGENT_A: its envelope is on the bus
        env = signing.sign(PROPOSAL_TYPE, to_json(seen), AGENT_A[1])
        assert (await client.propose_raw(to_json(env)))["proposal_id"]

        forged = unique_skill()  # never proposed: a chain made up around AGENT_A's envelope
        pid, dedup = propose.identify(forged)
        _, draft = propose.register(forged, pid, dedup, config.policy, now_ms(),
                                    proposer=AGENT_A[0], envelope=env)
        t = audit.seal_next(draft, pid, ChainHead(), "L2", "knowledge", now_ms())
        store = Store(nc)
        store.signer = daemon_key()
        await store.append_to(S.audit(SIGNED, pid), t, 0)

        run = await _verify(own_server.url, config)
        assert run.returncode != 0, run.stdout
        assert f"{pid}" in run.stdout and "not the one the trailer names" in run.stdout, \
            run.stdout
        reply = msgspec.json.decode((await nc.request(
            S.triage_request(SIGNED), to_json({"proposal_id": pid}), timeout=5)).data)
        assert reply["error"]["code"] == "chain_broken"


def _trusting_toml(tmp_path) -> str:
    """A configuration trusting the test daemons' key: `show` then checks who wrote each
    trailer and the registration's envelope."""
    from tests.bus import daemon_config

    path = tmp_path / "improved.toml"
    path.write_text(f'data_dir = "{tmp_path / "data"}"\n'
                    f'checkpoint_key = "{daemon_config().checkpoint_key}"\n')
    return str(path)


async def test_the_operator_sees_who_verifiably_proposed(daemon, nc, nats_url, tmp_path):
    client = MeshClient(nc, SIGNED)
    signed = unique_skill()
    signed_pid = (await client.propose(signed, key=AGENT_A[1])).proposal_id
    unsigned = unique_skill(origin=msgspec.structs.replace(signed.origin, actor="agent-x"))
    unsigned_pid = (await client.propose(unsigned)).proposal_id
    cfg = _trusting_toml(tmp_path)

    def cli(*args):
        return asyncio.to_thread(improved, *args, "--nats", nats_url, "--config", cfg)

    shown = await cli("show", signed_pid, "--format", "text")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert f"  proposer: {AGENT_A[0]} (signed)\n" in shown.stdout
    other = await cli("show", unsigned_pid, "--format", "text")
    assert "  proposer: unsigned (origin.actor agent-x, declared)\n" in other.stdout
    as_json = json.loads((await cli("show", signed_pid, "--format", "json")).stdout)
    assert as_json["proposer"] == AGENT_A[0]
    assert as_json["state"]["proposer"] == AGENT_A[0]  # the retained ProposalState says it too
    assert json.loads((await cli("show", unsigned_pid, "--format", "json")).stdout)[
        "proposer"] is None
    assert (await client.state(signed_pid)).proposer == AGENT_A[0]
    assert (await client.state(unsigned_pid)).proposer is None

    queue = (await cli("review")).stdout
    assert f"  proposer: {AGENT_A[0]} (signed)" in queue.split(signed_pid, 1)[1].split(
        "decide:", 1)[0]
    assert "  proposer: unsigned (origin.actor agent-x, declared)" in \
        queue.split(unsigned_pid, 1)[1].split("decide:", 1)[0]
    rows = {r["proposal_id"]: r for r in json.loads((await cli("review", "--format",
                                                                "json")).stdout)}
    assert rows[signed_pid]["proposer"] == AGENT_A[0]
    assert rows[unsigned_pid]["proposer"] is None
