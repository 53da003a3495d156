"""Epochs of the audit log: where a closed epoch may be cut, and the seal that says so. Pure.

The log is one stream, read and verified as a whole, so without epochs it can only grow. Like
a transparency log that rotates its shards, it is cut into epochs: when an epoch is long or
old enough, the daemon seals it with a signed statement over the log up to a stream sequence
`upto` — the Merkle root and frontier of every trailer up to there (the same tree the
checkpoints sign), and how many of those trailers belong to proposal chains. Seals are the
trailers of their own mesh chain, each linked to the one before.

What may leave the stream is the proposal chains at or below `upto`, nothing else: the mesh
chains (trust, policy, autonomy, grants, checkpoints, seals) are small and stay whole, so a
reader of the stream never finds one cut. `cut` chooses `upto` so that no proposal chain is
cut either: below it, every proposal chain is *closed* — rejected, expired or rolled back, or
applied and untouched for the retention window — so nothing will ever append to it. A
proposal still open holds the cut back to just before its first trailer.

A verifier that has the exported epochs checks each one exactly against its seal
(`EpochCheck`): every stream sequence of the epoch once and in order, each trailer hashing to
what it says, the tree folded from the previous seal's frontier to the seal's root and count,
and `removable` proposal trailers among them. One that has only the stream checks what the
stream holds and continues the tree from the last seal's frontier, allowing at most
`removable` trailers to be missing at or below `upto` and none above it.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from improved.core import indexes, merkle, signing
from improved.core.audit import Draft, draft_of, trailer_hash, trailers_in
from improved.core.checkpoint import CHECKPOINT_ID
from improved.core.merkle import Frontier
from improved.core.record import lifecycle_step
from improved.core.trailers import EpochSealed, body_as
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import Status

SEAL_ID = hashlib.sha256(b"improved epochs").hexdigest()
CHECKPOINT_SUBJECT = S.checkpoint_audit(CHECKPOINT_ID)  # its trailers are no leaves of the tree
CLOSED: frozenset[Status] = frozenset({"rejected", "expired", "rolled_back"})
DAY_MS = 86_400_000


@dataclass(frozen=True)
class Seal:
    """Epoch `epoch` ends at stream sequence `upto`: the tree over every trailer up to there
    (checkpoints left out, as in a checkpoint) has `count` leaves, root `root` and frontier
    `frontier`, and `removable` of them (counted from the first epoch) are trailers of
    proposal chains, which an operator may export and remove from the stream."""

    epoch: int
    upto: int
    count: int
    root: str
    removable: int
    at: int
    frontier: Frontier = ()
    last_hash: str = ""
    keyid: str = ""
    public: str = ""
    sig: str = ""

    def statement(self) -> bytes:
        return canonical.encode({"kind": "seal", "epoch": self.epoch, "upto": self.upto,
                                 "count": self.count, "root": self.root,
                                 "removable": self.removable, "at": self.at})


def make(epoch: int, upto: int, frontier: Frontier, count: int, last_hash: str,
         removable: int, at: int, key: Ed25519PrivateKey) -> Seal:
    seal = Seal(epoch, upto, count, merkle.root(frontier), removable, at, tuple(frontier),
                last_hash)
    public = signing.raw_public(key.public_key())
    return Seal(seal.epoch, seal.upto, seal.count, seal.root, seal.removable, seal.at,
                seal.frontier, seal.last_hash, signing.keyid_of(public),
                base64.b64encode(public).decode(),
                base64.b64encode(key.sign(seal.statement())).decode())


def problem(seal: Seal, trusted: set[str]) -> str | None:
    """Why `seal` does not count: a bad signature, an untrusted key, or a frontier that is not
    the one of its signed root."""
    try:
        public = base64.b64decode(seal.public, validate=True)
        Ed25519PublicKey.from_public_bytes(public).verify(base64.b64decode(seal.sig),
                                                          seal.statement())
    except (ValueError, InvalidSignature):
        return f"the seal of epoch {seal.epoch}: the signature does not verify"
    # `trusted` empty: no trust anchor at all, so the key is not checked (a verifier says so)
    if signing.keyid_of(public) != seal.keyid or (trusted and seal.keyid not in trusted):
        return (f"the seal of epoch {seal.epoch} is signed by {seal.keyid}, which is not a "
                "trusted daemon key")
    if not (merkle.well_formed(seal.frontier, seal.count)
            and merkle.root(seal.frontier) == seal.root):
        return f"the seal of epoch {seal.epoch}: its frontier is not the one of its root"
    return None


def draft(seal: Seal, actor: str) -> Draft:
    return draft_of(EpochSealed(
        epoch=seal.epoch, upto=seal.upto, count=seal.count, root=seal.root,
        removable=seal.removable, checkpoint_at=seal.at, keyid=seal.keyid, public=seal.public,
        sig=seal.sig, frontier=tuple(seal.frontier), last_hash=seal.last_hash),
        "learn-back", actor, "rec:system",
        f"epoch {seal.epoch} sealed at stream sequence {seal.upto}")


def from_trailer(body: dict[str, Any]) -> Seal:
    """The seal a trailer of the seal chain carries; ValueError if it is none."""
    s = body_as(EpochSealed, body)
    return Seal(epoch=s.epoch, upto=s.upto, count=s.count, root=s.root, removable=s.removable,
                at=s.checkpoint_at, frontier=s.frontier, last_hash=s.last_hash, keyid=s.keyid,
                public=s.public, sig=s.sig)


def is_proposal_chain(subject: str) -> bool:
    """A proposal's chain (`improve.audit.<svc>.<id>`): what an archive may remove."""
    return (S.token(subject, 2) or "_") not in S.MESH_CHAINS


@dataclass
class _Chain:
    first_seq: int
    status: Status = "pending"
    last_at: int = 0
    position: int = 0
    indexed: dict[str, int] = field(default_factory=dict)  # its index refs, added up


@dataclass
class Scan:
    """One pass over an epoch's trailers in stream order: for each proposal chain, where it
    began, its status and when it last moved. Memory follows the epoch, not the log."""

    chains: dict[str, _Chain] = field(default_factory=dict)

    def feed(self, seq: int, subject: str, body: dict[str, Any]) -> None:
        if not is_proposal_chain(subject):
            return
        chain = self.chains.get(subject)
        if chain is None:
            chain = self.chains[subject] = _Chain(seq)
        status, _ = lifecycle_step(chain.status, chain.position, body)
        chain.status, chain.position = status, chain.position + 1
        at = body.get("at")
        chain.last_at = at if isinstance(at, int) else chain.last_at
        refs = body.get("refs")
        indexes.add(chain.indexed, refs if isinstance(refs, list) else ())

    def cut(self, candidate: int, now: int, retention_days: float) -> int:
        """The last stream sequence the epoch may end at, at most `candidate`: just before
        the first trailer of the oldest proposal chain that is not closed, or that an index
        still lists (an applied change whose measurement is owed: its chain will grow)."""
        horizon = now - int(retention_days * DAY_MS)
        held = [c.first_seq for c in self.chains.values()
                if not closed(c.status, c.last_at, horizon) or any(n > 0 for n in c.indexed.values())]
        return min([candidate, *(seq - 1 for seq in held)])


def closed(status: Status, last_at: int, horizon: int) -> bool:
    """Whether nothing will append to a proposal chain again: it is rejected, expired or
    rolled back, or it was applied and has not moved since `horizon` (after the retention
    window an applied change is settled; rolling it back is a new proposal)."""
    return status in CLOSED or (status == "applied" and last_at <= horizon)


HELD = 10_000  # missing stream sequences an EpochCheck remembers, to tell a late line from a repeat
SHOWN = 5  # stream sequences a problem names of each kind


@dataclass
class _Few:
    """How many of one kind of fault, and the first few stream sequences (or lines) of it."""

    count: int = 0
    first: list[int] = field(default_factory=list)

    def add(self, at: int, many: int = 1) -> None:
        self.first += range(at, at + min(many, SHOWN - len(self.first)))
        self.count += many

    def named(self, one: str, several: str) -> str | None:
        if not self.count:
            return None
        shown = ", ".join(str(at) for at in sorted(self.first))
        more = f" and {self.count - len(self.first)} more" if self.count > len(self.first) else ""
        return (one if self.count == 1 else several).format(f"{shown}{more}")


class EpochCheck:
    """Epoch `seal.epoch`, read trailer by trailer (from its export or from the stream), checked
    exactly against its seal: every stream sequence after the previous seal's `upto` up to its
    own, each once and in order; every trailer hashing to what it says; their hashes (the
    checkpoints' left out) folding from the previous seal's frontier to the seal's count and
    root; and the seal's `removable` proposal trailers among them. A missing trailer, one too
    many, two swapped, one altered or one moved in from another epoch each fail at least one.
    Memory is flat: the tree's frontier, counters, and at most HELD missing sequences (to tell
    a late line from a repeated one)."""

    def __init__(self, seal: Seal, prev: Seal | None):
        self.seal = seal
        self.first = prev.upto + 1 if prev else 1
        self.tree = merkle.Tree(prev.frontier, prev.count) if prev else merkle.Tree()
        self.counted_before = prev.count if prev else 0
        self.removable_before = prev.removable if prev else 0
        self.removable = self.removable_before
        self.expected = self.first
        self._held: set[int] = set()  # missing so far, as far as HELD of them
        self.missing, self.late, self.twice, self.outside = _Few(), _Few(), _Few(), _Few()
        self.altered, self.unreadable, self.bad_lines = _Few(), _Few(), _Few()
        self._why = ""  # what the first line that is no trailer is

    def feed(self, seq: int, subject: str, body: dict[str, Any] | None) -> None:
        """One more message: its stream sequence, subject and body (None: unreadable), each
        trailer it carries (a commit's several, `audit.trailers_in`) a leaf of the tree."""
        self._place(seq)
        for trailer in trailers_in(body) if body is not None else [None]:
            leaf = trailer.get("hash") if isinstance(trailer, dict) else None
            if body is None:
                self.unreadable.add(seq)
            elif not isinstance(trailer, dict) or not _hashes_to(trailer, leaf):
                self.altered.add(seq)
            if subject == CHECKPOINT_SUBJECT:
                continue
            self.tree.add(merkle.leaf_of(leaf))
            self.removable += is_proposal_chain(subject)

    def bad_line(self, number: int, why: str) -> None:
        """A line of an export that is no trailer: it counts for nothing else."""
        self.bad_lines.add(number)
        self._why = self._why or why

    def _place(self, seq: int) -> None:
        if not self.first <= seq <= self.seal.upto:
            self.outside.add(seq)
        elif seq >= self.expected:
            self._lost(self.expected, seq - self.expected)
            self.expected = seq + 1
        elif seq in self._held:  # a gap it left is filled late: out of order
            self._held.discard(seq)
            self.missing.count -= 1
            if seq in self.missing.first:
                self.missing.first.remove(seq)
            self.late.add(seq)
        elif self.missing.count > len(self._held):  # it may fill a gap not held
            self.late.add(seq)
        else:
            self.twice.add(seq)

    def _lost(self, start: int, many: int) -> None:
        if many <= 0:
            return
        self.missing.add(start, many)
        self._held.update(range(start, start + max(0, min(many, HELD - len(self._held)))))

    def problem(self) -> str | None:
        """At the end of the epoch: what does not match its seal, in one sentence (None: it is
        exactly what the seal signed)."""
        self._lost(self.expected, self.seal.upto + 1 - self.expected)
        self.expected = self.seal.upto + 1
        seal, span = self.seal, f"({self.first}..{self.seal.upto})"
        trailers, sealed = self.tree.count - self.counted_before, seal.count - self.counted_before
        found = [
            self.missing.named("stream sequence {} is missing", "stream sequences {} are missing"),
            self.late.named("stream sequence {} is out of order",
                            "stream sequences {} are out of order"),
            self.twice.named("stream sequence {} comes twice", "stream sequences {} come twice"),
            self.outside.named(f"stream sequence {{}} is outside the epoch {span}",
                               f"stream sequences {{}} are outside the epoch {span}"),
            self.bad_lines.named(f"line {{}} is not an exported trailer ({self._why})",
                                 f"lines {{}} are not exported trailers (the first: "
                                 f"{self._why})"),
            self.unreadable.named("stream sequence {} cannot be read",
                                  "stream sequences {} cannot be read"),
            self.altered.named("the trailer at stream sequence {} does not hash to what it says",
                               "the trailers at stream sequences {} do not hash to what they "
                               "say"),
        ]
        ours, theirs = self.removable - self.removable_before, seal.removable - self.removable_before
        if trailers != sealed or ours != theirs:
            found.append(f"{trailers} trailers, {ours} of them of proposal chains, where the "
                         f"seal counts {sealed} and {theirs} (checkpoints left out)")
        elif self.tree.root() != seal.root:
            found.append("they do not hash to the seal's root from the previous seal's "
                         "frontier")
        named = [f for f in found if f]
        return "; ".join(named) if named else None


def _hashes_to(body: dict[str, Any], claimed: object) -> bool:
    try:
        return isinstance(claimed, str) and trailer_hash(body) == claimed
    except canonical.CanonicalError:
        return False
