"""Loss of the audit log detected (issue 13, item 4): the daemon keeps its last checkpoint in
its data directory as well, so a deleted, re-created, shorter, rewritten or damaged audit
stream is a crisis at start, and `improved audit verify --checkpoint FILE` names what is
missing; a checkpoint signed by a key no one trusts is a break of its own."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.client import connection
from improved.client.sdk import MeshClient
from improved.core import checkpoint
from improved.protocol import subjects as S
from improved.protocol.model import ApplyResult
from improved.runtime.daemon import Daemon
from improved.runtime.store import Store
from tests.bus import daemon_config, eventually
from tests.cli import improved
from tests.factories import rank_proposal

SVC = "loss"


def _config(tmp_path: Path):
    return msgspec.structs.replace(daemon_config(), checkpoint_interval_s=0.0,
                                   data_dir=tmp_path / "data")


class _Applier:
    def __init__(self):
        self.orders: list[str] = []

    async def __call__(self, order):
        self.orders.append(order.proposal_id)
        return ApplyResult(ok=True, applied_id="x", rollbackable=False)


async def _history(url: str, config, proposals: int = 3) -> list[str]:
    """A daemon applies a few L0 proposals, signs a checkpoint over them and stops."""
    nc = await connection.connect(url, "loss-history")
    daemon = Daemon(nc, config)
    await daemon.start()
    client = MeshClient(nc, SVC)
    sub = await client.serve_apply(_Applier())
    try:
        pids = [(await client.propose(rank_proposal(SVC, key=f"h{i}"))).proposal_id
                for i in range(proposals)]
        for pid in pids:
            await eventually(lambda pid=pid: _applied(client, pid))
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None
    finally:
        await sub.unsubscribe()
        await daemon.stop()
        await connection.close(nc)
    return pids


async def _applied(client, pid):
    state = await client.state(pid)
    return state if state is not None and state.status == "applied" else None


async def _restart(url: str, config, bound_s: float = 30.0):
    """A new daemon on the same data directory; its start must end within `bound_s`."""
    nc = await connection.connect(url, "loss-restart")
    daemon = Daemon(nc, config)
    started = time.monotonic()
    await asyncio.wait_for(daemon.start(), bound_s)
    return nc, daemon, time.monotonic() - started


async def _verify(url: str, *extra: str, env: dict[str, str] | None = None):
    return await asyncio.to_thread(improved, "audit", "verify", "--nats", url, *extra, env=env)


async def _no_apply_in_crisis(nc, daemon) -> None:
    """An open crisis on the autonomy chain, and an accepted L0 proposal is not applied."""
    assert (await daemon.engine.autonomy.state(2**62)).crisis.startswith("crisis-")
    client = MeshClient(nc, SVC)
    applier = _Applier()
    sub = await client.serve_apply(applier)
    try:
        pid = (await client.propose(rank_proposal(SVC, key="after"))).proposal_id
        assert (await client.triage(pid)).verdict == "accept"
        await asyncio.sleep(0.5)
        assert applier.orders == []
    finally:
        await sub.unsubscribe()


async def test_a_stream_deleted_while_the_daemon_was_stopped_is_a_crisis(own_server, tmp_path):
    config = _config(tmp_path)
    await _history(own_server.url, config)
    anchor = config.data_dir / "last-checkpoint.json"
    count = json.loads(anchor.read_text())["count"]  # every trailer but the checkpoints'
    assert count >= 9  # three proposals of at least three trailers, the policy chain
    nc = await connection.connect(own_server.url, "attacker")
    await nc.jetstream().delete_stream(S.STREAM_AUDIT)
    await connection.close(nc)

    gone = await _verify(own_server.url, "--checkpoint", str(anchor))
    assert gone.returncode == 1, gone.stdout + gone.stderr
    assert "BROKEN" in gone.stdout and "does not exist" in gone.stdout, gone.stdout
    assert f"{count} trailers" in gone.stdout and "Traceback" not in gone.stderr

    nc, daemon, _ = await _restart(own_server.url, config)
    try:
        await _no_apply_in_crisis(nc, daemon)
        verify = await _verify(own_server.url, "--checkpoint", str(anchor))
        assert verify.returncode == 1, verify.stdout + verify.stderr
        assert "re-created" in verify.stdout and f"{count} trailers" in verify.stdout, (
            verify.stdout)
        # found by the data directory alone, the file is this log's (its key signs the new
        # stream's daemon chains): the re-creation is a break, not "another deployment"
        found = await _verify(own_server.url, env={"IMPROVED_DATA_DIR": str(config.data_dir)})
        assert found.returncode == 1, found.stdout + found.stderr
        assert "re-created" in found.stdout and "another deployment" not in found.stderr, (
            found.stdout + found.stderr)
        # the data directory remembers the open crisis: a second restart is still in crisis
        assert json.loads(anchor.read_text())["crisis"].startswith("crisis-")
    finally:
        await daemon.stop()
        await connection.close(nc)


async def test_a_rewritten_stream_with_a_rogue_checkpoint_is_named(own_server, tmp_path):
    config = _config(tmp_path)
    pids = await _history(own_server.url, config)
    anchor = config.data_dir / "last-checkpoint.json"
    count = json.loads(anchor.read_text())["count"]
    nc = await connection.connect(own_server.url, "attacker")
    try:
        store = Store(nc)
        log = await store.audit_log()
        await nc.jetstream().delete_stream(S.STREAM_AUDIT)
        await store.ensure()
        kept = [(subject, body) for _, subject, body in log if pids[0] not in subject]
        removed = len(log) - len(kept)
        for subject, body in kept:  # everything again, but the first proposal's chain
            await store.js.publish(subject, msgspec.json.encode(body), stream=S.STREAM_AUDIT)
        cp_subject = S.checkpoint_audit(checkpoint.CHECKPOINT_ID)
        hashes = [b["hash"] for s, b in kept if s != cp_subject]
        rogue = checkpoint.make(hashes, len(kept), int(time.time() * 1000),
                                Ed25519PrivateKey.generate())
        await store.append_sealed(cp_subject, checkpoint.CHECKPOINT_ID, "L0", "operation",
                                  lambda chain, at: checkpoint.draft(rogue, "improved:rogue"))
    finally:
        await connection.close(nc)

    for extra, env in ((("--checkpoint", str(anchor)), None),
                       ((), {"IMPROVED_DATA_DIR": str(config.data_dir)})):
        verify = await _verify(own_server.url, *extra, env=env)
        assert verify.returncode == 1, verify.stdout + verify.stderr
        assert rogue.keyid in verify.stdout and "not a trusted daemon key" in verify.stdout, (
            verify.stdout)
        assert f"{count} trailers" in verify.stdout, verify.stdout
        assert f"only {count - removed}" in verify.stdout, verify.stdout
        assert "another deployment" not in verify.stderr, verify.stderr


async def test_one_byte_altered_on_disk_is_a_crisis_not_a_hang(own_server, tmp_path):
    config = _config(tmp_path)
    await _history(own_server.url, config)
    own_server.stop()
    blocks = sorted((own_server.data_dir / "jetstream").rglob(f"{S.STREAM_AUDIT}/msgs/*.blk"))
    assert blocks, "no block file for the audit stream"
    data = bytearray(blocks[0].read_bytes())
    at = data.index(b'"reason"')  # inside the first trailer's JSON body
    data[at + 3] ^= 0x01
    blocks[0].write_bytes(bytes(data))
    own_server.start()

    nc, daemon, seconds = await _restart(own_server.url, config)
    try:
        assert seconds < 20, seconds
        await _no_apply_in_crisis(nc, daemon)
        verify = await _verify(own_server.url, "--checkpoint",
                               str(config.data_dir / "last-checkpoint.json"))
        assert verify.returncode == 1, verify.stdout + verify.stderr
        assert "could not be read" in verify.stdout and "stream sequence 1" in verify.stdout, (
            verify.stdout)
        assert "Traceback" not in verify.stderr, verify.stderr
    finally:
        await daemon.stop()
        await connection.close(nc)


async def test_a_normal_restart_is_no_crisis(own_server, tmp_path):
    config = _config(tmp_path)
    await _history(own_server.url, config)
    anchor = config.data_dir / "last-checkpoint.json"
    before = json.loads(anchor.read_text())
    nc, daemon, _ = await _restart(own_server.url, config)
    try:
        assert (await daemon.engine.autonomy.state(2**62)).crisis == ""
        after = json.loads(anchor.read_text())
        assert after["count"] == before["count"] and after["crisis"] == ""
        assert after["stream_created"] == before["stream_created"]
        assert after["at"] > before["at"]  # the checkpoint signed at this start
        verify = await _verify(own_server.url, "--checkpoint", str(anchor))
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert "holds" in verify.stdout
    finally:
        await daemon.stop()
        await connection.close(nc)


async def test_a_checkpoint_reads_what_is_new_and_still_finds_covered_trailers_removed(
        own_server, tmp_path):
    """The next checkpoint continues the last one's Merkle frontier: it reads the trailers
    appended since (not the log), and still finds, in O(1), covered trailers removed."""
    config = _config(tmp_path)
    await _history(own_server.url, config, proposals=6)
    anchor = json.loads((config.data_dir / "last-checkpoint.json").read_text())
    nc, daemon, _ = await _restart(own_server.url, config)
    try:
        assert (await daemon.engine.autonomy.state(2**62)).crisis == ""
        # since the last one: the stop's checkpoint trailer and this start's few trailers
        assert 0 < daemon.engine.checkpoints.checkpoint_read < 8 < anchor["count"]
        assert json.loads((config.data_dir / "last-checkpoint.json").read_text())["count"] \
            >= anchor["count"]
        since = await _verify(own_server.url, "--since", "--checkpoint",
                              str(config.data_dir / "last-checkpoint.json"))
        assert since.returncode == 0, since.stdout + since.stderr
        assert "trailers after the checkpoint of" in since.stdout, since.stdout
        # deny_delete holds, but a retention limit set by an administrator drops the oldest
        js = nc.jetstream()
        info = await js.stream_info(S.STREAM_AUDIT)
        await js.update_stream(dataclasses.replace(info.config,
                                                   max_msgs=info.state.messages - 2))
        problem = await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key)
        assert problem is not None and "removed or lost" in problem, problem
        since = await _verify(own_server.url, "--since", "--checkpoint",
                              str(config.data_dir / "last-checkpoint.json"))
        assert since.returncode == 1 and "removed or lost" in since.stdout, since.stdout
        await _no_apply_in_crisis(nc, daemon)
    finally:
        await daemon.stop()
        await connection.close(nc)
