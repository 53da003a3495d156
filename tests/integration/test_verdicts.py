"""An operator command says what the daemon made of it: it waits for the trailer that carries
its signed act (or the triage of what it proposed) and prints it in one line — accepted (exit
0), refused with the cause and the fix (exit 1), or no verdict in time (exit 1)."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.client import connection
from improved.client.sdk import MeshClient
from improved.runtime.store import Store
from tests.bus import eventually
from tests.cli import improved
from tests.factories import review
from tests.keys import ALICE, MALLORY

pytestmark = pytest.mark.asyncio(loop_scope="session")


def cli(*args: str):
    return asyncio.to_thread(improved, *args)


def pem(path, key: Ed25519PrivateKey) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return str(path)


async def test_approve_waits_for_the_daemons_verdict(daemon, nc, svc, nats_url, tmp_path):
    from improved.testing import skill_proposal

    pid = (await MeshClient(nc, svc).propose(skill_proposal(svc))).proposal_id
    # a key the daemon does not trust: refused on the chain, said at once, exit 1
    untrusted = await cli("approve", pid[:12], "--nats", nats_url, "--reason", "looks fine",
                          "--key", pem(tmp_path / "m.pem", MALLORY[1]),
                          "--principal", MALLORY[0])
    assert untrusted.returncode == 1, untrusted.stdout + untrusted.stderr
    assert len(untrusted.stderr.splitlines()) == 1 and "Traceback" not in untrusted.stderr
    assert untrusted.stderr.startswith(f"improved approve: refused: approve of {pid} signed by "
                                       f"{MALLORY[0]} (unknown_key): ")
    assert "[trust.operators]" in untrusted.stderr  # what to do

    alice = pem(tmp_path / "a.pem", ALICE[1])
    approved = await cli("approve", pid, "--nats", nats_url, "--reason", "read it",
                         "--key", alice, "--principal", ALICE[0])
    assert approved.returncode == 0, approved.stderr
    line = approved.stdout.splitlines()[-1]
    assert line.startswith(f"accepted: approve of {pid} signed by {ALICE[0]}: approved")
    # an approval after that one: the daemon refuses it, and says why
    again = await cli("approve", pid, "--nats", nats_url, "--reason", "twice",
                      "--key", alice, "--principal", ALICE[0])
    assert again.returncode == 1 and "(not_awaiting_review)" in again.stderr, again.stderr
    assert f"improved show {pid}" in again.stderr


async def test_no_daemon_is_no_verdict_in_time_and_no_wait_returns_at_once(own_server,
                                                                         tmp_path):
    """A proposal's chain on a server no daemon serves: the act is published, nobody answers."""
    from improved.runtime.daemon import Daemon
    from improved.testing import skill_proposal
    from tests.bus import daemon_config

    conn = await connection.connect(own_server.url, "verdicts-test")
    daemon = Daemon(conn, daemon_config())
    await daemon.start()
    pid = (await MeshClient(conn, "quiet").propose(skill_proposal("quiet"))).proposal_id
    await daemon.stop()
    await conn.drain()
    alice = pem(tmp_path / "a.pem", ALICE[1])
    late = await cli("reject", pid, "--nats", own_server.url, "--reason", "no", "--key", alice,
                     "--principal", ALICE[0], "--timeout", "0.5")
    assert late.returncode == 1 and late.stdout == ""
    assert late.stderr == (f"improved reject: no verdict within 0.5 s: reject of {pid} signed "
                           f"by {ALICE[0]} was published, but the daemon has not recorded it "
                           "yet (is it running? on this server?); `improved show "
                           f"{pid}` shows whether it does\n")
    quick = await cli("reject", pid, "--nats", own_server.url, "--reason", "no", "--key", alice,
                      "--principal", ALICE[0], "--no-wait")
    assert quick.returncode == 0 and "published" in quick.stdout, quick.stderr


async def test_propose_says_the_decision_its_cause_and_the_fix(daemon, svc, nats_url,
                                                               tmp_path):
    from improved.testing import rank_proposal, skill_proposal

    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps(msgspec.to_builtins(
        rank_proposal(svc, target_ref="rnk:search.title_boost"))))
    rejected = await cli("propose", str(typo), "--nats", nats_url)
    assert rejected.returncode == 1 and rejected.stdout == ""
    assert len(rejected.stderr.splitlines()) == 1
    assert "rejected: reject/class_mismatch at L0: the target scheme rnk: is not one SPEC 09 " \
           "lists (did you mean rank:?)" in rejected.stderr, rejected.stderr

    waits = tmp_path / "skill.json"
    waits.write_text(json.dumps(msgspec.to_builtins(skill_proposal(svc))))
    pending = await cli("propose", str(waits), "--nats", nats_url)
    assert pending.returncode == 0, pending.stderr
    assert " pending: defer/awaiting_operator at L2: " in pending.stdout
    assert "improved approve|reject" in pending.stdout
    as_json = await cli("propose", "--json", str(typo), "--nats", nats_url)
    reply = json.loads(as_json.stdout)
    assert as_json.returncode == 1 and reply["status"] == "rejected"
    assert reply["decision"]["cause"] == "class_mismatch" and "rnk:" in reply["says"]


async def test_a_vote_and_a_grant_wait_too(daemon, nc, svc, nats_url, tmp_path):
    """A grant naming a proposal that was never applied is refused on the grant chain; a vote
    on a proposal with no quorum open is refused `closed` — each said in one line."""
    from improved.testing import skill_proposal
    from tests.keys import VOTERS

    proposal = skill_proposal(svc, name=f"s{svc.replace('-', '')}")
    pid = (await MeshClient(nc, svc).propose(proposal)).proposal_id
    from improved.protocol import canonical

    skill = canonical.skill_identity(msgspec.to_builtins(proposal.proposal_data["skill"]))
    granted = await cli("grant", skill, "--proposal", pid, "--nats", nats_url, "--reason",
                        "trust it", "--key", pem(tmp_path / "a.pem", ALICE[1]),
                        "--principal", ALICE[0])
    assert granted.returncode == 1 and "(not_applied_at_l2)" in granted.stderr, granted.stderr
    voted = await cli("vote", pid, "approve", "--voter", "agent-a", "--key",
                      pem(tmp_path / "v.pem", VOTERS["agent-a"]), "--session", "m1",
                      "--nats", nats_url)
    # the session daemon trusts no voters: its key is unknown there
    assert voted.returncode == 1 and "refused: approve on" in voted.stderr, voted.stderr


async def test_a_review_published_by_hand_is_not_taken_for_the_commands_own(daemon, nc, svc,
                                                                           nats_url, tmp_path):
    """Only the trailer carrying this command's act is its verdict: another operator's act
    on the same chain, before or during the wait, is not."""
    from improved.protocol import subjects as S
    from improved.testing import skill_proposal
    from tests.bus import publish

    pid = (await MeshClient(nc, svc).propose(skill_proposal(svc))).proposal_id
    await publish(nc, S.inbound_review(svc), review(pid, "approve", who=MALLORY))

    async def refused():
        chain = [b for _, b in await Store(nc).read_chain(svc, pid)]
        return any(b.get("verdict") == "refused" for b in chain) or None

    await eventually(refused)
    done = await cli("reject", pid, "--nats", nats_url, "--reason", "no", "--key",
                     pem(tmp_path / "a.pem", ALICE[1]), "--principal", ALICE[0])
    assert done.returncode == 0 and done.stdout.startswith("accepted: reject of"), done.stderr
