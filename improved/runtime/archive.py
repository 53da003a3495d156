"""Sealing epochs (the daemon) and archiving them (the operator): the I/O around core.epochs.

The daemon seals an epoch after a checkpoint, when the log since the last seal is long
(`[audit] epoch_trailers`) or old (`epoch_hours`) enough: one pass over the epoch to find
where it may end (`Scan.cut`), one to hash it from the last seal's frontier. Both read only
the epoch, once per epoch.

Exporting sealed epochs to files and removing them from the stream is an operator's, and
reading and checking seals and exports an auditor's: both are the client's
(`improved.client.archive`).
"""

from __future__ import annotations

import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.client.archive import SEAL_SUBJECT, last_seal
from improved.client.checkpointing import CP_SUBJECT
from improved.core import epochs, merkle
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
