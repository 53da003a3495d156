"""Signed checkpoints over the whole audit log, so that removing whole chains is detected too.

A chain proves its own trailers in order, but not that the chain exists at all. A checkpoint
commits to every trailer there was: the count and an RFC 6962 Merkle root over the trailer
hashes in stream order, signed by the daemon's Ed25519 key. A later verifier recomputes the
root over the first `count` trailers it finds: anything removed, altered or reordered before
the checkpoint changes it. Checkpoints are trailers of the chain
`improve.audit._checkpoints.<CHECKPOINT_ID>`. Pure.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from improved.core import signing
from improved.core.audit import Draft
from improved.core.record import ref, refs_of
from improved.protocol import canonical

CHECKPOINT_ID = hashlib.sha256(b"improved checkpoints").hexdigest()


def merkle_root(hashes: Sequence[str]) -> str:
    """RFC 6962 Merkle tree hash over hex leaf hashes (empty tree: SHA-256 of nothing)."""
    if not hashes:
        return hashlib.sha256(b"").hexdigest()
    return _mth([bytes.fromhex(h) for h in hashes]).hex()


def _mth(leaves: list[bytes]) -> bytes:
    if len(leaves) == 1:
        return hashlib.sha256(b"\x00" + leaves[0]).digest()
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    return hashlib.sha256(b"\x01" + _mth(leaves[:k]) + _mth(leaves[k:])).digest()


@dataclass(frozen=True)
class Checkpoint:
    count: int
    root: str
    last_seq: int
    at: int
    keyid: str = ""
    public: str = ""  # base64 of the raw Ed25519 key
    sig: str = ""

    def statement(self) -> bytes:
        """The signed bytes: canonical MessagePack of what the checkpoint commits to."""
        return canonical.encode({"count": self.count, "root": self.root,
                                 "last_seq": self.last_seq, "at": self.at})


def make(hashes: Sequence[str], last_seq: int, at: int, key: Ed25519PrivateKey) -> Checkpoint:
    cp = Checkpoint(count=len(hashes), root=merkle_root(hashes), last_seq=last_seq, at=at)
    public = signing.raw_public(key.public_key())
    return Checkpoint(cp.count, cp.root, cp.last_seq, cp.at, signing.keyid_of(public),
                      base64.b64encode(public).decode(),
                      base64.b64encode(key.sign(cp.statement())).decode())


def signature_ok(cp: Checkpoint) -> bool:
    try:
        public = base64.b64decode(cp.public, validate=True)
        Ed25519PublicKey.from_public_bytes(public).verify(base64.b64decode(cp.sig),
                                                          cp.statement())
    except (ValueError, InvalidSignature):
        return False
    return signing.keyid_of(public) == cp.keyid


def draft(cp: Checkpoint, actor: str) -> Draft:
    return Draft(from_stage="learn-back", to_stage="learn-back", actor=actor,
                 observer_type="rec:system", verdict="checkpoint",
                 reason=f"checkpoint over {cp.count} trailers",
                 refs=(ref("count", cp.count), ref("root", cp.root), ref("last_seq", cp.last_seq),
                       ref("checkpoint_at", cp.at), ref("keyid", cp.keyid),
                       ref("public", cp.public), ref("sig", cp.sig)))


def from_trailer(body: dict[str, Any]) -> Checkpoint:
    refs = refs_of(_Refs(body.get("refs", [])))
    return Checkpoint(count=int(refs["count"]), root=refs["root"],
                      last_seq=int(refs["last_seq"]), at=int(refs["checkpoint_at"]),
                      keyid=refs["keyid"], public=refs["public"], sig=refs["sig"])


@dataclass(frozen=True)
class _Refs:
    refs: list[str]


def check(log_hashes: Sequence[str], cp: Checkpoint, trusted: set[str] | None = None) -> str | None:
    """None when the log (trailer hashes in stream order, checkpoints excluded) still holds
    everything `cp` committed to; else the first problem found."""
    if not signature_ok(cp):
        return f"checkpoint at {cp.at}: the signature does not verify"
    if trusted is not None and cp.keyid not in trusted:
        return f"checkpoint at {cp.at}: signed by {cp.keyid}, which is not trusted"
    if len(log_hashes) < cp.count:
        return (f"checkpoint at {cp.at} covered {cp.count} trailers; only {len(log_hashes)} "
                "remain: trailers or whole chains were removed")
    if merkle_root(log_hashes[:cp.count]) != cp.root:
        return (f"checkpoint at {cp.at}: the first {cp.count} trailers no longer hash to its "
                "root: trailers were removed, altered or reordered")
    return None
