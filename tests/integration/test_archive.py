"""Epochs of the audit log, sealed by the daemon, exported and removed by an operator: the
daemon and every verify go on across them, an open proposal is never cut, and a removal the
seals do not allow — or an export altered after the fact — is named."""

from __future__ import annotations

import asyncio
import json

from improved.client import archive, connection
from improved.client.config import AuditSettings
from improved.client.sdk import MeshClient
from improved.protocol import subjects as S
from improved.protocol.model import ApplyResult
from improved.runtime.daemon import Daemon
from tests.bus import daemon_config, eventually
from tests.cli import improved
from tests.factories import rank_proposal, skill_proposal

SVC = "epochs"


def _config(tmp_path):
    # an epoch of at least 12 trailers; an applied change settles at once
    return daemon_config(data_dir=tmp_path / "data", checkpoint_interval_s=0.0,
                         audit=AuditSettings(epoch_trailers=12, retention_days=0.0))


def _toml(tmp_path, config) -> str:
    path = tmp_path / "improved.toml"
    path.write_text(f'data_dir = "{config.data_dir}"\n'
                    f'checkpoint_key = "{config.checkpoint_key}"\n')
    return str(path)


async def _applied(client, pid):
    state = await client.state(pid)
    return state if state is not None and state.status == "applied" else None


async def _cli(*args: str):
    return await asyncio.to_thread(improved, *args)


async def test_a_sealed_epoch_is_exported_removed_and_verified_across(own_server, tmp_path):
    config = _config(tmp_path)
    cfg_file = _toml(tmp_path, config)
    anchor = str(config.data_dir / "last-checkpoint.json")
    nc = await connection.connect(own_server.url, "epochs")
    daemon = Daemon(nc, config)
    await daemon.start()
    client = MeshClient(nc, SVC)

    async def applier(order):
        return ApplyResult(ok=True, applied_id=order.proposal_id[:8])

    sub = await client.serve_apply(applier)
    try:
        early = [(await client.propose(rank_proposal(SVC, key=f"e{i}"))).proposal_id
                 for i in range(4)]
        for pid in early:
            await eventually(lambda pid=pid: _applied(client, pid))
        waiting = (await client.propose(skill_proposal(SVC))).proposal_id  # stays open
        late = (await client.propose(rank_proposal(SVC, key="late"))).proposal_id
        await eventually(lambda: _applied(client, late))
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None
        await daemon.engine.checkpoints.seal_if_due(daemon._checkpoint_key)  # as the periodic loop does

        js = nc.jetstream()
        trusted = daemon.engine.trust.trusted_daemons(daemon._checkpoint_key)
        seal, problem = await archive.last_seal(daemon.store, trusted)
        assert problem is None and seal is not None and seal.epoch == 1
        first_waiting, _ = (await daemon.store.read_chain(SVC, waiting))[0]
        assert seal.upto == first_waiting - 1  # the open proposal holds the cut back
        before = (await js.stream_info(S.STREAM_AUDIT)).state

        out = tmp_path / "archive"
        done = await _cli("audit", "archive", str(out), "--remove", "--nats", own_server.url,
                          "--config", cfg_file)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "epoch 1:" in done.stdout and "removed from the stream" in done.stdout
        after = (await js.stream_info(S.STREAM_AUDIT)).state
        removed = before.messages - after.messages
        assert 0 < removed <= seal.removable
        for pid in early:  # the closed chains left the stream, whole
            assert await daemon.store.read_chain(SVC, pid) == []
        # the open proposal and the mesh chains are whole
        assert (await daemon.engine.records.rebuild(SVC, waiting)).status == "pending"
        assert (await daemon.store.read_chain_at(archive.SEAL_SUBJECT))[0][1]["seq"] == 0
        # again: nothing more to export or remove, and the export still checks out
        again = await _cli("audit", "archive", str(out), "--remove", "--nats", own_server.url,
                           "--config", cfg_file)
        assert again.returncode == 0 and "already in" in again.stdout, again.stdout

        # the daemon goes on: its next checkpoint, and one after a restart
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None
    finally:
        await sub.unsubscribe()
        await daemon.stop()
    restarted = Daemon(nc, config)
    await restarted.start()
    try:
        assert (await restarted.engine.autonomy.state(2**62)).crisis == ""
    finally:
        await restarted.stop()

    whole = await _cli("audit", "verify", "--nats", own_server.url, "--config", cfg_file,
                       "--checkpoint", anchor)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "are archived" in whole.stdout
    across = await _cli("audit", "verify", "--nats", own_server.url, "--config", cfg_file,
                        "--checkpoint", anchor, "--archive", str(out))
    assert across.returncode == 0, across.stdout + across.stderr
    assert "epoch 1 read from the export" in across.stdout
    since = await _cli("audit", "verify", "--since", "--nats", own_server.url, "--config",
                       cfg_file, "--checkpoint", anchor)
    assert since.returncode == 0, since.stdout + since.stderr

    # an export altered afterwards no longer hashes to its seal
    path = archive.epoch_file(out, 1)
    lines = path.read_text().splitlines()
    entry = json.loads(lines[3])
    entry["body"]["reason"] = "rewritten"
    lines[3] = json.dumps(entry)
    path.write_text("\n".join(lines) + "\n")
    altered = await _cli("audit", "verify", "--nats", own_server.url, "--config", cfg_file,
                         "--checkpoint", anchor, "--archive", str(out))
    assert altered.returncode == 1 and "BROKEN" in altered.stdout, altered.stdout

    # a purge beyond the seal (a chain still in the hot log) is named by the daemon and verify
    await nc.jetstream().purge_stream(S.STREAM_AUDIT, subject=S.audit(SVC, late))
    beyond = Daemon(nc, config)
    await beyond.start()
    try:
        assert (await beyond.engine.autonomy.state(2**62)).crisis.startswith("crisis-")
    finally:
        await beyond.stop()
        await connection.close(nc)
    named = await _cli("audit", "verify", "--nats", own_server.url, "--config", cfg_file)
    assert named.returncode == 1 and "BROKEN" in named.stdout, named.stdout

