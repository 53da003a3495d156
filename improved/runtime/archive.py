"""Sealing epochs (the daemon) and archiving them (the operator): the I/O around core.epochs.

The daemon seals an epoch after a checkpoint, when the log since the last seal is long
(`[audit] epoch_trailers`) or old (`epoch_hours`) enough: one pass over the epoch to find
where it may end (`Scan.cut`), one to hash it from the last seal's frontier. Both read only
the epoch, once per epoch.

An operator exports sealed epochs to files (`improved audit archive DIR`): every message of
the epoch (a trailer, or a commit of several), one JSON line each with its stream sequence,
subject and headers, and the seal beside it. The export is checked exactly against its seal (`epochs.EpochCheck`) before it is
kept, and again whenever `audit verify --archive` reads it (`client.archive.ArchiveRead`).
With `--remove` (and the `improved-archivist` credential) the epoch's proposal chains are then
purged from the stream, service by service, below the seal's `upto`; the mesh chains stay
whole. What reads and checks seals and exports is the client's (`improved.client.archive`).
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.client.archive import (
    SEAL_SUBJECT,
    check_file,
    epoch_file,
    last_seal,
    seal_file,
    seal_problem,
)
from improved.client.checkpointing import CP_SUBJECT
from improved.client.deployment import Deployment
from improved.core import epochs, merkle
from improved.core.audit import trailers_in
from improved.core.epochs import Seal
from improved.protocol import subjects as S
from improved.runtime.store import Store

log = structlog.get_logger("improved.archive")

HOUR_MS = 3_600_000


async def seal_if_due(store: Store, key: Ed25519PrivateKey, actor: str, covered_to: int, now: int,
                      epoch_trailers: int, epoch_hours: float, retention_days: float,
                      trusted: set[str]) -> Seal | None:
    """Seal the next epoch, up to at most `covered_to` (what the last checkpoint verified),
    when it is due; the seal, or None when none was due or nothing can be cut yet."""
    prev, problem = await last_seal(store, trusted)
    if problem:
        log.warning("the last seal does not verify; no epoch is sealed", problem=problem)
        return None
    start = prev.upto + 1 if prev else 1
    if covered_to < start:
        return None
    if covered_to - start + 1 < epoch_trailers:  # not long enough: old enough? (O(1))
        first = await store.trailer_at(start)
        first_at = first[1].get("at") if first and first[1] else None
        began = prev.at if prev else (first_at if isinstance(first_at, int) else now)
        if now - began < epoch_hours * HOUR_MS:
            return None
    scan = epochs.Scan()
    async for seq, subject, body, _ in store.follow(S.AUDIT_FILTER, start, covered_to):
        if body is None:
            return None  # unreadable: the checkpoint names it, no seal over it
        scan.feed(seq, subject, body)
    upto = scan.cut(covered_to, now, retention_days)
    if upto < start:
        log.info("epoch due but no proposal chain closed yet; not sealed", start=start)
        return None
    tree = merkle.Tree(prev.frontier, prev.count) if prev else merkle.Tree()
    removable = prev.removable if prev else 0
    last_hash = prev.last_hash if prev else ""
    async for _, subject, body, _ in store.follow(S.AUDIT_FILTER, start, upto):
        if body is None or subject == CP_SUBJECT:
            continue
        tree.add(body["hash"])
        last_hash = body["hash"]
        removable += epochs.is_proposal_chain(subject)
    seal = epochs.make((prev.epoch + 1) if prev else 1, upto, tree.frontier(), tree.count,
                       last_hash, removable, now, key)
    await store.append_sealed(SEAL_SUBJECT, epochs.SEAL_ID, "L0", "operation",
                              lambda chain, at: epochs.draft(seal, actor), clock=lambda: now)
    log.info("epoch sealed", epoch=seal.epoch, upto=upto, trailers=tree.count,
             removable=removable)
    return seal


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
