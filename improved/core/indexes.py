"""The indexes beside the chains, as membership functions of a proposal's record, and what a
reader checks an index against. Pure.

An index is a retained entry per member on `improve.<name>.<svc>.<id>` (docs/protocol.md "The
review index", "Learn-back measurement"): where to look, never what to believe. Anyone on the
embedded bus may tombstone, purge or rewrite an entry, so a reader takes nothing from one but
the subject's name: what an index lists is confirmed by the chain it names, and what it omits
is found from the chains. For that:

- membership is a pure function of the record (`INDEXES`), so it changes only when the chain
  gets a trailer, and that trailer says so (`index:+review`, `index:-due`: `moved`);
- every checkpoint counts the members of each index as of its `last_seq`, carried on from the
  one before by the trailers it reads anyway (`moves`), and signs the counts;
- a reader finds each member as of that checkpoint among the subjects it read (an entry, or
  the tombstone of one that left since, which outlives the checkpoint interval:
  `tombstone_ttl_s`), and when they do not add up to the count (`check`), the index omitted
  something: it reads the chains instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from improved.core import audit, learnback, queue
from improved.core.audit import Draft
from improved.core.record import ProposalRecord, fold, hashed
from improved.core.trailers import TrailerData, Unknown, decode
from improved.protocol.model import Trailer


@dataclass(frozen=True)
class Index:
    """One index: who is a member, and the entry a member's subject holds."""

    name: str
    member: Callable[[ProposalRecord], bool]
    entry: Callable[[ProposalRecord], Any]


# name → index: a new index is one line here (and its subjects, client.records.INDEX_SUBJECTS)
INDEXES: Final[Mapping[str, Index]] = {
    "review": Index("review", lambda r: queue.queued(r), queue.entry_of),
    "due": Index("due", lambda r: learnback.awaiting(r) is not None, learnback.due_entry),
}

REF: Final = "index"  # `index:+<name>` / `index:-<name>` on the trailer that moves membership


def members(record: ProposalRecord | None) -> frozenset[str]:
    """The indexes `record` is a member of, as its chain says (no clock: an expired proposal
    stays in the review index until its chain records the expiry)."""
    if record is None:
        return frozenset()
    return frozenset(name for name, index in INDEXES.items() if index.member(record))


def moved(before: ProposalRecord | None, after: ProposalRecord) -> tuple[str, ...]:
    """The refs of a trailer that takes `before` (None: the chain begins) to `after`: one per
    index it enters (`index:+<name>`) or leaves (`index:-<name>`)."""
    was, now = members(before), members(after)
    return (tuple(f"{REF}:+{name}" for name in sorted(now - was))
            + tuple(f"{REF}:-{name}" for name in sorted(was - now)))


def with_moves(before: ProposalRecord | None, record: ProposalRecord, draft: Draft,
               at: int) -> Draft:
    """`draft` with the membership refs of its trailer: `record` is the record it extends
    (`before`, or the new record a registration starts; None before that), and the record
    after it is what the fold of the trailer sealed at `at` makes of it."""
    return moves_of(before, record, draft, at)[0]


def moves_of(before: ProposalRecord | None, record: ProposalRecord, draft: Draft,
             at: int) -> tuple[Draft, TrailerData | None]:
    """`with_moves`, and the typed data of the trailer that draft seals to (what its stage
    wrote it from, else decoded once); None for a trailer of no kind known here, whose data
    is its raw refs."""
    draft, typed, _ = _moved(before, record, draft, at, record.chain.stream_seq)
    return draft, typed


def sealed(before: ProposalRecord | None, record: ProposalRecord, draft: Draft, at: int,
           stream_seq: int) -> tuple[Trailer, TrailerData | None, ProposalRecord]:
    """The trailer `draft` seals to at `at` onto `record`, with the refs of the indexes it
    moves (`moves_of`), its typed data, and the record after it at `stream_seq` (`fold`).
    A trailer that moves no index is folded once: its hash is the only thing sealing adds,
    and of the hash the record keeps only the chain's end."""
    draft, typed, folded = _moved(before, record, draft, at, stream_seq)
    if folded is not None:
        provisional, after = folded
        trailer = audit.hashed(provisional)
        return trailer, typed, hashed(after, trailer, stream_seq)
    trailer = audit.seal(draft, record, at)
    return trailer, typed, fold(record, trailer, stream_seq, typed)


def _moved(before: ProposalRecord | None, record: ProposalRecord, draft: Draft, at: int,
           stream_seq: int) -> tuple[Draft, TrailerData | None,
                                     tuple[Trailer, ProposalRecord] | None]:
    """(`draft` with its index moves, its typed data, and — when it moves no index, so the
    draft is as given — its unhashed trailer and the record folded from it at `stream_seq`)."""
    provisional = audit.unhashed(draft, record, at)
    data = draft.data if draft.data is not None else decode(provisional)
    after = fold(record, provisional, stream_seq, data)
    refs = moved(before, after)
    typed = None if isinstance(data, Unknown) else data
    if not refs:
        return draft, typed, (provisional, after)
    draft = msgspec.structs.replace(draft, refs=(*draft.refs, *refs))
    if typed is not None:
        typed = msgspec.structs.replace(typed, index=(*typed.index,
                                                      *(r.partition(":")[2] for r in refs)))
    return draft, typed, None


def moves(refs: Iterable[object]) -> dict[str, int]:
    """How a trailer's refs move each index's count: +1 for `index:+<name>`, -1 for
    `index:-<name>`; anything else, and indexes this version does not keep, ignored."""
    out: dict[str, int] = {}
    for r in refs:
        if not isinstance(r, str) or not r.startswith(f"{REF}:") or len(r) < len(REF) + 3:
            continue
        sign, name = r[len(REF) + 1], r[len(REF) + 2:]
        if sign in "+-" and name in INDEXES:
            out[name] = out.get(name, 0) + (1 if sign == "+" else -1)
    return out


def counted(members_: Mapping[str, int] | None) -> dict[str, int] | None:
    """Counts a checkpoint may continue from: one for every index this version keeps, else
    None (a checkpoint of a version without them: count once from the chains)."""
    if members_ is None or not set(INDEXES) <= set(members_):
        return None
    return {name: members_[name] for name in INDEXES}


def add(counts: dict[str, int] | None, refs: Iterable[object]) -> None:
    """Fold one trailer's membership refs into `counts` (left alone when unknown)."""
    if counts is None:
        return
    for name, delta in moves(refs).items():
        counts[name] = counts.get(name, 0) + delta


def refs_problem(records: Sequence[ProposalRecord], refs: Sequence[Sequence[str]]) -> str | None:
    """Whether a chain's membership refs are what its replay says: `records[i]` is the record
    after trailer i, `refs[i]` that trailer's refs. Checked from the first trailer carrying one
    on (a chain written before the refs were kept has none); why not, or None."""
    start = next((i for i, r in enumerate(refs)
                  if any(isinstance(x, str) and x.startswith(f"{REF}:") for x in r)), None)
    if start is None:
        return None
    for i in range(start, len(records)):
        want = moves(moved(records[i - 1] if i else None, records[i]))
        if moves(refs[i]) != want:
            return (f"trailer {i}: its index refs say {_said(moves(refs[i]))}, its replay "
                    f"{_said(want)}")
    return None


def _said(delta: Mapping[str, int]) -> str:
    return ", ".join(f"{'+' if d > 0 else '-'}{n}" for n, d in sorted(delta.items())) or "nothing"


# -- what a reader checks an index against -------------------------------------------------------

MARGIN_S: Final = 60  # clocks, and the time a checkpoint takes to read what is new


def tombstone_ttl_s(checkpoint_interval_s: float) -> int:
    """How long a tombstone stays: past the next checkpoint and the one after it (one may fail),
    and a margin. A reader finds every member as of the last checkpoint among the subjects —
    the entry, or the tombstone of one that left since — only while the tombstones of what left
    since are there."""
    return int(2 * max(checkpoint_interval_s, 0.0) + MARGIN_S)


def vouched(age_ms: int, ttl_s: int) -> bool:
    """Whether every tombstone written since a checkpoint signed `age_ms` ago is still there."""
    return age_ms <= (ttl_s - MARGIN_S) * 1000


@dataclass(frozen=True)
class Named:
    """One subject of an index: who it names, its entry (None: a tombstone, or anything that
    is no entry), and when the server stored it (ms). The name is all a reader takes from it."""

    service: str
    proposal_id: str
    entry: Any = None
    at: int = 0


def to_read(named: Iterable[Named], checkpoint_at: int | None = None) -> list[tuple[str, str]]:
    """The chains a reader reads for an index: one per proposal a subject names — but for a
    tombstone stored before the checkpoint signed at `checkpoint_at` began its read (less the
    margin): what it names had left by then, so it is no member as of that checkpoint. Its
    cost follows the open items and what left since the checkpoint, never the history.
    Leaving out one that still counts could only make the index look short, never whole."""
    before = None if checkpoint_at is None else checkpoint_at - MARGIN_S * 1000
    return list(dict.fromkeys((n.service, n.proposal_id) for n in named
                              if n.entry is not None or before is None or n.at >= before))


@dataclass(frozen=True)
class Replayed:
    """A named proposal's record as its chain says now, and as of the checkpoint's last
    sequence (None: its chain began after it)."""

    now: ProposalRecord
    at_checkpoint: ProposalRecord | None


@dataclass(frozen=True)
class Verdict:
    """Whether the index holds every member the checkpoint counted, and why not."""

    complete: bool
    why: str = ""
    short: int = 0  # members the checkpoint counted that no subject names


@dataclass(frozen=True)
class Assessment:
    members: list[ProposalRecord]  # the members now among what the index names, confirmed
    verdict: Verdict
    found: int  # members as of the checkpoint among them
    wrong: list[ProposalRecord]  # members now whose subject holds no entry, or another one


def check(name: str, count: int | None, found: int, fresh: bool) -> Verdict:
    """The index against the last checkpoint's count of its members (None: it has none):
    `found` of them among the subjects read; `fresh`: the tombstones of every member that left
    since are still there (`vouched`), or none left."""
    if count is None:
        return Verdict(False, f"the last checkpoint carries no count of the {name} index")
    if not fresh:
        return Verdict(False, f"the last checkpoint is older than the {name} index keeps "
                              "tombstones, and members left since")
    if found < count:
        return Verdict(False, f"the {name} index omitted {count - found} of the {count} "
                              "members the last checkpoint counted", short=count - found)
    if found > count:
        return Verdict(False, f"the {name} index names {found} members as of the last "
                              f"checkpoint, which counted {count}")
    return Verdict(True)


def assess(index: Index, named: Sequence[Named], replayed: Mapping[tuple[str, str], Replayed],
           count: int | None, fresh: bool) -> Assessment:
    """What an index read says once every chain it names was read (`replayed`; a chain that
    did not verify is left out): its members now, each confirmed by its chain; whether it
    holds every member the checkpoint counted (`check`); and the members whose subject does
    not hold their entry (lost, or rewritten)."""
    entries = {(n.service, n.proposal_id): n.entry for n in named}
    now = [r.now for r in replayed.values() if index.member(r.now)]
    found = sum(1 for r in replayed.values()
                if r.at_checkpoint is not None and index.member(r.at_checkpoint))
    wrong = [r for r in now if entries.get((r.service, r.proposal_id)) != index.entry(r)]
    return Assessment(now, check(index.name, count, found, fresh), found, wrong)
