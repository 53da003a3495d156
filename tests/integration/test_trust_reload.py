"""SIGHUP on `improved run` re-reads the trust store from the configuration file: a key trusted
after the reload can approve, a removed one cannot, and a file that does not load is one error
line that changes nothing — the old trust stays, and nothing is appended to the trust chain.
Whatever the reloads, the log verifies: every act rests on a key the trust chain recorded
before the act."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.client import connection
from improved.client.sdk import MeshClient
from improved.core import evidence, signing
from improved.protocol import subjects as S
from improved.runtime.store import Store
from improved.testing import skill_proposal
from tests.bus import eventually_blocking, log_events, wait_for_event
from tests.cli import ENV, IMPROVED
from tests.keys import ALICE

BOB = ("operator:bob", Ed25519PrivateKey.generate())


def pem(path: Path, key: Ed25519PrivateKey) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return str(path)


def entry(who: tuple[str, Ed25519PrivateKey]) -> str:
    public = base64.b64encode(signing.raw_public(who[1].public_key())).decode()
    return f'"{who[0]}" = "{public}"'


async def propose(url: str, svc: str, names: list[str]) -> list[str]:
    nc = await connection.connect(url, "reload-test", persistent=False)
    try:
        client = MeshClient(nc, svc)
        return [(await client.propose(skill_proposal(svc, name=n))).proposal_id for n in names]
    finally:
        await connection.close(nc)


async def trust_chain_length(url: str) -> int:
    nc = await connection.connect(url, "reload-test", persistent=False)
    try:
        return len(await Store(nc).read_chain_at(S.trust_audit(evidence.TRUST_ID)))
    finally:
        await connection.close(nc)


def test_sighup_reloads_the_trust_store_and_a_broken_file_changes_nothing(own_server,
                                                                         tmp_path):
    url = own_server.url
    env = {**ENV, "IMPROVED_NATS_URL": url, "XDG_STATE_HOME": str(tmp_path / "state")}
    config = tmp_path / "improved.toml"
    config.write_text(f"[trust.operators]\n{entry(ALICE)}\n")
    alice, bob = pem(tmp_path / "alice.pem", ALICE[1]), pem(tmp_path / "bob.pem", BOB[1])

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*IMPROVED, *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=60)

    def approve(pid: str, who: tuple[str, Ed25519PrivateKey], key: str):
        return cli("approve", pid, "--reason", "reload test", "--key", key,
                   "--principal", who[0])

    def hup() -> None:
        daemon.send_signal(signal.SIGHUP)

    log = tmp_path / "daemon.log"
    with log.open("w") as out:
        daemon = subprocess.Popen([*IMPROVED, "run", "--config", str(config)], cwd=tmp_path,
                                  env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        def ready() -> bool:
            assert daemon.poll() is None, log.read_text()
            return "improved: ready as" in log.read_text()

        eventually_blocking(ready, 30, 0.05, what="the daemon ready")
        assert f"(pid {daemon.pid})" in log.read_text()
        pids = asyncio.run(propose(url, "reload", ["one", "two", "three", "four"]))

        refused = approve(pids[0], BOB, bob)  # not trusted yet
        assert refused.returncode == 1 and "(unknown_key)" in refused.stderr, refused.stderr
        assert "kill -HUP" in refused.stderr  # the fix names the reload

        config.write_text(f"[trust.operators]\n{entry(ALICE)}\n{entry(BOB)}\n")
        hup()
        line = wait_for_event(log, "trust store reloaded", 1)
        assert "operator operator:bob ed25519:" in line and '"removed": []' in line, line
        assert "not_reloaded" not in line  # nothing else changed
        ok = approve(pids[1], BOB, bob)
        assert ok.returncode == 0, ok.stderr
        assert f"accepted: approve of {pids[1]} signed by operator:bob" in ok.stdout

        recorded = asyncio.run(trust_chain_length(url))
        config.write_text('[trust.operators]\n"operator:bob" = "not a key"\n')
        hup()
        bad = wait_for_event(log, "trust store not reloaded", 1)
        assert "trust.operators" in bad and "base64" in bad, bad
        assert asyncio.run(trust_chain_length(url)) == recorded  # nothing recorded
        still = approve(pids[2], BOB, bob)  # the trust in force stayed
        assert still.returncode == 0, still.stderr

        config.write_text(f"[trust.operators]\n{entry(BOB)}\n[policy]\nautonomy = \"off\"\n")
        hup()
        line = wait_for_event(log, "trust store reloaded", 2)
        assert "operator operator:alice ed25519:" in line and '"added": []' in line, line
        assert '"not_reloaded_restart_to_apply": ["policy"]' in line, line
        gone = approve(pids[3], ALICE, alice)
        assert gone.returncode == 1 and "(unknown_key)" in gone.stderr, gone.stderr

        verified = cli("audit", "verify")
        assert verified.returncode == 0, verified.stdout + verified.stderr
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    text = log.read_text()
    assert daemon.returncode == 0, text[-3000:]
    assert "Traceback" not in text, text
    assert len(log_events(log, "trust store not reloaded")) == 1
    # the default data directory, this user's state directory, not where it ran
    assert os.path.exists(tmp_path / "state" / "improved" / "checkpoint.pem")
    assert not os.path.exists(tmp_path / ".improved")
