"""Reading an index as the hint it is: what it lists confirmed by the chains it names, and
what it omits found from the chains (core.indexes has the rules; this is the I/O).

A reader — `improved review`, the daemon at start and after each checkpoint it signs — reads
every subject of the index (entries and tombstones), then each named proposal's chain
(verified), and replays it now and as of the last checkpoint. Its members now are what it
lists; the members as of the checkpoint, counted against the checkpoint's signed count, say
whether the index holds them all. When it does not, or cannot be checked, the members are
found from the chains after the last epoch seal (every open proposal's chain begins after
it: core.epochs), never from the first trailer unless there is no seal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from improved.client.archive import SEAL_SUBJECT
from improved.client.audit_log import covering
from improved.client.chain_writer import decode_trailer
from improved.client.checkpointing import CP_SUBJECT
from improved.client.deployment import Deployment
from improved.core import audit, checkpoint, epochs, evidence, indexes
from improved.core.policy import Policy
from improved.core.propose import rebuild_record
from improved.core.record import ProposalRecord, replay
from improved.protocol import subjects as S

READ_AT_ONCE = 32  # chains read at a time for what an index names
# the most trailers a reader reads after a checkpoint older than the tombstones' TTL, to see
# that no member left since (a daemon stopped since, say); beyond it, the chains are read
SINCE_MAX = 2000


@dataclass(frozen=True)
class Counted:
    """What a checkpoint says of the indexes: the last stream sequence it covered, when it
    was signed, and its count of each index's members (None: it carries none)."""

    last_seq: int
    at: int
    members: Mapping[str, int] | None


async def last_counted(store: Deployment, trusted: set[str]) -> tuple[Counted | None, str]:
    """The last checkpoint on the stream as a reader takes it — one read — with its
    signature checked and, with daemon keys (`trusted`), written and signed by one of them;
    else None and why."""
    _, body = await store.chain_head(CP_SUBJECT)
    if body is None:
        return None, "no checkpoint on the stream yet"
    if trusted and evidence.writer_problem(body, frozenset(trusted)) is not None:
        return None, "the last checkpoint on the stream was not written by a trusted daemon key"
    try:
        cp = checkpoint.from_trailer(body)
    except (KeyError, ValueError):
        return None, "the last checkpoint on the stream cannot be read"
    if not checkpoint.signature_ok(cp) or (trusted and checkpoint.trust_problem(cp, trusted)):
        return None, "the last checkpoint on the stream is not signed by a trusted daemon key"
    return Counted(cp.last_seq, cp.at, dict(cp.members) if cp.members is not None else None), ""


@dataclass
class IndexRead:
    """One index read: its members now (each confirmed by its chain), where they were found
    (`index`: the index holds every member the checkpoint counted; `chains`: they were read
    from the chains, and why), and the members whose subject holds no entry or another one."""

    index: str
    members: list[ProposalRecord]
    source: Literal["index", "chains"]
    why: str = ""
    short: int = 0
    wrong: list[ProposalRecord] = field(default_factory=list)
    read: int = 0  # chains read for what the index names
    # read from the chains: how many members they say there were as of the checkpoint
    chains_counted: int | None = None


def trust_of(trusted: set[str] | frozenset[str]) -> audit.Authenticity | None:
    """Who must have written a trailer a reader believes: a trusted daemon key, when the
    reader has them; without, a chain is checked by its hashes and links alone."""
    return evidence.DaemonWriters(frozenset(trusted)) if trusted else None


async def read(store: Deployment, name: str, counted: Counted | None, why_not: str,
               trust: audit.Authenticity | None, policy: Policy, now: int, ttl_s: int,
               trusted: set[str]) -> IndexRead:
    """Read the index `name` against `counted` (None: no checkpoint to check it against,
    `why_not`): O(what it names) when it holds every member; else the members from the
    chains after the last seal (`from_chains`)."""
    index = indexes.INDEXES[name]
    named = await store.read_named(name)
    keys = indexes.to_read(named, counted.at if counted else None)
    replayed = await _replayed(store, keys, counted.last_seq if counted else 0, trust, policy)
    count = counted.members.get(name) if counted and counted.members is not None else None
    fresh = counted is not None and (indexes.vouched(now - counted.at, ttl_s)
                                     or await _unmoved_since(store, counted.last_seq, name,
                                                             trust))
    found = indexes.assess(index, named, replayed, count, fresh)
    verdict = found.verdict if counted is not None else indexes.Verdict(False, why_not)
    if verdict.complete:
        return IndexRead(name, found.members, "index", "", 0, found.wrong, len(keys))
    start, where = await chains_start(store, trusted)
    records, at = await from_chains(store, start, None, trust, policy,
                                    counted.last_seq if counted else None)
    members = [r for r in records.values() if index.member(r)]
    entries = {(n.service, n.proposal_id): n.entry for n in named}
    wrong = [r for r in members if entries.get((r.service, r.proposal_id)) != index.entry(r)]
    return IndexRead(name, members, "chains", f"{verdict.why}; read from the audit chains "
                     f"{where}", verdict.short, wrong, len(keys),
                     at.get(name) if at is not None else None)


async def _replayed(store: Deployment, keys: list[tuple[str, str]], last_seq: int,
                    trust: audit.Authenticity | None, policy: Policy,
                    ) -> dict[tuple[str, str], indexes.Replayed]:
    """Each named proposal's record from its chain, now and as of `last_seq`; a chain that
    does not verify, or is not there, is left out (`improved audit verify` names it)."""
    limit = asyncio.Semaphore(READ_AT_ONCE)

    async def one(svc: str, pid: str) -> indexes.Replayed | None:
        async with limit:
            chain = await store.read_chain(svc, pid)
        if not chain or audit.verify_chain(pid, [b for _, b in chain], trust,
                                           [q for q, _ in chain]) is not None:
            return None
        try:
            trailers = [decode_trailer(body) for _, body in chain]
            seqs = [q for q, _ in chain]
            now = rebuild_record(trailers, seqs, policy)
            prefix = sum(1 for q in seqs if q <= last_seq)
            at = rebuild_record(trailers[:prefix], seqs[:prefix], policy) if prefix else None
        except (ValueError, KeyError, msgspec.MsgspecError):
            return None
        if now.service != svc:
            return None
        return indexes.Replayed(now, at)

    found = await asyncio.gather(*(one(svc, pid) for svc, pid in keys))
    return {key: r for key, r in zip(keys, found, strict=True) if r is not None}


async def _unmoved_since(store: Deployment, last_seq: int, name: str,
                         trust: audit.Authenticity | None) -> bool:
    """Whether no trailer after `last_seq` moved the index `name` — read only when there are
    at most SINCE_MAX of them, every one there and written by a trusted daemon: then the
    members now are the members then, and tombstones are not needed to find them."""
    view = await store.audit_view()
    if view.last_seq - last_seq > SINCE_MAX:
        return False
    expected = last_seq + 1
    async for (seq, subject, body, _), covered in covering(
            store.follow(S.AUDIT_FILTER, last_seq + 1, view.last_seq)):
        if seq not in (expected, expected - 1) or body is None:  # the trailers of a commit
            return False                                          # share its sequence
        expected = seq + 1
        if trust is not None and trust.problem(body, S.token(subject, 3) or "", seq,
                                               trust.start(), covered) is not None:
            return False
        refs = body.get("refs")
        if name in indexes.moves(refs if isinstance(refs, list) else ()):
            return False
    return expected > view.last_seq


async def chains_start(store: Deployment, trusted: set[str]) -> tuple[int, str]:
    """Where a read of the chains for the members of an index starts: after the last epoch
    seal, signed by a trusted daemon key when the reader has them; and where that is, said."""
    _, body = await store.chain_head(SEAL_SUBJECT)
    if body is None:
        return 1, "from the first trailer (no epoch is sealed yet)"
    try:
        seal = epochs.from_trailer(body)
    except (KeyError, ValueError):
        return 1, "from the first trailer (the last seal cannot be read)"
    if (trusted and (evidence.writer_problem(body, frozenset(trusted)) is not None
                     or epochs.problem(seal, trusted) is not None)):
        return 1, "from the first trailer (the last seal is not signed by a trusted daemon key)"
    return seal.upto + 1, f"after the seal of epoch {seal.epoch} (stream sequence {seal.upto})"


async def from_chains(store: Deployment, start: int, upto: int | None,
                      trust: audit.Authenticity | None, policy: Policy,
                      at_seq: int | None = None,
                      ) -> tuple[dict[tuple[str, str], ProposalRecord], dict[str, int] | None]:
    """The record of every proposal whose chain begins at or after stream sequence `start`,
    as of `upto` (None: the stream's end), read once in stream order: each trailer verified in
    its chain (with `trust`, its writer too) and folded into the chain's record. A chain that
    does not verify or replay is left out; one that began before `start` is not one an index
    can list (an archived epoch holds only closed chains). Memory: one record per chain read.
    With `at_seq`, also the members of each index as of that stream sequence."""
    if upto is None:
        upto = (await store.audit_view()).last_seq
    records: dict[tuple[str, str], ProposalRecord] = {}
    runs: dict[str, audit.ChainRun] = {}
    dropped: set[str] = set()
    at: dict[str, int] | None = None
    async for (seq, subject, body, _), covered in covering(
            store.follow(S.AUDIT_FILTER, start, upto)):
        if at is None and at_seq is not None and seq > at_seq:
            at = counts_of(records)
        if body is None or subject in dropped or not epochs.is_proposal_chain(subject):
            continue
        key = (S.token(subject, 2) or "", S.token(subject, 3) or "")
        run = runs.get(subject)
        if run is None:
            if body.get("seq") != 0:
                dropped.add(subject)
                continue
            run = runs[subject] = audit.ChainRun.start(key[1], trust)
        try:
            if audit.verify_next(run, body, trust, seq, covered) is not None:
                raise ValueError("does not verify")
            trailer = decode_trailer(body)
            record = records.get(key)
            records[key] = (rebuild_record([trailer], [seq], policy) if record is None
                            else replay(record, [trailer], [seq]))
        except (ValueError, KeyError, msgspec.MsgspecError):
            dropped.add(subject)
            records.pop(key, None)
    if at is None and at_seq is not None:
        at = counts_of(records)
    return records, at


def counts_of(records: Mapping[tuple[str, str], ProposalRecord]) -> dict[str, int]:
    """How many of `records` each index has as members."""
    return {name: sum(1 for r in records.values() if index.member(r))
            for name, index in indexes.INDEXES.items()}
