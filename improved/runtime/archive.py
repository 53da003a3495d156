"""Sealing epochs (the daemon) and archiving them (the operator): the I/O around core.epochs.

The daemon seals an epoch after a checkpoint, when the log since the last seal is long
(`[audit] epoch_trailers`) or old (`epoch_hours`) enough: one pass over the epoch to find
where it may end (`Scan.cut`), one to hash it from the last seal's frontier. Both read only
the epoch, once per epoch.

An operator exports sealed epochs to files (`improved audit archive DIR`): every trailer of
the epoch, one JSON line each with its stream sequence, subject and headers, and the seal
beside it. The export is checked against the seal's root before it is kept. With `--remove`
(and the `improved-archivist` credential) the epoch's proposal chains are then purged from the
stream, service by service, below the seal's `upto`; the mesh chains stay whole.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from improved.core import audit, epochs, merkle
from improved.core.epochs import Seal
from improved.protocol import subjects as S
from improved.runtime.checkpointing import CP_SUBJECT
from improved.runtime.store import Store

log = structlog.get_logger("improved.archive")

SEAL_SUBJECT = S.checkpoint_audit(epochs.SEAL_ID)
HOUR_MS = 3_600_000


async def read_seals(store: Store, trust: Any, trusted: set[str]
                     ) -> tuple[list[tuple[Seal, dict[str, Any]]], str | None]:
    """Every seal on the stream with its trailer, oldest first, and why the seal chain does
    not hold (a broken link, a trailer no trusted daemon wrote, a seal that does not verify),
    if it does not."""
    chain = await store.read_chain_at(SEAL_SUBJECT)
    if not chain:
        return [], None
    brk = audit.verify_chain(epochs.SEAL_ID, [b for _, b in chain], trust,
                             [s for s, _ in chain])
    if brk is not None:
        return [], f"the seal chain: {brk}"
    seals = []
    for _, body in chain:
        try:
            seal = epochs.from_trailer(body)
        except (KeyError, ValueError) as exc:
            return [], f"a seal cannot be read: {exc}"
        problem = epochs.problem(seal, trusted)
        if problem:
            return [], problem
        seals.append((seal, body))
    return seals, None


async def last_seal(store: Store, trusted: set[str]) -> tuple[Seal | None, str | None]:
    """The last seal on the stream, in O(1), and why it does not count, if it does not."""
    _, body = await store.chain_head(SEAL_SUBJECT)
    if body is None:
        return None, None
    try:
        seal = epochs.from_trailer(body)
    except (KeyError, ValueError) as exc:
        return None, f"the last seal cannot be read: {exc}"
    return seal, epochs.problem(seal, trusted)


async def seal_if_due(store: Store, key: Any, actor: str, covered_to: int, now: int,
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


# -- the exported files ---------------------------------------------------------------------------


def epoch_file(directory: Path, epoch: int) -> Path:
    return directory / f"epoch-{epoch:06d}.jsonl"


def seal_file(directory: Path, epoch: int) -> Path:
    return directory / f"epoch-{epoch:06d}.seal.json"


@dataclass
class Exported:
    epoch: int
    trailers: int
    services: set[str]
    written: bool  # False: it was already in the directory


async def export(store: Store, directory: Path, seal: Seal, prev: Seal | None,
                 seal_body: dict[str, Any]) -> Exported:
    """Write epoch `seal.epoch` to `directory` (skipped when it is already there and checks
    out), checking it against the seal's root before it is kept; ValueError if the stream
    no longer holds it whole (it was removed before it was exported) or does not hash to it."""
    start = prev.upto + 1 if prev else 1
    path, sealed = epoch_file(directory, seal.epoch), seal_file(directory, seal.epoch)
    if path.exists() and sealed.exists():
        services = check_file(path, seal, prev)
        with path.open() as lines:
            return Exported(seal.epoch, sum(1 for _ in lines), services, False)
    await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
    partial = path.with_suffix(".jsonl.partial")
    expected, count = start, 0
    with partial.open("w") as out:
        async for seq, subject, body, headers in store.follow(S.AUDIT_FILTER, start,
                                                               seal.upto):
            if seq != expected or body is None:
                partial.unlink()
                raise ValueError(f"epoch {seal.epoch}: the stream no longer holds stream "
                                 f"sequence {expected}: it cannot be exported from here")
            out.write(json.dumps({"seq": seq, "subject": subject, "headers": headers,
                                  "body": body}, separators=(",", ":")) + "\n")
            expected, count = seq + 1, count + 1
        out.flush()
        os.fsync(out.fileno())
    if expected != seal.upto + 1:
        partial.unlink()
        raise ValueError(f"epoch {seal.epoch}: the stream ends at {expected - 1}, before its "
                         f"seal's {seal.upto}")
    services = check_file(partial, seal, prev)
    partial.rename(path)
    _write_durably(sealed, json.dumps(seal_body, indent=1) + "\n")
    return Exported(seal.epoch, count, services, True)


def check_file(path: Path, seal: Seal, prev: Seal | None) -> set[str]:
    """The services whose chains epoch file `path` holds, if it hashes to `seal`'s root from
    `prev`'s frontier; ValueError naming what does not."""
    tree = merkle.Tree(prev.frontier, prev.count) if prev else merkle.Tree()
    services: set[str] = set()
    expected = prev.upto + 1 if prev else 1
    removable = prev.removable if prev else 0
    for seq, subject, body, _ in read_file(path):
        if seq != expected:
            raise ValueError(f"{path}: stream sequence {expected} is missing")
        expected += 1
        if subject == CP_SUBJECT:
            continue
        tree.add(body.get("hash", "") if isinstance(body.get("hash"), str) else "")
        if epochs.is_proposal_chain(subject):
            services.add(S.token(subject, 2) or "")
            removable += 1
    if expected != seal.upto + 1 or tree.count != seal.count or tree.root() != seal.root:
        raise ValueError(f"{path}: does not hash to the root of the seal of epoch {seal.epoch}"
                         ": trailers were removed, altered or reordered")
    if removable != seal.removable:
        raise ValueError(f"{path}: holds {removable} proposal trailers, the seal says "
                         f"{seal.removable}")
    return services


def read_file(path: Path) -> Iterator[tuple[int, str, dict[str, Any], dict[str, str]]]:
    """The (stream sequence, subject, body, headers) lines of an epoch file, one at a time;
    ValueError on a line that is not one."""
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            try:
                entry = json.loads(line)
                item = (int(entry["seq"]), str(entry["subject"]), dict(entry["body"]),
                        dict(entry.get("headers") or {}))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not an exported trailer ({exc})") from None
            yield item


async def entries(paths: list[Path]) -> AsyncIterator[tuple[int, str, dict | None,
                                                            dict[str, str]]]:
    """The trailers of epoch files, in order, as `Store.follow` gives the stream's."""
    for path in paths:
        for entry in read_file(path):
            yield entry


def exported_files(directory: Path, seals: list[Seal]) -> list[Path]:
    """The epoch files in `directory` for the first seals, in order, as far as they run
    without a gap (each file checked against its seal as it is read)."""
    files = []
    for seal in seals:
        path = epoch_file(directory, seal.epoch)
        if not path.exists():
            break
        files.append(path)
    return files


async def chained(*sources: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for source in sources:
        async for item in source:
            yield item


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


async def remove(store: Store, seal: Seal, services: set[str]) -> int:
    """Purge the epoch's proposal chains from the stream below `seal.upto` (only after they
    were exported and checked); the mesh chains stay. How many trailers left the stream."""
    removed = 0
    for svc in sorted(services):
        before = await store.js.stream_info(S.STREAM_AUDIT)
        await store.js.purge_stream(S.STREAM_AUDIT, subject=S.audit(svc, "*"), seq=seal.upto + 1)
        after = await store.js.stream_info(S.STREAM_AUDIT)
        removed += before.state.messages - after.state.messages
    return removed
