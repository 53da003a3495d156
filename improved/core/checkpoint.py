"""Signed checkpoints over the whole audit log, so that removing whole chains is detected too.

A chain proves its own trailers in order, but not that the chain exists at all. A checkpoint
commits to every trailer there was: the count and an RFC 6962 Merkle root over the trailer
hashes in stream order, signed by the daemon's Ed25519 key. A later verifier recomputes the
root over the first `count` trailers it finds: anything removed, altered or reordered before
the checkpoint changes it. Checkpoints are trailers of the chain
`improve.audit._checkpoints.<CHECKPOINT_ID>`. Each also carries its Merkle frontier and the
hash of the last trailer it covers, so the next checkpoint continues from it: it verifies and
hashes only what is new, and checks in O(1) that the stream still holds what it covered
(`prefix_problem`). Pure.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from improved.core import merkle, signing
from improved.core.audit import Draft, draft_of
from improved.core.merkle import Frontier, merkle_root
from improved.core.trailers import CheckpointMade, TrailerDataError, body_as, decode_body
from improved.protocol import canonical

CHECKPOINT_ID = hashlib.sha256(b"improved checkpoints").hexdigest()

Members = tuple[tuple[str, int], ...]
"""How many members each index had as of a checkpoint's last sequence, by index name."""

RuntimeHead = tuple[str, int, str, int]
"""A tool runtime's chain as a checkpoint witnessed it on IMPROVE_TOOLS_AUDIT: (chain id,
length, the hash of its last trailer, that trailer's stream sequence)."""


@dataclass(frozen=True)
class Checkpoint:
    count: int
    root: str
    last_seq: int
    at: int
    keyid: str = ""
    public: str = ""  # base64 of the raw Ed25519 key
    sig: str = ""
    # not in the signed statement: implied by (count, root) and covered by the trailer's
    # daemon signature; what the next checkpoint continues from
    frontier: Frontier = ()
    last_hash: str = ""  # the hash of the trailer at last_seq
    # a witness only, outside the statement too: the tool runtimes' chain heads the daemon
    # read when it signed (their stream is not the log this checkpoint covers)
    runtimes: tuple[RuntimeHead, ...] = ()
    # outside the statement too: the members of each index (core.indexes) as of last_seq,
    # carried on from the checkpoint before; None in one written before they were counted
    members: Members | None = None

    def statement(self) -> bytes:
        """The signed bytes: canonical MessagePack of what the checkpoint commits to."""
        return canonical.encode({"count": self.count, "root": self.root,
                                 "last_seq": self.last_seq, "at": self.at})


def make(hashes: Sequence[str], last_seq: int, at: int, key: Ed25519PrivateKey) -> Checkpoint:
    return make_from(merkle.extend((), 0, hashes), len(hashes), last_seq,
                     hashes[-1] if hashes else "", at, key)


def make_from(frontier: Frontier, count: int, last_seq: int, last_hash: str, at: int,
              key: Ed25519PrivateKey, runtimes: Sequence[RuntimeHead] = (),
              members: Mapping[str, int] | None = None) -> Checkpoint:
    """The checkpoint over `count` trailers whose Merkle frontier is `frontier`, witnessing
    the tool runtimes' chain heads `runtimes`, counting `members` of each index."""
    cp = Checkpoint(count=count, root=merkle.root(frontier), last_seq=last_seq, at=at)
    public = signing.raw_public(key.public_key())
    return Checkpoint(cp.count, cp.root, cp.last_seq, cp.at, signing.keyid_of(public),
                      base64.b64encode(public).decode(),
                      base64.b64encode(key.sign(cp.statement())).decode(),
                      tuple(frontier), last_hash, tuple(sorted(runtimes)),
                      None if members is None else tuple(sorted(members.items())))


def continues(cp: Checkpoint) -> bool:
    """Whether a later checkpoint can continue from `cp`: it carries a frontier that is one
    with its signed (count, root) and the hash of its last trailer."""
    return (merkle.well_formed(cp.frontier, cp.count) and merkle.root(cp.frontier) == cp.root
            and (cp.count == 0 or len(cp.last_hash) == 64))


def signature_ok(cp: Checkpoint) -> bool:
    try:
        public = base64.b64decode(cp.public, validate=True)
        Ed25519PublicKey.from_public_bytes(public).verify(base64.b64decode(cp.sig),
                                                          cp.statement())
    except (ValueError, InvalidSignature):
        return False
    return signing.keyid_of(public) == cp.keyid


def draft(cp: Checkpoint, actor: str) -> Draft:
    return draft_of(CheckpointMade(
        count=cp.count, root=cp.root, last_seq=cp.last_seq, checkpoint_at=cp.at,
        keyid=cp.keyid, public=cp.public, sig=cp.sig, frontier=list(cp.frontier),
        last_hash=cp.last_hash,
        runtime_heads={cid: [n, h, q] for cid, n, h, q in cp.runtimes} if cp.runtimes else None,
        members=dict(cp.members) if cp.members is not None else None),
        "learn-back", actor, "rec:system", f"checkpoint over {cp.count} trailers")


def from_trailer(body: dict[str, Any]) -> Checkpoint:
    """The checkpoint a trailer of the checkpoint chain carries; ValueError if it is none."""
    cp = body_as(CheckpointMade, body)
    frontier = cp.frontier if isinstance(cp.frontier, list) else []
    return Checkpoint(count=cp.count, root=cp.root, last_seq=cp.last_seq, at=cp.checkpoint_at,
                      keyid=cp.keyid, public=cp.public, sig=cp.sig, frontier=tuple(frontier),
                      last_hash=cp.last_hash, runtimes=_heads(cp.runtime_heads),
                      members=_members(cp.members))


def _members(doc: object) -> Members | None:
    """The `members:` ref, `{index name: count}`; None when absent or not well formed."""
    if not isinstance(doc, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in doc.items()):
        return None
    return tuple(sorted(doc.items()))


def _heads(doc: object) -> tuple[RuntimeHead, ...]:
    """The `runtime_heads:` ref, `{chain id: [length, last hash, its stream sequence]}`; what
    is not well formed is left out (a witness only)."""
    if not isinstance(doc, dict):
        return ()
    return tuple(sorted((cid, v[0], v[1], v[2]) for cid, v in doc.items()
                        if isinstance(v, list) and len(v) == 3 and isinstance(v[1], str)
                        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                for n in (v[0], v[2]))))


def runtime_heads(body: dict[str, Any]) -> tuple[RuntimeHead, ...]:
    """The tool runtimes' chain heads a checkpoint trailer witnessed (none when it is not a
    checkpoint or witnessed none)."""
    try:
        data = decode_body(body)
    except TrailerDataError:
        return ()
    return _heads(data.runtime_heads) if isinstance(data, CheckpointMade) else ()


Witnessed = tuple[int, str, int, int]
"""One chain's witnessed head: (length, last hash, its stream sequence, the checkpoint's
`at`)."""
Witness = dict[str, Witnessed]
"""Chain id → the longest head of that tool runtime's chain a checkpoint witnessed."""


def witness(seen: Witness, heads: Sequence[RuntimeHead], at: int,
            ) -> tuple[list[tuple[str, Witnessed]], list[tuple[str, str]]]:
    """Fold one checkpoint's witnessed heads into `seen`, keeping each chain's longest (a
    hash chain's head at length n fixes every trailer before it). Returns the heads it
    replaced by longer ones — each still to be found at its stream sequence
    (`witnessed_trailer_problem`), since the longer head says nothing of them — and what the
    witnesses say themselves: a later one shorter than, or as long as but other than, an
    earlier one (the chain was cut or replaced in between), by chain id."""
    superseded: list[tuple[str, Witnessed]] = []
    problems: list[tuple[str, str]] = []
    for cid, length, last, seq in heads:
        kept = seen.get(cid)
        if kept is not None and (length, last) != kept[:2] and length <= kept[0]:
            problems.append((cid,
                f"{cid}: the checkpoint at {at} witnessed {length} trailers ending in "
                f"{last[:16]}…, the one at {kept[3]} {kept[0]} ending in {kept[1][:16]}…: the "
                "chain was " + ("cut short" if length < kept[0] else "replaced") +
                " between them"))
            continue
        if kept is None or length > kept[0]:
            if kept is not None:
                superseded.append((cid, kept))
            seen[cid] = (length, last, seq, at)
    return superseded, problems


def witnessed_trailer_problem(cid: str, subject: str, witnessed: Witnessed,
                              found: tuple[str, dict[str, Any] | None] | None) -> str | None:
    """Whether the message `found` (subject, body) at a witnessed head's stream sequence is
    still that trailer of the chain `cid` (on `subject`), or why not."""
    n, last, seq, at = witnessed
    what = (f"the checkpoint at {at} witnessed trailer {n - 1} ({last[:16]}…) at stream "
            f"sequence {seq}")
    if found is None:
        return f"{cid} trailer {n - 1}: {what}; it is gone: the chain was removed or replaced"
    got, body = found
    if got != subject or not isinstance(body, dict) or body.get("seq") != n - 1 \
            or body.get("hash") != last:
        return (f"{cid} trailer {n - 1}: {what}; another message is there: the chain was "
                "removed or replaced")
    return None


def runtime_chain_problem(cid: str, witnessed: Witnessed, length: int | None,
                          hash_at: str | None) -> str | None:
    """Why a tool runtime's chain no longer holds the head a checkpoint witnessed, or None:
    it is missing (`length` None), shorter, or its trailer at the witnessed position has
    another hash (`hash_at`; None when the reader did not see that trailer: not judged)."""
    n, last, _, at = witnessed
    what = f"the checkpoint at {at} witnessed {n} trailers ending in {last[:16]}…"
    if length is None:
        return f"{cid}: the chain is missing; {what}: the whole chain was removed"
    if length < n:
        return f"{cid}: the chain holds {length} trailers; {what}: trailers were removed"
    if hash_at is not None and hash_at != last:
        return (f"{cid} trailer {n - 1}: it is not the trailer {what}: the chain was "
                "replaced or rewritten")
    return None


def check(log_hashes: Sequence[str], cp: Checkpoint, trusted: set[str] | None = None) -> str | None:
    """None when the log (trailer hashes in stream order, checkpoints excluded) still holds
    everything `cp` committed to; else the first problem found."""
    if not signature_ok(cp):
        return f"checkpoint at {cp.at}: the signature does not verify"
    if trusted is not None and (untrusted := trust_problem(cp, trusted)):
        return untrusted
    if len(log_hashes) < cp.count:
        return (f"checkpoint at {cp.at} covered {cp.count} trailers; only {len(log_hashes)} "
                "remain: trailers or whole chains were removed")
    if merkle_root(log_hashes[:cp.count]) != cp.root:
        return (f"checkpoint at {cp.at}: the first {cp.count} trailers no longer hash to its "
                "root: trailers were removed, altered or reordered")
    return None


# -- the last checkpoint kept outside the audit stream (issue 13, item 4) -----------------------


@dataclass(frozen=True)
class Anchor:
    """The last checkpoint as the daemon keeps it in its data directory too, with the identity
    of the stream it was signed over: the stream's creation time, its last sequence then, and
    an open crisis this daemon recorded (kept until the autonomy chain shows it resolved)."""

    stream_created: str
    last_seq: int
    count: int
    root: str
    keyid: str
    at: int
    crisis: str = ""
    frontier: Frontier = ()  # empty in an anchor written before frontiers were kept
    last_hash: str = ""
    scrubbed_to: int = 0  # how far the current scrub pass has re-read the covered log
    members: Members | None = None  # the checkpoint's counts of each index's members


ANCHOR_FIELDS = ("stream_created", "last_seq", "count", "root", "keyid", "at", "crisis")


def anchor_of(cp: Checkpoint, stream_created: str, crisis: str = "",
              scrubbed_to: int = 0) -> Anchor:
    return Anchor(stream_created, cp.last_seq, cp.count, cp.root, cp.keyid, cp.at, crisis,
                  cp.frontier, cp.last_hash, scrubbed_to, cp.members)


def anchor_dict(anchor: Anchor) -> dict[str, Any]:
    doc = {name: getattr(anchor, name) for name in ANCHOR_FIELDS}
    doc.update(frontier=list(anchor.frontier), last_hash=anchor.last_hash,
               scrubbed_to=anchor.scrubbed_to)
    if anchor.members is not None:
        doc["members"] = dict(anchor.members)
    return doc


def anchor_from(doc: Any) -> Anchor:
    """An Anchor from its decoded JSON; ValueError naming what is wrong with it."""
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    try:
        fields = {name: doc[name] for name in ANCHOR_FIELDS}
    except KeyError as missing:
        raise ValueError(f"no {missing.args[0]!r}") from None
    for name, typ in (("stream_created", str), ("last_seq", int), ("count", int),
                      ("root", str), ("keyid", str), ("at", int), ("crisis", str)):
        if not isinstance(fields[name], typ):
            raise ValueError(f"{name!r} is not a {typ.__name__}")
    frontier = doc.get("frontier", [])
    if frontier and not merkle.well_formed(frontier, fields["count"]):
        raise ValueError("'frontier' is not one subtree root per set bit of 'count'")
    if not isinstance(doc.get("last_hash", ""), str):
        raise ValueError("'last_hash' is not a str")
    scrubbed = doc.get("scrubbed_to", 0)
    if not isinstance(scrubbed, int) or isinstance(scrubbed, bool) or scrubbed < 0:
        raise ValueError("'scrubbed_to' is not a sequence number")
    members = doc.get("members")
    counts = None if members is None else _members(members)
    if members is not None and counts is None:
        raise ValueError("'members' is not a count per index")
    return Anchor(**fields, frontier=tuple(frontier), last_hash=doc.get("last_hash", ""),
                  scrubbed_to=scrubbed, members=counts)


def anchor_continues(anchor: Anchor) -> bool:
    """Whether the next checkpoint can continue from a kept anchor (see `continues`)."""
    return continues(Checkpoint(anchor.count, anchor.root, anchor.last_seq, anchor.at,
                                frontier=anchor.frontier, last_hash=anchor.last_hash))


def kept_elsewhere(local: AbstractSet[str], configured: AbstractSet[str],
                   log_signers: AbstractSet[str]) -> bool:
    """Whether a data directory's checkpoint key and kept checkpoint (`local`: their daemon
    key ids) were kept for another deployment than the log being verified, so that the log
    is not checked against them (a note, not a break). Only when all three hold:

    - none of them is a key `[trust] daemons` names (`configured`): a key configured as
      trusted is trusted for this log, and a log it does not find is a break;
    - the log's daemon chains are signed (`log_signers`: the key ids that signed the heads
      of the checkpoint, autonomy, policy and trust chains, each signature valid), so a
      daemon wrote this log: an empty or unsigned log is checked against the file, and one
      deleted and re-created empty is a break;
    - and none of those heads is signed by a `local` key: the daemon that kept the file
      does not write this log.

    Whoever deletes and re-creates the stream cannot sign with the daemon's key: to pass
    the file off as another deployment's, the new log must be signed by a key of their own,
    which no trust anchor here vouches for, so the verdict is at best UNVERIFIED (exit 3),
    never VERIFIED; and the daemon, writing its next trailer there with its own key, makes
    the file this log's again (then the re-creation is a break). A verifier that must tell
    the two apart configures the daemon's key in `[trust] daemons`."""
    return not (local & configured) and bool(log_signers) and not (local & log_signers)


@dataclass(frozen=True)
class StreamView:
    """What a reader found of the audit stream: its creation time (None: the stream does not
    exist), its last sequence, and the sequences it holds that could not be read."""

    created: str | None
    last_seq: int = 0
    unreadable: tuple[int, ...] = ()
    first_seq: int = 1
    messages: int | None = None  # None: not known (then nothing is said about removals)


def unreadable_problem(view: StreamView) -> str | None:
    if not view.unreadable:
        return None
    shown = ", ".join(str(s) for s in view.unreadable[:10])
    more = f" and {len(view.unreadable) - 10} more" if len(view.unreadable) > 10 else ""
    return (f"the audit stream holds {len(view.unreadable)} trailer(s) that could not be read "
            f"(stream sequence {shown}{more}): its storage is damaged")


def prefix_problem(base: Anchor, view: StreamView, found_hash: str | None,
                   what: str = "the last checkpoint", removable: int = 0) -> str | None:
    """In O(1), whether the stream still holds what the checkpoint `base` covered: the same
    stream (its creation time), nothing removed from it (it starts at sequence 1 and holds a
    message at every sequence up to its last), and the trailer at `base.last_seq` still has
    the hash `base` names (`found_hash`; an anchor kept before it named one is checked by
    its root while the log is read instead). JetStream never changes a stored message, so with
    these the covered prefix is the one that was verified before `base` was signed; storage
    altered beneath the server is what a full `improved audit verify` finds. `removable`:
    how many trailers sealed epochs allow to be archived (missing) at the stream's start
    (`core.epochs`); which ones they are is what a full verify checks."""
    what = (f"{what} (at {base.at}, {base.count} trailers up to stream sequence "
            f"{base.last_seq})")
    if view.created is None:
        return f"the audit stream does not exist: {what} are all missing"
    found = []
    if base.stream_created and view.created != base.stream_created:
        found.append(f"the audit stream was re-created (created {view.created}, not "
                     f"{base.stream_created} as when {what} was signed)")
    absent = view.first_seq - 1 + (view.last_seq - view.first_seq + 1 - view.messages
                                   if view.messages is not None else 0)
    if view.last_seq < base.last_seq or ((base.count or view.messages) and absent > removable):
        held = f"{view.messages} messages" if view.messages is not None else "messages"
        found.append(f"the stream holds {held} at sequences {view.first_seq}..{view.last_seq} "
                     f"of {what}: trailers or whole chains were removed or lost")
    elif base.count and base.last_hash and found_hash != base.last_hash:
        found.append(f"the trailer at stream sequence {base.last_seq} is not the one {what} "
                     "covered last: trailers were removed, altered or reordered")
    return "; ".join(found) or None


def trust_problem(cp: Checkpoint, trusted: set[str]) -> str | None:
    """A checkpoint counts only when signed by a trusted daemon key."""
    if cp.keyid in trusted:
        return None
    return (f"checkpoint at {cp.at} is signed by {cp.keyid}, which is not a trusted daemon key "
            "([trust] daemons, or the daemon's own checkpoint key)")
