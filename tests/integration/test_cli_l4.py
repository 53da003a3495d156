"""The operator's terminal for the dangerous end of the gradient: probing a service's
conformance, reverting an L4 apply, signing per-call tool grants — as subprocesses against the
session's real nats-server."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from cryptography.hazmat.primitives import serialization

from improved.client.sdk import MeshClient
from improved.core import signing
from improved.core.tools import Provider, Runtime
from improved.protocol import subjects as S
from improved.runtime.store import Store
from improved_reference.artefact_store import ArtefactStore
from improved_reference.tool_runtime import ToolRuntimeService
from tests.bus import approve, daemon_key, eventually, outcome, publish
from tests.cli import improved
from tests.factories import review, swap
from tests.keys import ALICE

pytestmark = pytest.mark.asyncio(loop_scope="session")


def cli(*args: str):
    return asyncio.to_thread(improved, *args)


@pytest.fixture
def alice_key(tmp_path):
    path = tmp_path / "alice.pem"
    path.write_bytes(ALICE[1].private_bytes(serialization.Encoding.PEM,
                                            serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
    return str(path)


async def test_conformance_reports_the_level_and_why_not_the_next(daemon, nc, svc, nats_url):
    store = ArtefactStore(nc, svc)
    await store.start()
    try:
        await store.seed({"app": "{}"})
        ok = await cli("conformance", svc, "--nats", nats_url)
        assert ok.returncode == 0, ok.stderr
        assert f"{svc} meets L4" in ok.stdout
        silent = await cli("conformance", f"{svc}-nobody", "--nats", nats_url,
                           "--timeout", "0.3")
        assert silent.returncode == 1
        assert "spec.get" in silent.stdout
    finally:
        await store.stop()


async def test_revert_publishes_the_recorded_reversal(daemon, nc, svc, nats_url):
    store = ArtefactStore(nc, svc)
    await store.start()
    try:
        await store.seed({"app": '{"v": 1}'})
        before = await store.manifest()
        client = MeshClient(nc, svc)
        pid = await client.publish(swap(svc, {"app": '{"v": 2}'}))
        await approve(nc, client, svc, pid)
        out = await outcome(client, pid)
        assert out.ok
        done = await cli("revert", pid, "--nats", nats_url)
        assert done.returncode == 0, done.stderr
        assert out.revert_proposal_id in done.stdout and ALICE[0] in done.stdout
        rev = await outcome(client, out.revert_proposal_id)
        assert rev.ok and await store.manifest() == before
        again = await cli("revert", pid, "--nats", nats_url)  # rolled back now
        assert again.returncode == 1 and "rolled_back" in again.stderr
    finally:
        await store.stop()


async def test_tools_list_and_a_granted_call_from_the_terminal(daemon, nc, nats_url, alice_key,
                                                               svc):
    calls = []
    runtime = Runtime(svc, trust=signing.TrustStore.from_config({
        ALICE[0]: __import__("base64").b64encode(
            signing.raw_public(ALICE[1].public_key())).decode()}))
    runtime.register(Provider("swap.binary", "L4", "swap the binary",
                              lambda args: calls.append(args) or "swapped"))
    service = ToolRuntimeService(nc, runtime, daemon_key())
    await service.start()
    try:
        listed = await cli("tools", "list", svc, "--nats", nats_url)
        tool = json.loads(listed.stdout)["tools"][0]
        assert tool["gated_authority"] == "L4" and tool["mountable"] is False
        forever = await cli("tools", "grant", svc, "swap.binary", "--args", '{"to": "v2"}',
                            "--call", "--ttl", "90000", "--reason", "a year", "--key",
                            alice_key, "--principal", ALICE[0], "--nats", nats_url)
        assert forever.returncode == 2 and forever.stdout == ""  # nothing signed, no call
        assert forever.stderr == ("improved tools grant: --ttl 90000 is too long: a grant "
                                  "lives at most 86400 s (24 h); nothing signed\n")
        assert calls == []
        granted = await cli("tools", "grant", svc, "swap.binary", "--args", '{"to": "v2"}',
                            "--call", "--reason", "release 2", "--key", alice_key,
                            "--principal", ALICE[0], "--nats", nats_url)
        assert granted.returncode == 0, granted.stderr + granted.stdout
        assert json.loads(granted.stdout)["result"] == "swapped"
        await eventually(lambda: asyncio.sleep(0, result=calls))
        assert calls == [{"to": "v2"}]
    finally:
        await service.stop()


async def test_three_voters_approve_an_l4_from_the_terminal(quorum_daemon, own_server, tmp_path):
    from tests.bus import quorum_case
    from tests.keys import VOTERS

    nc, daemon = quorum_daemon
    store, client, pid = await quorum_case(nc, daemon, "qcli")
    for n, voter in enumerate(("agent-a", "agent-b", "agent-c")):
        key = tmp_path / f"{voter}.pem"
        key.write_bytes(VOTERS[voter].private_bytes(serialization.Encoding.PEM,
                                                    serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
        done = await cli("vote", pid, "approve", "--voter", voter, "--key", str(key),
                         "--session", f"model-{n}", "--nats", own_server.url)
        assert done.returncode == 0, done.stderr
        assert f"proposal:{pid}, diff:" in done.stdout  # the digests it signed, shown
    out = await outcome(client, pid)
    assert out.ok and out.authority.startswith("quorum:")
    shown = await cli("show", pid, "--nats", own_server.url)
    view = json.loads(shown.stdout)
    assert view["quorum"]["outcome"] == "approved" and len(view["quorum"]["votes"]) == 3
    await store.stop()


async def test_the_operator_sees_what_will_run_and_approves_exactly_that(daemon, nc, svc,
                                                                         nats_url, alice_key):
    """`improved review` renders an L4's body, every artefact it installs and the reversal
    it carries; a bare approval of a proposer-chosen reversal is refused (`unseen_body`);
    `improved approve` signs the digest of what it showed, and that approval counts."""
    client = MeshClient(nc, svc)
    proposal = msgspec.structs.replace(swap(svc, {"app": '{"v": 2}'}),
                                       revert={"restore": {"app": "sha256:" + "e" * 64}})
    pid = await client.publish(proposal)
    await eventually(lambda: client.decision(pid))
    shown = await cli("review", "--nats", nats_url)
    assert shown.returncode == 0, shown.stderr
    mine = shown.stdout.split(pid, 1)[1].split("decide:", 1)[0]
    assert "will run (digest " in mine and '"artefacts"' in mine
    assert "artefact app: installs digest sha256:" in mine and "smoke test" in mine
    assert "reversal, run later under this approval" in mine and "e" * 64 in mine
    await publish(nc, S.inbound_review(svc), review(pid))  # signed, but names no digest
    chain = await eventually(lambda: _refused(nc, svc, pid))
    assert "(unseen_body)" in chain
    done = await cli("approve", pid, "--reason", "saw the body and the reversal", "--key",
                     alice_key, "--principal", ALICE[0], "--nats", nats_url)
    assert done.returncode == 0, done.stderr
    assert "approving what will run" in done.stdout

    async def approved():
        state = await client.state(pid)
        return state if state is not None and state.status != "pending" else None

    assert (await eventually(approved)).status in ("approved", "applied")


async def _refused(nc, svc: str, pid: str) -> str | None:
    bodies = [body for _, body in await Store(nc).read_chain(svc, pid)]
    return next((b["reason"] for b in bodies if b.get("verdict") == "refused"), None)


async def test_a_session_upgrade_signed_and_revoked_from_the_terminal(daemon, nc, nats_url,
                                                                      alice_key, svc,
                                                                      tmp_path):
    """The session makes its key (`keys new`), the operator binds the upgrade to its public
    half (`keys show`), the session calls under it (`tools call`, which signs each call's
    proof with the session key); the envelope alone calls nothing; then a revocation."""
    from tests.tool_surfaces import runtime as tool_runtime

    rt, tools = tool_runtime(name=svc)
    service = ToolRuntimeService(nc, rt, daemon_key())
    await service.start()
    signer = ("--key", alice_key, "--principal", ALICE[0])
    made_key = await cli("keys", "new", "--signer", f"agent:{svc}:s1", "--dir", str(tmp_path))
    assert made_key.returncode == 0, made_key.stderr
    session_key = str(tmp_path / f"agent_{svc}_s1.pem")
    shown = await cli("keys", "show", session_key)
    public = shown.stdout.split("public key: ")[1].split()[0]
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    try:
        bad = await cli("tools", "upgrade", svc, "--session", "s1", "--session-key", public,
                        "--reason", "r", *signer)
        assert bad.returncode == 2 and "--tool" in bad.stderr
        bad = await cli("tools", "upgrade", svc, "--session", "s1", "--session-key", public,
                        "--class", "L4", "--path", "/a/../b", "--reason", "r", *signer)
        assert bad.returncode == 2 and "'..'" in bad.stderr
        for wrong, says in (("nope", "neither a key file nor a public key"),
                            (public[:-4] + "====", "neither a key file nor a public key"),
                            (str(not_pem), "is not a PEM private key")):
            bad = await cli("tools", "upgrade", svc, "--session", "s1", "--session-key", wrong,
                            "--class", "L4", "--reason", "r", *signer)
            assert bad.returncode == 2 and says in bad.stderr, bad.stderr
            assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
        bad = await cli("tools", "upgrade", svc, "--session", "s1", "--session-key", public,
                        "--class", "L4", "--ttl", "90000", "--reason", "r", *signer)
        assert bad.returncode == 2 and bad.stdout == ""  # nothing signed
        assert bad.stderr == ("improved tools upgrade: --ttl 90000 is too long: an upgrade "
                              "lives at most 86400 s (24 h); nothing signed\n")
        made = await cli("tools", "upgrade", svc, "--session", "s1", "--class", "L4",
                         "--session-key", public, "--ttl", "60", "--reason", "incident 7",
                         *signer)
        assert made.returncode == 0, made.stderr
        printed = json.loads(made.stdout)
        by_file = await cli("tools", "upgrade", svc, "--session", "s1", "--class", "L4",
                            "--session-key", session_key, "--reason", "r", *signer)
        assert by_file.returncode == 0, by_file.stderr  # the key file gives the same key
        up_file = tmp_path / "upgrade.json"
        up_file.write_text(made.stdout)

        bearer = {"tool": "deploy", "session": "s1", "upgrade": printed["envelope"]}
        reply = json.loads((await nc.request(S.tools_call(svc), json.dumps(bearer).encode(),
                                             timeout=5)).data)
        assert reply["refused"]["reason"] == "session_proof_missing"
        called = await cli("tools", "call", svc, "deploy", "--upgrade", str(up_file),
                           "--session-key", session_key, "--nats", nats_url)
        assert called.returncode == 0, called.stderr + called.stdout
        reply = json.loads(called.stdout)
        assert reply["ok"] is True and reply["upgrade"] == printed["upgrade_id"]
        for wrong, says in ((("--session-key", alice_key), "is not the key the upgrade is "
                                                            "bound to"),
                            (("--session-key", public), "a public key cannot sign"),
                            ((), "--upgrade and --session-key go together")):
            bad = await cli("tools", "call", svc, "deploy", "--upgrade", str(up_file), *wrong,
                            "--nats", nats_url)
            assert bad.returncode == 2 and says in bad.stderr, bad.stderr
            assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
        revoked = await cli("tools", "revoke", svc, printed["upgrade_id"], "--reason", "over",
                            "--nats", nats_url, *signer)
        assert revoked.returncode == 0, revoked.stderr + revoked.stdout
        assert json.loads(revoked.stdout)["revoked"] == printed["upgrade_id"]
        after = await cli("tools", "call", svc, "deploy", "--upgrade", str(up_file),
                          "--session-key", session_key, "--nats", nats_url)
        assert after.returncode == 1
        assert json.loads(after.stdout)["refused"]["reason"] == "revoked"
        assert len(tools["deploy"][1].calls) == 1
    finally:
        await service.stop()
