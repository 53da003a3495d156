"""The operator's queue: which proposals `improved review` lists, and what the review index
(one retained entry per open item, docs/protocol.md "The review index") must say about them.

Pure. The index is written by the engine as records move and read by `review` and the
pending-reviews metric, so its cost follows the open items, not the history; it is an output
and only says where to look: a reader rebuilds each listed record from its chain and lists it
only when `queued` holds for that record.
"""

from __future__ import annotations

from dataclasses import dataclass

from improved.core.authority import is_waiting
from improved.core.record import ProposalRecord, expired_at, status_at
from improved.protocol.model import ReviewEntry

# the format of the indexes (2: review entries carry valid_to; 3: the measurement index is
# kept too); a marker naming another means a refill from the chains
INDEX_VERSION = 3


def surfaced(record: ProposalRecord, now: int | None = None) -> bool:
    """An L1 proposal accepted for review (SPEC 09: surfaced, never applied), still standing
    (and, as of `now` when given, not expired)."""
    d = record.decision
    return (record.status == "pending" and record.superseded_by is None and d is not None
            and d.verdict == "accept" and record.gate_class == "L1"
            and (now is None or status_at(record, now) == "pending"))


def queued(record: ProposalRecord | None, now: int | None = None) -> bool:
    """In the operator's queue: surfaced (L1), or waiting for an operator or a quorum
    (`authority.is_waiting`). The one definition `review`, the index and the metric share.
    With `now`, as of then: an expired proposal has left the queue at its `valid_to`, before
    its chain records the expiry (what `review` lists); without, as its chain says (what the
    index holds until the expiry is recorded)."""
    return record is not None and (surfaced(record, now) or is_waiting(record, now))


def entry_of(record: ProposalRecord | None) -> ReviewEntry | None:
    """The index entry `record` should have: None when it is not queued. It carries the
    proposal's `valid_to`, so the daemon's sweep finds the entries due to expire without
    reading their chains."""
    if record is None or not queued(record):
        return None
    d = record.decision
    return ReviewEntry(proposal_id=record.proposal_id, service=record.service,
                       since=d.at if d is not None else record.updated_at,
                       valid_to=record.proposal.valid_to)


def due(entries: list[ReviewEntry], now: int) -> tuple[list[ReviewEntry], int | None]:
    """The entries whose `valid_to` has passed at `now` (their expiry is to be recorded), and
    the earliest `valid_to` still ahead (when the next are due), if any."""
    ready = [e for e in entries if expired_at(e.valid_to, now)]
    ahead = [e.valid_to for e in entries if e.valid_to is not None and e.valid_to > now]
    return ready, min(ahead, default=None)


@dataclass(frozen=True)
class Write:
    """One write to the index: the entry, or None for a tombstone (the item left)."""

    entry: ReviewEntry | None


def change(before: ProposalRecord | None, after: ProposalRecord,
           republish: bool, moved: bool = False) -> Write | None:
    """What to write to the index after a pass took `before` to `after`, if anything. A chain
    begun in this pass (`before` None: its append expected an empty chain) had no entry, so
    only a queued one is written; otherwise a write when the entry changed, and on a republish
    the entry again (or a tombstone for a gated record, in case an earlier one was lost). An L0
    proposal is never queued: it never costs a write. `moved`: a trailer of the pass moved
    the proposal in or out of the queue (`core.indexes`), so one that came and went within it
    gets its tombstone (a reader counting the members of the last checkpoint looks for it)."""
    new = entry_of(after)
    if before is None:
        return Write(new) if new is not None or moved else None
    if new != entry_of(before) or (moved and new is None):
        return Write(new)
    if republish and (new is not None or after.gate_class != "L0"):
        return Write(new)
    return None
