"""What the audit log gained since the last checkpoint, read once and verified as it streams by.

A checkpoint continues from the one before it (`core.checkpoint`: its Merkle frontier and the
hash of the last trailer it covered). This is the I/O around that: choose the checkpoint to
continue from (the one kept in the data directory or the last one on the stream, whichever
covers more, if it verifies), check in O(1) that the stream still holds what it covered, then
read only the trailers after it through one ordered consumer, verifying each in its chain
(`audit.verify_next`) and adding it to the tree. A chain that began before the checkpoint is
picked up where it stands: its earlier trailers are read again (a proposal's chain is short),
or for the checkpoint chain, which grows with time, only the trailer the new one names as its
predecessor (the `Nats-Expected-Last-Subject-Sequence` the server checked at append time).
Memory follows what is new, and each chain it touches holds a `ChainRun`, not its trailers.
The daemon's checkpointer (`runtime.checkpointer`) and an auditor (`improved audit verify`)
run this same reader; signing the checkpoint is the daemon's alone.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from improved.client.audit_log import Entry, covering
from improved.client.deployment import Deployment
from improved.core import audit, checkpoint, evidence, indexes, merkle
from improved.core.checkpoint import Anchor, Checkpoint, StreamView
from improved.core.epochs import Seal, is_proposal_chain
from improved.protocol import subjects as S

CP_SUBJECT = S.checkpoint_audit(checkpoint.CHECKPOINT_ID)
# (stream seq, subject, body, headers)
EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"


@dataclass
class Since:
    """The outcome of reading the log after `base`: the tree over every trailer so far, the
    last one's stream sequence and hash, the members of each index as of it (carried on
    from the base's counts by the trailers' index refs; None when the base has none), and
    what did not verify."""

    tree: merkle.Tree
    last_seq: int
    last_hash: str
    members: dict[str, int] | None = None
    problems: list[str] = field(default_factory=list)
    read: int = 0  # trailers read after the base
    chains: int = 0  # chains met (begun after the base, or picked up where they stood)
    broken: int = 0  # chains that stopped verifying (only counted when reading on past one)
    verify_s: float = 0.0  # seconds spent verifying, reading excluded
    writers_s: float = 0.0  # of which: daemon signatures and signed acts


MAX_RUNS = 10_000  # chains whose state a reader holds at once; one evicted is re-read if met
# Who watches a long read, set by its caller's context (the console's full verify shows it):
# given the count of trailers read so far every WATCH_EVERY trailers, so that a read of
# hours can say how far it got without a parameter through every verifier that runs it.
watching: ContextVar[Callable[[int], None] | None] = ContextVar("watching", default=None)
WATCH_EVERY = 500


class _Timed:
    """The reader's trust, timing how long the writer and signed-act checks take, so that a
    one-pass verify can still report them apart from hashes and links."""

    def __init__(self, trust: evidence.ChainTrust, since: Since):
        self.trust, self.since = trust, since

    def start(self) -> object:
        return self.trust.start()

    def problem(self, body: dict[str, Any], chain_id: str, stream_seq: int,
                state: object, covered: bool = False) -> str | None:
        started = time.perf_counter()
        try:
            return self.trust.problem(body, chain_id, stream_seq, state, covered)
        finally:
            self.since.writers_s += time.perf_counter() - started


def empty_base(view: StreamView) -> Anchor:
    return Anchor(view.created or "", 0, 0, merkle.root(()), "", 0)


async def choose_base(store: Deployment, kept: Anchor | None, view: StreamView,
                      trust: evidence.ChainTrust, trusted: set[str], removable: int = 0
                      ) -> tuple[Anchor, list[tuple[int, str, str]], list[str]]:
    """(the checkpoint to continue from, roots to check on the way as (count, root, whose),
    what is wrong with the stream already). The base is the kept anchor or the last checkpoint
    on the stream — signed by a trusted daemon key, its frontier one with its root —
    whichever covers more; none (a first checkpoint, or only anchors without a frontier):
    the whole log is read once. A kept anchor is always checked: in O(1) against the stream
    when it can be, else by its root on the way."""
    on_stream = None
    _, body = await store.chain_head(CP_SUBJECT)
    if body is not None and evidence.writer_problem(body, trust.daemons) is None:
        try:
            cp = checkpoint.from_trailer(body)
        except (KeyError, ValueError):
            cp = None
        if cp is not None and _usable(cp, trusted):
            on_stream = checkpoint.anchor_of(cp, view.created or "")
    usable_kept = kept if kept is not None and checkpoint.anchor_continues(kept) else None
    candidates = [a for a in (usable_kept, on_stream) if a is not None]
    base = max(candidates, key=lambda a: a.last_seq) if candidates else empty_base(view)
    claims: list[tuple[int, str, str]] = []
    problems: list[str] = []
    for anchor, what in ((kept, "the last checkpoint kept in the data directory"),
                         (base if base is not kept else None, "the last checkpoint")):
        if anchor is None:
            continue
        if anchor is kept and usable_kept is None and base.count < anchor.count:
            # an anchor without a frontier: its root is checked while the log is read
            claims.append((anchor.count, anchor.root, what))
            problem = checkpoint.prefix_problem(anchor, view, None, what, removable)
        else:
            found = await store.trailer_at(anchor.last_seq) if anchor.count else None
            found_hash = found[1].get("hash") if found and found[1] and found[0] != CP_SUBJECT \
                else None
            problem = checkpoint.prefix_problem(anchor, view, found_hash, what, removable)
        if problem:
            problems.append(problem)
    return base, claims, problems


def _usable(cp: Checkpoint, trusted: set[str]) -> bool:
    return (checkpoint.signature_ok(cp) and checkpoint.trust_problem(cp, trusted) is None
            and checkpoint.continues(cp))


async def verify_since(store: Deployment, base: Anchor, view: StreamView,
                       trust: evidence.ChainTrust, trusted: set[str],
                       claims: list[tuple[int, str, str]], every_chain: bool = False,
                       report: Callable[[str], None] | None = None,
                       archived: Seal | None = None,
                       source: AsyncIterator[Entry] | None = None,
                       on_checkpoint: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
                       sealed: Sequence[Seal] = (),
                       ) -> Since:
    """Read and verify every trailer after `base` up to the stream's last sequence: each in its
    chain (hash, link, lifecycle, writer, signed act), each checkpoint met on the way by its
    signature, its key and its root, and every trailer the stream holds given back.

    It stops at the first problem, unless `every_chain` (a full `audit verify`): then a broken
    chain is named through `report` and passed over, and the read goes on to the end. Memory
    stays flat however long the log: the Merkle frontier, and the state of at most MAX_RUNS
    chains (the least recently met is dropped, and re-read should it be met again).

    `archived`, the last seal: up to its `removable` trailers at or below its `upto` may be
    missing (exported and removed, `runtime.archive`); when some are, the tree goes on from
    the seal's frontier, and the roots it covered are the export's to check. `source`: the
    trailers to read instead of the stream's (exported epochs, then the stream).
    `sealed`: the seals of the epochs `source` checks exactly itself (`archive.ArchiveRead`):
    the gaps at or below the last one's `upto` are its to name, and at the end of each epoch
    the tree goes on from its seal, so one epoch's fault is named once, not in every root
    after it. `on_checkpoint`: given each checkpoint trailer that verifies, as it is read."""
    since = Since(merkle.Tree(base.frontier, base.count), base.last_seq, base.last_hash,
                  indexes.counted(dict(base.members) if base.members is not None else None))
    timed = _Timed(trust, since)
    roots: dict[int, list[tuple[str, str]]] = {}
    for count, root, what in claims:
        roots.setdefault(count, []).append((root, what))
    for cp_seq, cp_body in await store.read_chain_at(CP_SUBJECT, base.last_seq + 1):
        if cp_seq > view.last_seq:
            break
        problem = _checkpoint_problem(cp_body, trusted, base, roots)
        if problem:
            since.problems.append(problem)
            if not every_chain:
                return since
            break  # the first is named; the log is still read
    runs: OrderedDict[str, audit.ChainRun] = OrderedDict()
    broken: set[str] = set()
    start = base.last_seq + 1
    gaps = _Gaps(start, archived.upto if archived is not None and archived.upto >= start
                 else 0, sealed[-1].upto if sealed else 0)
    ends = _Ends(sealed)
    if source is None:
        source = store.follow(S.AUDIT_FILTER, start, view.last_seq)
    async for (seq, subject, body, headers), covered in covering(_watched(source)):
        since.read += 1
        ends.passed(seq, since, roots)
        if gaps.reach(seq):
            _continue_from(since, archived, gaps.gone, roots)
        if body is None:
            gaps.missing.append(seq)
            continue
        started = time.perf_counter()
        problem = None if subject in broken else \
            await _step(store, runs, subject, body, headers, seq, timed, since, base.last_seq,
                        covered)
        since.verify_s += time.perf_counter() - started
        if problem is not None:
            if not every_chain:
                since.problems.append(f"{subject}: {problem}")
                return since
            broken.add(subject)
            since.broken += 1
            runs.pop(subject, None)
            if report is not None:
                report(problem)
        if subject == CP_SUBJECT and problem is None and on_checkpoint is not None:
            await on_checkpoint(body)
        if subject != CP_SUBJECT:
            _add_leaf(since, subject, seq, body, roots)
    ends.passed(None, since, roots)  # the read ended inside them
    if gaps.reach(view.last_seq + 1):  # the read ended at or below the seal
        _continue_from(since, archived, gaps.gone, roots)
    since.problems += _at_the_end(since, view, gaps, archived, roots)
    return since


def _watched(source: AsyncIterator[Entry]) -> AsyncIterator[Entry]:
    """`source`, its entries counted to whoever watches this context's read (`watching`)."""
    watch = watching.get()
    if watch is None:
        return source

    async def counted() -> AsyncIterator[Entry]:
        read = 0
        async for entry in source:
            read += 1
            if read % WATCH_EVERY == 0:
                watch(read)
            yield entry

    return counted()


def _add_leaf(since: Since, subject: str, seq: int, body: dict[str, Any],
              roots: dict[int, list[tuple[str, str]]]) -> None:
    """The trailer at `seq` (not a checkpoint) joins the tree, and its index refs the
    members' counts; the roots claimed at its count are checked."""
    if is_proposal_chain(subject):
        refs = body.get("refs")
        indexes.add(since.members, refs if isinstance(refs, list) else ())
    leaf = merkle.leaf_of(body.get("hash"))
    since.tree.add(leaf)
    since.last_seq, since.last_hash = seq, leaf
    for root, what in roots.pop(since.tree.count, ()):
        if since.tree.root() != root:
            since.problems.append(
                f"{what}: the first {since.tree.count} trailers no longer hash to its root: "
                "trailers were removed, altered or reordered")


class _Ends:
    """The ends of the epochs a source checks itself: past each, the tree goes on from its
    seal."""

    def __init__(self, sealed: Sequence[Seal]):
        self.ahead = list(reversed(sealed))

    def passed(self, seq: int | None, since: Since, roots: dict[int, list[tuple[str, str]]]
               ) -> None:
        """The read is at `seq` (None: it ended)."""
        while self.ahead and (seq is None or seq > self.ahead[-1].upto):
            _continue_at(since, self.ahead.pop(), roots)


def _at_the_end(since: Since, view: StreamView, gaps: _Gaps, archived: Seal | None,
                roots: dict[int, list[tuple[str, str]]]) -> list[str]:
    """What a read that got to the end found wrong with the log as a whole: more missing than
    archived, trailers the stream could not give back, roots never reached."""
    problems = []
    if archived is not None and gaps.gone > archived.removable:
        problems.append(
            f"{gaps.gone} trailers are missing at or below stream sequence {archived.upto}, "
            f"where the seal of epoch {archived.epoch} allows {archived.removable} to be "
            "archived: trailers or whole chains were removed")
    if gaps.missing:
        problems.append(checkpoint.unreadable_problem(
            StreamView(view.created, view.last_seq, tuple(gaps.missing))) or "")
    for count, pending in roots.items():
        for _, what in pending:
            problems.append(f"{what} covered {count} trailers; only {since.tree.count} "
                            "remain: trailers or whole chains were removed")
    return problems


async def _step(store: Deployment, runs: OrderedDict[str, audit.ChainRun], subject: str,
                body: dict[str, Any], headers: dict[str, str], seq: int, trust: _Timed,
                since: Since, base_seq: int, covered: bool) -> str | None:
    """Verify one trailer in its chain, opening the chain's run when it is not held; why it
    does not verify, or None. `covered`: a later trailer of its message follows."""
    run = runs.get(subject)
    if run is None:
        opened = await _open(store, subject, body, headers, seq, trust, base_seq)
        if isinstance(opened, str):
            since.chains += 1
            return opened
        run, first_met = opened
        since.chains += first_met
        runs[subject] = run
        while len(runs) > MAX_RUNS:
            runs.popitem(last=False)
    else:
        runs.move_to_end(subject)
    brk = audit.verify_next(run, body, trust, seq, covered)
    return None if brk is None else str(brk)


@dataclass
class _Gaps:
    """The stream sequences a read expected and did not get: archived (at or below the last
    seal's `upto`, while it is set) or missing."""

    expected: int
    upto: int
    named_to: int = 0  # gaps at or below it are the source's to name
    gone: int = 0
    missing: list[int] = field(default_factory=list)

    def reach(self, seq: int) -> bool:
        """Account for the gap before `seq`; True when the read has just passed the seal."""
        if seq <= self.named_to:
            self.expected = max(self.expected, seq + 1)
            return False
        self.expected = max(self.expected, self.named_to + 1)
        if self.upto:
            self.gone += max(0, min(seq, self.upto + 1) - self.expected)
        self.missing += range(max(self.expected, self.upto + 1), seq)
        crossed = bool(self.upto) and seq > self.upto
        if crossed:
            self.upto = 0
        self.expected = seq + 1
        return crossed


def _continue_from(since: Since, seal: Seal | None, gone: int,
                   roots: dict[int, list[tuple[str, str]]]) -> None:
    """At the end of a sealed epoch some of whose trailers were archived: the tree goes on
    from the seal (what it covered is the export's to check)."""
    if seal is None or not gone:
        return
    _continue_at(since, seal, roots)


def _continue_at(since: Since, seal: Seal, roots: dict[int, list[tuple[str, str]]]) -> None:
    """The tree goes on from `seal`, whose roots and those before it are checked (or named)
    by whoever checked its epoch."""
    since.tree = merkle.Tree(seal.frontier, seal.count)
    since.last_seq, since.last_hash = seal.upto, seal.last_hash
    for count in [c for c in roots if c <= seal.count]:
        del roots[count]


SCRUB_SLICE = 2000  # covered trailers re-read per checkpoint, at least (more when more is new)


async def scrub(store: Deployment, after: int, covered_to: int, limit: int) -> tuple[int, list[str]]:
    """Re-read up to `limit` trailers a checkpoint already covers, from stream sequence
    `after + 1`, and check that each can still be read and still hashes to what it says: the
    O(1) checks cannot see storage damaged beneath the server, so every checkpoint scrubs a
    slice and the whole log is scrubbed in turn, at a cost that follows the new work. Returns
    where the scrub stands (0: the pass is complete, the next one starts over) and what it
    found."""
    upto = min(covered_to, after + limit)
    expected = after + 1
    bad: list[int] = []
    missing: list[int] = []
    async for seq, _, body, _ in store.follow(S.AUDIT_FILTER, after + 1, upto):
        missing += range(expected, seq)
        expected = seq + 1
        if body is None:
            missing.append(seq)
        elif not isinstance(body.get("hash"), str) or audit.trailer_hash(body) != body["hash"]:
            bad.append(seq)
    missing += range(expected, upto + 1)
    problems = [p for p in (checkpoint.unreadable_problem(StreamView("", upto, tuple(missing))),
                            _altered(bad)) if p]
    return (0 if upto >= covered_to else upto), problems


def _altered(seqs: list[int]) -> str | None:
    if not seqs:
        return None
    return (f"{len(seqs)} trailer(s) the last checkpoint covered no longer hash to what they "
            f"say (stream sequence {', '.join(str(s) for s in seqs[:10])}): altered in storage")


def _checkpoint_problem(body: dict[str, Any] | None, trusted: set[str], base: Anchor,
                        roots: dict[int, list[tuple[str, str]]]) -> str | None:
    """A checkpoint appended after `base`: signed by a trusted daemon key, and its root is
    checked when the read reaches its count (one older than `base`, written by another replica
    while this one signed, is checked for its signature and key only)."""
    if body is None:
        return None  # counted as unreadable by the main read
    try:
        cp = checkpoint.from_trailer(body)
    except (KeyError, ValueError) as exc:
        return f"a checkpoint on the stream cannot be read: {exc}"
    if not checkpoint.signature_ok(cp):
        return f"checkpoint at {cp.at}: the signature does not verify"
    # no trusted key at all (a verifier with no trust anchor): its key is not checked, and
    # the verdict says so; its signature and its root still are
    untrusted = checkpoint.trust_problem(cp, trusted) if trusted else None
    if untrusted:
        return untrusted
    if cp.count > base.count or (cp.count == base.count and cp.root != base.root):
        roots.setdefault(cp.count, []).append((cp.root, f"checkpoint at {cp.at}"))
    return None


async def _open(store: Deployment, subject: str, body: dict[str, Any], headers: dict[str, str],
                seq: int, trust: audit.Authenticity | None, base_seq: int, *,
                by_header: bool = False,
                ) -> tuple[audit.ChainRun, bool] | str:
    """The run of a chain met at `body` (stream sequence `seq`) with no run held: new when it
    is the chain's first trailer, else continued after its earlier trailers (all before
    `seq`); and whether this read meets the chain for the first time (it began at or before
    `base_seq`, so none of it was read yet), not again after its run was dropped. The
    checkpoint chain, and with `by_header` any chain (one that grows with time), continues
    from its predecessor alone when the append's header finds it."""
    chain_id = S.token(subject, 3) or ""
    filed = S.filed_under(subject)
    position = body.get("seq")
    if position == 0:
        return audit.ChainRun.start(chain_id, trust, filed), True
    if not isinstance(position, int) or position < 0:
        return f"{chain_id} trailer {position!r}: not a chain position"
    if subject == CP_SUBJECT or by_header:
        pred = await _predecessor(store, subject, headers, position, seq)
        if pred is not None:
            return (audit.ChainRun.after(chain_id, position - 1, pred[1], "pending", trust),
                    pred[0] <= base_seq)
    run = audit.ChainRun.start(chain_id, trust, filed)
    began = 0
    chain = [(q, b) for q, b in await store.read_chain_at(subject) if q < seq]
    for (earlier_seq, earlier), covered in zip(chain, audit.covering([q for q, _ in chain]),
                                               strict=True):
        began = began or earlier_seq
        brk = audit.verify_next(run, earlier, trust, earlier_seq, covered)
        if brk is not None:
            return str(brk)
    return run, began <= base_seq


async def continue_run(store: Deployment, subject: str, body: dict[str, Any],
                       headers: dict[str, str], seq: int, trust: audit.Authenticity | None,
                       ) -> audit.ChainRun | str:
    """The run of a long chain (a tool runtime's) met at `body` in the middle of a read that
    starts after its beginning: continued from the trailer before it (found by the append's
    `Nats-Expected-Last-Subject-Sequence`), else from the chain's first trailer, every one
    before `seq` verified; or why it cannot be."""
    opened = await _open(store, subject, body, headers, seq, trust, 0, by_header=True)
    return opened if isinstance(opened, str) else opened[0]


async def _predecessor(store: Deployment, subject: str, headers: dict[str, str], position: int,
                       seq: int) -> tuple[int, str] | None:
    """(stream sequence, hash) of the trailer before the one at `seq`, found where the append
    said it was (the server refuses an append whose expected last sequence is not the
    subject's last); None when that does not hold up, and the chain is read instead."""
    try:
        at = int(headers.get(EXPECTED_LAST, ""))
    except ValueError:
        return None
    if not 0 < at < seq:
        return None
    found = await store.trailer_at(at)
    if found is None or found[0] != subject or found[1] is None:
        return None
    pred = found[1]
    if pred.get("seq") != position - 1 or not isinstance(pred.get("hash"), str):
        return None
    return at, pred["hash"]
