"""Streams that must not forget: what a reader checks, before each decision that relies on a
stream having kept every message (a grant not spent, an upgrade not revoked), to know it has.

On an open bus anyone may change a stream's limits and set them back, delete it and make it
again. A look at the configuration alone sees only a limit still in force, so each check reads
the stream's state too (one stream info), and decides here:

- A stream that *keeps* everything (no limits, no TTLs, no deletes: the revocations, the tool
  runtimes' audit chains) has lost nothing while it holds as many messages as it was ever given,
  `messages == last_seq` (sequences start at 1, one per message), whatever removed one: a limit
  set and set back, a per-subject limit lowered, a purge. No sentinel is needed, and a stream
  made by an earlier version is checked as it is.
- A stream whose messages *expire* by their own TTL (the spent marks) cannot be counted. Its
  sentinel, a message without a TTL written first, stands for it: every limit the server
  applies (`max_msgs`, `max_bytes`, `max_age`, with discard old) removes the oldest message
  first, so while the stream's first message is still at or before the sentinel, no limit has
  removed anything written after it.

In both, the stream must be the one the reader knows (its creation time: a stream deleted and
made again, or restored from a snapshot, has another) and configured as it must be (a limit in
force is refused before it removes anything).

What neither sees: a message of an expiring stream removed before its TTL by a per-subject limit
(raised, a second message with a short TTL written on the mark's subject, lowered: the mark goes
and the second message expires). Messages there leave out of order anyway, so the state keeps no
trace of it; docs/protocol.md says what would close it. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["keeps", "expires"]


@dataclass(frozen=True)
class Seen:
    """A stream as one stream info shows it: its creation time, first and last sequence, how
    many messages it holds, and which settings differ from what it must be."""

    stream: str
    created: str
    first_seq: int
    last_seq: int
    messages: int
    differs: tuple[str, ...] = ()

    @property
    def lost(self) -> int:
        """How many messages it was given and no longer holds."""
        return max(0, self.last_seq - self.messages)


@dataclass(frozen=True)
class Known:
    """What a reader trusts a stream to be: the one made at `created`; for a stream that keeps
    everything, `mark` is how many messages it had lost when trusted (0, unless an operator
    accepted a loss); for one whose messages expire, the sequence of its sentinel."""

    stream: str
    kind: Kind
    created: str
    mark: int

    def ref(self) -> str:
        """This as a trailer ref's value (`ref_value` reads it back)."""
        word = "lost" if self.kind == "keeps" else "sentinel"
        return f"{self.created} {word}={self.mark}"


def ref_value(stream: str, kind: Kind, value: str) -> Known | None:
    """A Known from a ref's value (`Known.ref`), or None when it is not one."""
    created, _, tail = value.rpartition(" ")
    word, _, number = tail.partition("=")
    if not created or word != ("lost" if kind == "keeps" else "sentinel") \
            or not number.isdigit():
        return None
    return Known(stream, kind, created, int(number))


def first_sight(kind: Kind, seen: Seen, sentinel: int | None = None) -> Known:
    """What to trust of a stream seen for the first time: this incarnation, having lost nothing
    (a stream that keeps everything) or holding its sentinel at `sentinel`."""
    return Known(seen.stream, kind, seen.created, 0 if kind == "keeps" else sentinel or 0)


def accepted(kind: Kind, seen: Seen, sentinel: int | None = None) -> Known:
    """What to trust when an operator accepts the stream as it is now, losses included."""
    return Known(seen.stream, kind, seen.created, seen.lost if kind == "keeps" else sentinel or 0)


def problem(known: Known, seen: Seen) -> str | None:
    """Why `seen` cannot vouch that it forgot nothing since it was trusted as `known`, or
    None. The first that holds: another incarnation, a setting that removes messages, messages
    removed."""
    name = f"stream {known.stream}"
    if seen.created != known.created:
        return (f"{name} is not the one this runtime knows: it was made at {seen.created}, "
                f"the one known was made at {known.created} (deleted and made again, or "
                "restored), so what the one known held is gone")
    if seen.differs:
        return (f"{name} differs from what it must be ({', '.join(seen.differs)}): set that "
                "way it removes messages, so it cannot vouch for what it holds")
    if known.kind == "keeps" and seen.lost != known.mark:
        return (f"{name} holds {seen.messages} of the {seen.last_seq} messages written to it: "
                f"{seen.lost - known.mark} were removed since it was trusted (a limit set "
                "and set back, a per-subject limit lowered, a purge)")
    if known.kind == "expires" and (not seen.messages or seen.first_seq > known.mark):
        now = (f"its first message is now {seen.first_seq}" if seen.messages
               else "it holds nothing")
        return (f"{name} no longer holds its sentinel (sequence {known.mark}; {now}): a limit "
                "removed its oldest messages, so what it held after the sentinel may be gone")
    return None
