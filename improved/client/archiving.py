"""An operator's archive of sealed epochs (`improved audit archive DIR [--remove]`): each epoch
exported to files — every message of it (a trailer, or a commit of several), one JSON line each
with its stream sequence, subject and headers, and the seal beside it — checked exactly against
its seal (`epochs.EpochCheck`) before it is kept, and again whenever `audit verify --archive`
reads it (`client.archive.ArchiveRead`). With `--remove` (and the `improved-archivist`
credential) the epoch's proposal chains are then purged from the stream, service by service,
below the seal's `upto`; the mesh chains stay whole. Sealing is the daemon's
(`runtime.archive`); reading and checking seals and exports is `client.archive`.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from improved.client.archive import check_file, epoch_file, seal_file, seal_problem
from improved.client.deployment import Deployment
from improved.core.audit import trailers_in
from improved.core.epochs import Seal
from improved.protocol import subjects as S


@dataclass
class Exported:
    epoch: int
    trailers: int
    services: set[str]
    written: bool  # False: it was already in the directory


async def export(store: Deployment, directory: Path, seal: Seal, prev: Seal | None,
                 seal_body: dict[str, Any]) -> Exported:
    """Write epoch `seal.epoch` to `directory` (skipped when it is already there and checks
    out; its seal file written again when only that is missing), checking it exactly against
    the seal before it is kept; ValueError if the stream no longer holds it whole (it was
    removed before it was exported), it does not check out, or the directory holds another
    seal for it."""
    start = prev.upto + 1 if prev else 1
    path, sealed = epoch_file(directory, seal.epoch), seal_file(directory, seal.epoch)
    if path.exists():
        services, trailers = check_file(path, seal, prev)
        kept = seal_problem(sealed, seal_body)
        if kept == "missing":
            _write_durably(sealed, json.dumps(seal_body, indent=1) + "\n")
        elif kept:
            raise ValueError(f"epoch {seal.epoch}: {kept}")
        return Exported(seal.epoch, trailers, services, False)
    await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    partial = path.with_suffix(".jsonl.partial")
    expected, count = start, 0
    with partial.open("w") as out:
        async for seq, subject, body, headers in store.follow_messages(S.AUDIT_FILTER, start,
                                                                        seal.upto):
            if seq != expected or body is None:
                partial.unlink()
                raise ValueError(f"epoch {seal.epoch}: the stream no longer holds stream "
                                 f"sequence {expected}: it cannot be exported from here")
            out.write(json.dumps({"seq": seq, "subject": subject, "headers": headers,
                                  "body": body}, separators=(",", ":")) + "\n")
            expected, count = seq + 1, count + len(trailers_in(body))
        out.flush()
        os.fsync(out.fileno())
    if expected != seal.upto + 1:
        partial.unlink()
        raise ValueError(f"epoch {seal.epoch}: the stream ends at {expected - 1}, before its "
                         f"seal's {seal.upto}")
    try:
        services, _ = check_file(partial, seal, prev)
    except ValueError:
        partial.unlink()
        raise
    partial.rename(path)
    _write_durably(sealed, json.dumps(seal_body, indent=1) + "\n")
    return Exported(seal.epoch, count, services, True)


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    tmp.rename(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def remove(store: Deployment, seal: Seal, services: set[str]) -> int:
    """Purge the epoch's proposal chains from the stream below `seal.upto` (only after they
    were exported and checked); the mesh chains stay. How many trailers left the stream."""
    removed = 0
    for svc in sorted(services):
        before = await store.js.stream_info(S.STREAM_AUDIT)
        await store.js.purge_stream(S.STREAM_AUDIT, subject=S.audit(svc, "*"), seq=seal.upto + 1)
        after = await store.js.stream_info(S.STREAM_AUDIT)
        removed += before.state.messages - after.state.messages
    return removed
