"""The command line as an operator uses it: the embedded server, propose, show, audit verify,
--help, a bad config file, and a clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal as signals
import subprocess
import sys
import time

import pytest

from improved.client import connection
from improved.client.keys import key_path
from improved.core import signing
from improved.runtime import bus
from tests.bus import eventually_blocking
from tests.cli import ENV, IMPROVED, decoy_data_dir, improved
from tests.factories import rank_proposal, skill_proposal


@pytest.mark.parametrize("command", [[], ["run"], ["propose"], ["show"], ["audit", "verify"],
                                     ["keys", "new"], ["review"], ["approve"], ["reject"],
                                     ["grant"], ["revoke"], ["skill", "hash"], ["rollback"],
                                     ["status"], ["crisis", "resolve"], ["demo"], ["bench"],
                                     ["audit", "rebuild"], ["revert"], ["vote"],
                                     ["conformance"], ["tools", "list"], ["tools", "grant"],
                                     ["tools", "upgrade"], ["tools", "call"],
                                     ["console"]])
def test_every_command_explains_itself(command):
    result = improved(*command, "--help")
    assert result.returncode == 0
    assert "usage: improved" in result.stdout
    assert len(result.stdout.split()) > 20


@pytest.mark.parametrize("action", ["upgrade", "call"])
def test_tools_help_says_what_the_session_key_is_for(action):
    result = improved("tools", action, "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--session-key" in text and "proof signed by it" in text


def test_a_missing_config_file_is_a_clear_error():
    result = improved("run", "--config", "/nonexistent/improved.toml")
    assert result.returncode == 2
    assert "config file not found: /nonexistent/improved.toml" in result.stderr


@pytest.mark.parametrize(("text", "line"), [
    ('[policy]\nforbidden_targets = "_spec/2026-04-20-00-constitution.md"\n',
     "improved: config error: policy.forbidden_targets: expected array, got str"),
    ('[apply]\ntimeout_s = "five"\n',
     "improved: config error: apply.timeout_s: expected float, got str"),
    ('[policy]\nmin_class = { grain = "L9" }\n',
     "improved: config error: policy.min_class.grain: expected one of L0, L1, L2, L3, L4, "
     "got 'L9'"),
    # invariants are floors: each loosening is refused before anything starts
    ('[policy]\nmin_class = { binary = "L0" }\n',
     "improved: config error: policy.min_class.binary: L0 is below the minimum L4 for binary: "
     "targets; a configuration may only raise it"),
    ('[policy]\nmin_class = { code = "L0", rank = "L0" }\n',
     "improved: config error: policy.min_class.code: L0 is below the minimum L4 for code: "
     "targets; a configuration may only raise it"),
    ('[policy]\nfallback_min_class = "L0"\n',
     "improved: config error: policy.fallback_min_class: L0 is below the built-in fallback L2 "
     "for schemes not listed; a configuration may only raise it"),
    ('[policy]\nquorum = true\n',
     "improved: config error: policy.quorum: true needs policy.quorum_amendment, the id of an "
     "approved constitution edit (a charter proposal) that permits the L4 quorum "
     "(SPEC 09 §6)"),
])
def test_improved_run_with_a_bad_config_says_one_line_and_exits(tmp_path, text, line):
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    done = subprocess.run([sys.executable, "-m", "improved.cli", "run", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "IMPROVED_CONFIG": ""})
    assert done.returncode == 2
    assert done.stderr == line + "\n"


def test_an_unreachable_server_is_a_clear_error(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(_builtins(rank_proposal("cli"))))
    result = improved("propose", "--nats", f"nats://u:secret@127.0.0.1:{bus.free_port()}",
                      str(p))
    assert result.returncode == 2
    assert "cannot reach NATS at nats://127.0.0.1:" in result.stderr
    assert "secret" not in result.stderr  # the password is not repeated


def test_provision_makes_what_is_missing_then_nothing(own_server):
    first = improved("provision", "--nats", own_server.url)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert "created stream IMPROVE_AUDIT" in lines and "created bucket improved_dedup" in lines
    assert "created bucket improved_windows" in lines and "created bucket improved_learned" in lines
    assert "created stream IMPROVE_TOOLS_AUDIT" in lines  # the tool runtimes' chains
    # and their marks: spent grants and proofs, revoked upgrades
    assert {"created stream IMPROVE_TOOLS_SPENT", "created stream IMPROVE_TOOLS_REVOKED"} <= {
        *lines}
    assert lines[-1].endswith("12 changed")
    again = improved("provision", "--nats", own_server.url)
    assert again.returncode == 0 and again.stdout.splitlines() == [
        f"provisioned {own_server.url}: the loop's streams, buckets and inbound consumer are in "
        "place (R1, records on memory); nothing changed"]
    # a change the server refuses is one line, never a traceback
    refused = improved("provision", "--nats", own_server.url, "--replicas", "3")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("improved provision: stream IMPROVE_IN differs from this "
                                     "configuration (num_replicas)"), refused.stderr
    assert len(refused.stderr.splitlines()) == 1


async def test_records_on_file_storage_are_kept_until_provision_moves_them(own_server):
    """A deployment made when retained records were on file storage: the daemon and a plain
    `improved provision` keep that stream (a stream's storage is fixed when it is made) and
    say so; `--move-records` makes it again on memory storage, and the running daemon refills
    it from the chains, so nothing a reader needs is missing."""
    from nats.js.api import StorageType

    from improved.client.sdk import MeshClient
    from improved.protocol import subjects as S
    from improved.runtime.daemon import Daemon
    from tests.bus import daemon_config, eventually

    nc = await connection.connect(own_server.url, "file-records")
    try:
        js = nc.jetstream()
        earlier = Daemon(nc, daemon_config(records_storage="file"))
        await earlier.start()
        client = MeshClient(nc, "movesvc")
        waiting = (await client.propose(skill_proposal("movesvc"))).proposal_id
        state = await client.state(waiting)
        await earlier.stop()

        daemon = Daemon(nc, daemon_config())  # the default: memory
        await daemon.start()
        try:
            assert (await js.stream_info(S.STREAM_RECORDS)).config.storage == StorageType.FILE
            kept = await asyncio.to_thread(improved, "provision", "--nats", own_server.url)
            assert kept.returncode == 0, kept.stderr
            assert ("stream IMPROVE_RECORDS keeps its file storage (records_storage is memory; "
                    "a stream's storage is fixed when it is made): `improved provision "
                    "--move-records` makes it again on memory, and the daemon refills it"
                    ) in kept.stdout.splitlines(), kept.stdout
            assert (await js.stream_info(S.STREAM_RECORDS)).config.storage == StorageType.FILE

            moved = await asyncio.to_thread(improved, "provision", "--nats", own_server.url,
                                            "--move-records")
            assert moved.returncode == 0, moved.stderr
            assert ("removed stream IMPROVE_RECORDS (file storage) to make it again on memory: "
                    "the daemon refills its records from the chains") in moved.stdout, moved.stdout
            assert "created stream IMPROVE_RECORDS" in moved.stdout.splitlines()
            assert (await js.stream_info(S.STREAM_RECORDS)).config.storage == StorageType.MEMORY
            assert await eventually(lambda: client.state(waiting), timeout=20) == state
            assert await eventually(lambda: daemon.store.filled(), timeout=20)
        finally:
            await daemon.stop()
    finally:
        await connection.close(nc)


async def test_provision_removes_the_state_bucket_an_earlier_version_kept(own_server):
    """An earlier version's state cache (the bucket improved_state): the daemon starts beside
    it and leaves it alone; `improved provision` removes it, saying so once."""
    from nats.js.api import StorageType
    from nats.js.errors import NotFoundError

    from improved.runtime.daemon import Daemon
    from tests.bus import daemon_config

    nc = await connection.connect(own_server.url, "old-deployment")
    try:
        js = nc.jetstream()
        old = await js.create_key_value(bucket="improved_state", history=1,
                                        storage=StorageType.MEMORY)
        await old.put("svc.x", b"an earlier version's cached record")
        daemon = Daemon(nc, daemon_config())
        await daemon.start()
        await daemon.stop()
        assert (await js.stream_info("KV_improved_state")).state.messages == 1  # untouched
        first = await asyncio.to_thread(improved, "provision", "--nats", own_server.url)
        assert first.returncode == 0, first.stderr
        assert "removed bucket improved_state (no longer used)" in first.stdout.splitlines()
        with pytest.raises(NotFoundError):
            await js.stream_info("KV_improved_state")
        again = await asyncio.to_thread(improved, "provision", "--nats", own_server.url)
        assert again.returncode == 0 and "improved_state" not in again.stdout, again.stdout
    finally:
        await connection.close(nc)


def _builtins(proposal) -> dict:
    import msgspec

    return msgspec.to_builtins(proposal)


def test_run_propose_show_verify_and_stop(tmp_path):
    port = bus.free_port()
    data_dir = tmp_path / "data"
    daemon = subprocess.Popen([*IMPROVED, "run", "--data-dir", str(data_dir), "--port",
                               str(port)], stderr=subprocess.PIPE, text=True, env=ENV)
    url = f"nats://127.0.0.1:{port}"
    try:
        banner = daemon.stderr.readline()
        assert f"listening on {url}" in banner and "sync=always" in banner
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = daemon.stderr.readline()
            if "ready as improved:" in line:
                break
        else:
            pytest.fail("the daemon never said it was ready")
        assert (data_dir / "jetstream").is_dir()

        rank = tmp_path / "rank.json"
        rank.write_text(json.dumps(_builtins(rank_proposal("clisvc"))))
        skill = tmp_path / "skill.json"
        skill.write_text(json.dumps(_builtins(skill_proposal("clisvc"))))
        first = improved("propose", "--json", "--nats", url, str(rank))
        assert first.returncode == 0, first.stderr
        reply = json.loads(first.stdout)
        assert re.fullmatch(r"[0-9a-f]{64}", reply["proposal_id"])
        second = improved("propose", "--json", "--nats", url, "-", input=skill.read_text())
        assert json.loads(second.stdout)["status"] == "pending"

        bad = improved("propose", "--json", "--nats", url, "-",
                       input=json.dumps({**_builtins(skill_proposal("clisvc")),
                                         "rec_status": "approved"}))
        assert bad.returncode == 2  # a malformed proposal: a bad input file, as if refused here
        assert json.loads(bad.stdout)["error"]["code"] == "status_forbidden"

        shown = improved("show", "--nats", url, json.loads(second.stdout)["proposal_id"])
        assert shown.returncode == 0, shown.stderr
        view = json.loads(shown.stdout)
        # no daemon key here to check who wrote the trailers: it says so rather than "verified"
        assert view["chain"].startswith("UNVERIFIED writers (no trusted daemon key: "), view
        assert view["chain"].endswith("hashes and links verified; who wrote the trailers and "
                                      "the signed acts they carry are not checked")
        assert view["decision"]["cause"] == "awaiting_operator"
        assert [t["to_stage"] for t in view["trailers"]] == ["propose", "triage"]

        # the daemon's checkpoint file names the key its checkpoints are signed with
        verified = improved("audit", "verify", "--nats", url, "--checkpoint",
                            str(data_dir / "last-checkpoint.json"))
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert "4/4 chains verified" in verified.stdout  # 2 proposals, checkpoints, policy
        checkpoint_file = data_dir / "last-checkpoint.json"
        assert verified.stdout.splitlines()[-1].startswith(
            "VERIFIED 4 chains: hashes, links, daemon signatures and signed acts, against "
            "daemon key "), verified.stdout
        assert verified.stdout.splitlines()[-1].endswith(
            f"(the checkpoint file {checkpoint_file})"), verified.stdout
        # signed when the daemon started, over the policy it had just recorded
        assert "checkpoint of 1 trailers" in verified.stdout
        # no daemon key to trust: nothing wrong is found, and who wrote it is not checked
        untrusted = improved("audit", "verify", "--nats", url)
        assert untrusted.returncode == 3, untrusted.stdout + untrusted.stderr
        assert "BROKEN" not in untrusted.stdout, untrusted.stdout
        assert untrusted.stdout.splitlines()[-1].startswith(
            "UNVERIFIED writers (no trusted daemon key: name it in [trust] daemons, give "
            "--data-dir of the daemon that wrote the log, or --checkpoint FILE): hashes and "
            "links of 4 chains verified"), untrusted.stdout
        # the daemon's data directory, by the environment alone: its key is found there
        found = improved("audit", "verify", "--nats", url, env={"IMPROVED_DATA_DIR":
                                                                 str(data_dir)})
        assert found.returncode == 0, found.stdout + found.stderr
        assert f"(the checkpoint key {data_dir / 'checkpoint.pem'})" in found.stdout
        # the daemon's data directory as this user's default: no flag, no variable
        state = tmp_path / "state"
        state.mkdir()
        (state / "improved").symlink_to(data_dir)
        default = improved("audit", "verify", "--nats", url, env={"XDG_STATE_HOME": str(state)})
        assert default.returncode == 0, default.stdout + default.stderr
        assert default.stdout.splitlines()[-1].startswith("VERIFIED 4 chains"), default.stdout
        # another deployment's data directory: named as such, not taken for tampering
        decoy = decoy_data_dir(tmp_path / "decoy")
        other = improved("audit", "verify", "--nats", url,
                         env={"IMPROVED_DATA_DIR": str(tmp_path / "decoy")})
        assert other.returncode == 3 and "BROKEN" not in other.stdout, other.stdout
        assert f"holds the checkpoint key or kept checkpoint of another deployment (daemon " \
            f"key {decoy[:16]}…" in other.stderr, other.stderr
        one = improved("audit", "verify", "--nats", url, reply["proposal_id"], "--checkpoint",
                       str(data_dir / "last-checkpoint.json"))
        assert one.returncode == 0 and "1/1 chains verified" in one.stdout, one.stdout
        assert "daemon signatures and signed acts: " in one.stdout
        unkeyed = improved("audit", "verify", "--nats", url, reply["proposal_id"])
        assert unkeyed.returncode == 3 and "UNVERIFIED writers" in unkeyed.stdout, \
            unkeyed.stdout
        missing = improved("show", "--nats", url, "f" * 64)
        assert missing.returncode == 1 and "no proposal" in missing.stderr
    finally:
        daemon.send_signal(signals.SIGTERM)
        code = daemon.wait(30)
    assert code == 0


def test_a_signer_key_for_a_mesh_identity(tmp_path):
    """`keys new --signer` makes the key a check or an agent signs its signals with, and prints
    the [trust.signers] entry; anything but an identity is one line and exit 2."""
    made = improved("keys", "new", "--signer", "check:ci", "--dir", str(tmp_path))
    assert made.returncode == 0, made.stderr
    assert made.stdout.split("[trust.signers]\n", 1)[1].startswith('"check:ci" = "')
    for bad in ("ci", "operator:alice", "agent:x"):
        refused = improved("keys", "new", "--signer", bad, "--dir", str(tmp_path))
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1


def test_keys_show_prints_the_public_key_and_the_key_id_a_service_trusts(tmp_path):
    """`keys show FILE`: the base64 key a trust table lists and the key id a signature names
    (what `skills_store --trust-daemon` takes); a file that is not a key is one line, exit 2."""
    made = improved("keys", "new", "--signer", "check:show", "--dir", str(tmp_path))
    entry = made.stdout.strip().splitlines()[-1].split(" = ")[1].strip('"')
    shown = improved("keys", "show", str(key_path("check:show", tmp_path)))
    assert shown.returncode == 0, shown.stderr
    public, keyid = (line.split(": ", 1)[1] for line in shown.stdout.splitlines())
    assert public == entry
    assert keyid == signing.keyid_of(base64.b64decode(public))
    (tmp_path / "junk.pem").write_text("not a key")
    bad = improved("keys", "show", str(tmp_path / "junk.pem"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_an_operator_signs_from_the_terminal(tmp_path):
    """keys new → trust it in the config → review shows the queue → approve moves it."""
    keys = tmp_path / "keys"
    made = improved("keys", "new", "--principal", "operator:carol", "--dir", str(keys))
    assert made.returncode == 0, made.stderr
    key_file = keys / "operator_carol.pem"
    assert key_file.stat().st_mode & 0o777 == 0o600
    entry = made.stdout.split("[trust.operators]\n", 1)[1].strip()
    assert entry.startswith('"operator:carol" = "')
    again = improved("keys", "new", "--principal", "operator:carol", "--dir", str(keys))
    assert again.returncode == 1 and "refusing to overwrite" in again.stderr

    port = bus.free_port()
    config = tmp_path / "improved.toml"
    config.write_text(f'port = {port}\ndata_dir = "{tmp_path / "data"}"\n\n'
                      f"[trust.operators]\n{entry}\n")
    daemon = subprocess.Popen([*IMPROVED, "run", "--config", str(config)],
                              stderr=subprocess.PIPE, text=True, env=ENV)
    url = f"nats://127.0.0.1:{port}"
    try:
        while "ready as improved:" not in daemon.stderr.readline():
            pass
        skill = tmp_path / "skill.json"
        proposal = _builtins(skill_proposal("clisvc"))
        skill.write_text(json.dumps(proposal))
        hashed = improved("skill", "hash", str(skill))
        from improved.protocol import canonical

        assert hashed.stdout.strip() == canonical.skill_identity(
            proposal["proposal_data"]["skill"])
        pid = json.loads(improved("propose", "--json", "--nats", url,
                                 str(skill)).stdout)["proposal_id"]

        surfaced = json.loads(improved("propose", "--json", "--nats", url, "-", input=json.dumps(
            _builtins(skill_proposal("clisvc", change_class="L1", name="other")))).stdout)
        queue = improved("review", "--nats", url)
        assert pid in queue.stdout and "awaiting_operator" in queue.stdout
        assert surfaced["proposal_id"] in queue.stdout and "L1 is never applied" in queue.stdout
        assert "add skill summarize" in queue.stdout and "independent positive" in queue.stdout

        approved = improved("approve", pid, "--nats", url, "--reason", "read it",
                            "--key", str(key_file), "--principal", "operator:carol")
        assert approved.returncode == 0, approved.stderr
        def approved_view() -> dict | None:
            view = json.loads(improved("show", "--nats", url, pid).stdout)
            return view if view["state"]["status"] == "approved" else None

        view = eventually_blocking(approved_view, 20, 0.2)  # no service applies it here
        approvals = [t for t in view["trailers"] if t.get("verdict") == "approve"]
        assert [t["actor"] for t in approvals] == ["operator:carol"]
        assert pid not in improved("review", "--nats", url).stdout
    finally:
        daemon.send_signal(signals.SIGTERM)
        assert daemon.wait(30) == 0


def test_credentials_in_the_url_go_to_every_server():
    assert connection.split_credentials("nats://u:p%40x@h1:4222,nats://h2:4223") == (
        ["nats://h1:4222", "nats://h2:4223"], {"user": "u", "password": "p@x"})
    assert connection.split_credentials("nats://s3cret@h:4222") == (["nats://h:4222"],
                                                                    {"token": "s3cret"})
    assert connection.split_credentials("nats://127.0.0.1:4222") == (["nats://127.0.0.1:4222"], {})


def test_run_tells_systemd_when_it_is_ready_and_when_it_stops(tmp_path):
    import socket

    sock_path = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(sock_path))
    listener.settimeout(30)
    env = {**ENV, "NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "2000000"}
    daemon = subprocess.Popen([*IMPROVED, "run", "--data-dir", str(tmp_path / "d"), "--port",
                               str(bus.free_port())], stderr=subprocess.DEVNULL, env=env)
    try:
        seen: list[str] = []
        while not any("READY=1" in m for m in seen) or not any("WATCHDOG=1" in m for m in seen):
            seen.append(listener.recv(4096).decode())
        daemon.send_signal(signals.SIGTERM)
        while not any("STOPPING=1" in m for m in seen):
            seen.append(listener.recv(4096).decode())
        assert daemon.wait(30) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
        listener.close()


def test_metrics_and_health_are_served_while_the_daemon_runs(tmp_path):
    import urllib.request

    port, mport = bus.free_port(), bus.free_port()
    daemon = subprocess.Popen([*IMPROVED, "run", "--data-dir", str(tmp_path / "d"), "--port",
                               str(port), "--metrics-port", str(mport)],
                              stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        while "ready as improved:" not in daemon.stderr.readline():
            pass

        def get(path: str) -> tuple[int, str]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{mport}{path}", timeout=5) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as err:
                return err.code, err.read().decode()

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if get("/readyz")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        assert get("/healthz") == (200, "ok")
        assert get("/readyz") == (200, "ready")
        skill = tmp_path / "skill.json"
        skill.write_text(json.dumps(_builtins(skill_proposal("metricsvc"))))
        improved("propose", "--nats", f"nats://127.0.0.1:{port}", str(skill))
        status, body = get("/metrics")
        assert status == 200
        assert 'improved_transitions_total{cause="awaiting_operator",class="L2",' \
               'stage="triage",verdict="defer"} 1.0' in body
        assert "improved_pending_reviews 1.0" in body
        assert get("/nope")[0] == 404
    finally:
        daemon.send_signal(signals.SIGTERM)
        assert daemon.wait(30) == 0
