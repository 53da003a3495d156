"""Attacks on an archive's exported epochs: after `audit archive --remove` the export is the
only copy of what left the stream, so `audit verify --archive` must find it exactly as its
signed seal says — every trailer, in order, nothing added, nothing altered — and name the
epoch and what is wrong in one line, never a traceback.

One deployment is built for the module (two sealed epochs, exported and removed); each test
copies the export, does one thing to it, and verifies."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from improved.client import archive, connection
from improved.client.config import AuditSettings
from improved.client.sdk import MeshClient
from improved.core import epochs
from improved.protocol.model import ApplyResult
from improved.runtime import bus
from improved.runtime.daemon import Daemon
from tests.bus import daemon_config, eventually
from tests.cli import improved
from tests.factories import rank_proposal, signal

SVC = "exports"


@dataclass
class Exported:
    url: str
    cfg_file: str
    anchor: str
    directory: Path
    continued: str  # a proposal of epoch 1 whose chain goes on on the stream, after epoch 2


async def _applied(client, pid):
    state = await client.state(pid)
    return state if state is not None and state.status == "applied" else None


async def _cli(*args: str):
    return await asyncio.to_thread(improved, *args)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def exported(tmp_path_factory):
    """Two epochs sealed by a daemon, exported to a directory and removed from the stream.
    After the second seal a late signal moves a closed proposal of the first epoch, and the
    daemon checkpoints once more, so the stream goes on past the seals, one chain with it."""
    root = tmp_path_factory.mktemp("exports")
    server = bus.EmbeddedServer(root / "nats", bus.free_port(), sync="2m")
    server.start()
    config = daemon_config(data_dir=root / "data", checkpoint_interval_s=0.0,
                           audit=AuditSettings(epoch_trailers=12, retention_days=0.0))
    cfg_file = root / "improved.toml"
    cfg_file.write_text(f'data_dir = "{config.data_dir}"\n'
                        f'checkpoint_key = "{config.checkpoint_key}"\n')
    nc = await connection.connect(server.url, "exports")
    daemon = Daemon(nc, config)
    await daemon.start()
    client = MeshClient(nc, SVC)

    async def applier(order):
        return ApplyResult(ok=True, applied_id=order.proposal_id[:8])

    sub = await client.serve_apply(applier)
    try:
        first: list[str] = []
        for batch in ("a", "b"):
            pids = [(await client.propose(rank_proposal(SVC, key=f"{batch}{i}"))).proposal_id
                    for i in range(4)]
            for pid in pids:
                await eventually(lambda pid=pid: _applied(client, pid))
            assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None
            await daemon.engine.checkpoints.seal_if_due(daemon._checkpoint_key)
            first = first or pids
        late = await client.refine(signal(SVC, "agent:exports:late", proposal_id=first[0]))
        assert late.counted
        await client.propose(rank_proposal(SVC, key="after"))
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None
        trusted = daemon.engine.trust.trusted_daemons(daemon._checkpoint_key)
        seal, problem = await archive.last_seal(daemon.store, trusted)
        assert problem is None and seal is not None and seal.epoch == 2
    finally:
        await sub.unsubscribe()
        await daemon.stop()
        await connection.close(nc)
    directory = root / "archive"
    done = await _cli("audit", "archive", str(directory), "--remove", "--nats", server.url,
                      "--config", str(cfg_file))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("removed from the stream") == 2, done.stdout
    try:
        yield Exported(server.url, str(cfg_file), str(config.data_dir / "last-checkpoint.json"),
                       directory, first[0])
    finally:
        server.stop()


def _copy(exported: Exported, tmp_path: Path) -> Path:
    target = tmp_path / "archive"
    shutil.copytree(exported.directory, target)
    return target


def _lines(directory: Path, epoch: int) -> list[str]:
    return archive.epoch_file(directory, epoch).read_text().splitlines()


def _write(directory: Path, epoch: int, lines: list[str]) -> None:
    archive.epoch_file(directory, epoch).write_text("".join(line + "\n" for line in lines))


def _entry(line: str) -> dict:
    return json.loads(line)


def _proposal_chains(lines: list[str]) -> dict[str, list[int]]:
    """Each proposal chain of an epoch file: the indexes of its lines, in order."""
    chains: dict[str, list[int]] = {}
    for index, line in enumerate(lines):
        subject = _entry(line)["subject"]
        if epochs.is_proposal_chain(subject):
            chains.setdefault(subject, []).append(index)
    return chains


async def _verify(exported: Exported, directory: Path):
    return await _cli("audit", "verify", "--nats", exported.url, "--config", exported.cfg_file,
                      "--checkpoint", exported.anchor, "--archive", str(directory))


def _broken(result, epoch: int, *words: str) -> None:
    """Exit 1, a BROKEN line naming the epoch and each of `words`, and no traceback."""
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    named = [line for line in result.stdout.splitlines()
             if line.startswith("BROKEN") and f"epoch {epoch}" in line]
    assert named, result.stdout
    assert any(all(word in line for word in words) for line in named), result.stdout


async def test_the_untouched_export_verifies(exported, tmp_path):
    """Across both epochs and on into the stream, where one chain of epoch 1 goes on."""
    result = await _verify(exported, _copy(exported, tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout
    assert "epochs 1..2 read from the export" in result.stdout


@pytest.mark.parametrize("epoch", [1, 2])
async def test_a_chains_last_trailer_removed_is_named(exported, tmp_path, epoch):
    """The chain still links without it; in the last exported epoch nothing after it on the
    stream hashes over it either."""
    directory = _copy(exported, tmp_path)
    lines = _lines(directory, epoch)
    last = next(iter(_proposal_chains(lines).values()))[-1]
    seq = _entry(lines[last])["seq"]
    del lines[last]
    _write(directory, epoch, lines)
    _broken(await _verify(exported, directory), epoch, f"stream sequence {seq}", "missing")


async def test_the_last_exported_trailer_of_a_chain_the_stream_continues_is_named(exported,
                                                                                  tmp_path):
    """The chain's next trailer, on the stream, no longer follows what the export ends with."""
    directory = _copy(exported, tmp_path)
    lines = _lines(directory, 1)
    last = _proposal_chains(lines)[f"improve.audit.{SVC}.{exported.continued}"][-1]
    seq = _entry(lines[last])["seq"]
    del lines[last]
    _write(directory, 1, lines)
    result = await _verify(exported, directory)
    _broken(result, 1, f"stream sequence {seq}", "missing")
    assert f"BROKEN {exported.continued} trailer" in result.stdout, result.stdout


async def test_a_chains_middle_trailer_removed_is_named(exported, tmp_path):
    directory = _copy(exported, tmp_path)
    lines = _lines(directory, 2)
    chain = next(c for c in _proposal_chains(lines).values() if len(c) >= 3)
    seq = _entry(lines[chain[1]])["seq"]
    del lines[chain[1]]
    _write(directory, 2, lines)
    _broken(await _verify(exported, directory), 2, f"stream sequence {seq}", "missing")


async def test_the_first_trailer_of_an_epoch_removed_is_named(exported, tmp_path):
    directory = _copy(exported, tmp_path)
    lines = _lines(directory, 2)
    seq = _entry(lines[0])["seq"]
    _write(directory, 2, lines[1:])
    _broken(await _verify(exported, directory), 2, f"stream sequence {seq}", "missing")


async def test_the_last_trailer_of_an_epoch_removed_is_named(exported, tmp_path):
    directory = _copy(exported, tmp_path)
    lines = _lines(directory, 1)
    seq = _entry(lines[-1])["seq"]
    _write(directory, 1, lines[:-1])
    _broken(await _verify(exported, directory), 1, f"stream sequence {seq}", "missing")


async def test_a_duplicated_line_is_named(exported, tmp_path):
    directory = _copy(exported, tmp_path)
    lines = _lines(directory, 1)
    at = len(lines) // 2
    seq = _entry(lines[at])["seq"]
    _write(directory, 1, [*lines[:at + 1], lines[at], *lines[at + 1:]])
    _broken(await _verify(exported, directory), 1, f"stream sequence {seq}", "twice")


async def test_two_lines_swapped_are_named(exported, tmp_path):
    directory = _copy(exported, tmp_path)
    lines = _lines(directory, 2)
    at = len(lines) // 2
    lines[at], lines[at + 1] = lines[at + 1], lines[at]
    _write(directory, 2, lines)
    _broken(await _verify(exported, directory), 2, "out of order")


async def test_an_altered_line_is_named(exported, tmp_path):
    """The trailer's hash is left as it was: the Merkle tree over the hashes cannot see the
    change, the trailer's own hash does."""
    directory = _copy(exported, tmp_path)
    lines = _lines(directory, 1)
    chain = next(iter(_proposal_chains(lines).values()))
    entry = _entry(lines[chain[-1]])
    entry["body"]["reason"] = "rewritten"
    lines[chain[-1]] = json.dumps(entry)
    _write(directory, 1, lines)
    _broken(await _verify(exported, directory), 1, "hash")


async def test_a_line_whose_hash_is_no_hash_is_named(exported, tmp_path):
    directory = _copy(exported, tmp_path)
    lines = _lines(directory, 2)
    entry = _entry(lines[1])
    entry["body"]["hash"] = "not hex"
    lines[1] = json.dumps(entry)
    _write(directory, 2, lines)
    _broken(await _verify(exported, directory), 2, f"stream sequence {entry['seq']}", "hash")


async def test_a_line_that_is_no_trailer_is_named(exported, tmp_path):
    directory = _copy(exported, tmp_path)
    lines = _lines(directory, 2)
    lines[2] = lines[2][: len(lines[2]) // 2]
    _write(directory, 2, lines)
    _broken(await _verify(exported, directory), 2, "line 3", "not an exported trailer")


async def test_a_line_moved_out_of_its_epoch_is_named(exported, tmp_path):
    """The last line of epoch 1 put at the start of epoch 2: each file alone is in order."""
    directory = _copy(exported, tmp_path)
    first, second = _lines(directory, 1), _lines(directory, 2)
    moved = first.pop()
    _write(directory, 1, first)
    _write(directory, 2, [moved, *second])
    result = await _verify(exported, directory)
    _broken(result, 1, "missing")
    _broken(result, 2, "outside")


async def test_an_epoch_file_missing_is_named(exported, tmp_path):
    directory = _copy(exported, tmp_path)
    archive.epoch_file(directory, 1).unlink()
    _broken(await _verify(exported, directory), 1, archive.epoch_file(directory, 1).name,
            "missing")


async def test_the_last_epoch_file_missing_is_named(exported, tmp_path):
    directory = _copy(exported, tmp_path)
    archive.epoch_file(directory, 2).unlink()
    _broken(await _verify(exported, directory), 2, archive.epoch_file(directory, 2).name,
            "missing")


async def test_an_epoch_neither_in_the_archive_nor_on_the_stream_is_named(exported, tmp_path):
    """Both files of the last epoch gone: it reads as not exported yet, so it is checked
    against what the stream holds of it, which is not what its seal signed."""
    directory = _copy(exported, tmp_path)
    archive.epoch_file(directory, 2).unlink()
    archive.seal_file(directory, 2).unlink()
    _broken(await _verify(exported, directory), 2, "not exported", "the stream does not match",
            "missing")


async def test_a_seal_file_missing_is_named(exported, tmp_path):
    directory = _copy(exported, tmp_path)
    archive.seal_file(directory, 2).unlink()
    _broken(await _verify(exported, directory), 2, archive.seal_file(directory, 2).name,
            "missing")


async def test_a_seal_file_that_is_not_the_streams_seal_is_named(exported, tmp_path):
    directory = _copy(exported, tmp_path)
    shutil.copy(archive.seal_file(directory, 1), archive.seal_file(directory, 2))
    _broken(await _verify(exported, directory), 2, archive.seal_file(directory, 2).name)


async def _archive(exported: Exported, directory: Path):
    return await _cli("audit", "archive", str(directory), "--nats", exported.url, "--config",
                      exported.cfg_file)


async def test_archiving_again_refuses_an_export_that_does_not_match(exported, tmp_path):
    directory = _copy(exported, tmp_path)
    lines = _lines(directory, 2)
    seq = _entry(lines[-1])["seq"]
    _write(directory, 2, lines[:-1])
    again = await _archive(exported, directory)
    assert again.returncode == 1 and "Traceback" not in again.stderr, again.stderr
    assert "epoch 2:" in again.stderr and f"stream sequence {seq} is missing" in again.stderr
    assert len(_lines(directory, 2)) == len(lines) - 1  # left as it was found


async def test_archiving_again_writes_a_lost_seal_file_from_the_stream(exported, tmp_path):
    directory = _copy(exported, tmp_path)
    kept = archive.seal_file(directory, 1).read_text()
    archive.seal_file(directory, 1).unlink()
    again = await _archive(exported, directory)
    assert again.returncode == 0 and again.stdout.count("already in") == 2, again.stdout
    assert archive.seal_file(directory, 1).read_text() == kept
    assert (await _verify(exported, directory)).returncode == 0
