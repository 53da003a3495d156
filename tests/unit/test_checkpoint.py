"""Signed checkpoints over the whole audit log, pure: the Merkle root (RFC 6962) and every kind
of tampering a checkpoint detects. The crisis a broken log puts the daemon in is in
tests/integration/test_checkpoint.py."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.core import checkpoint


def leaf(i: int) -> str:
    return hashlib.sha256(f"trailer {i}".encode()).hexdigest()


def test_merkle_root_follows_rfc_6962():
    assert checkpoint.merkle_root([]) == hashlib.sha256(b"").hexdigest()
    one = bytes.fromhex(leaf(0))
    assert checkpoint.merkle_root([leaf(0)]) == hashlib.sha256(b"\x00" + one).hexdigest()
    two = bytes.fromhex(leaf(1))
    expected = hashlib.sha256(b"\x01" + hashlib.sha256(b"\x00" + one).digest()
                              + hashlib.sha256(b"\x00" + two).digest()).hexdigest()
    assert checkpoint.merkle_root([leaf(0), leaf(1)]) == expected
    # three leaves split at the largest power of two below: (0, 1) and (2)
    left = bytes.fromhex(expected)
    right = hashlib.sha256(b"\x00" + bytes.fromhex(leaf(2))).digest()
    assert checkpoint.merkle_root([leaf(0), leaf(1), leaf(2)]) == \
        hashlib.sha256(b"\x01" + left + right).hexdigest()


@pytest.mark.parametrize("tamper", ["remove_chain", "alter", "reorder", "truncate", "sig"])
def test_a_checkpoint_detects_every_kind_of_tampering(tamper):
    key = Ed25519PrivateKey.generate()
    log = [leaf(i) for i in range(10)]
    cp = checkpoint.make(log, last_seq=10, at=1, key=key)
    assert checkpoint.check(log, cp) is None
    assert checkpoint.check(log + [leaf(99)], cp) is None  # later trailers are fine
    if tamper == "remove_chain":
        bad, where = [h for i, h in enumerate(log) if i not in (2, 5, 7)], "removed"
    elif tamper == "alter":
        bad, where = log[:4] + [leaf(42)] + log[5:], "altered"
    elif tamper == "reorder":
        bad, where = log[:3] + [log[4], log[3]] + log[5:], "reordered"
    elif tamper == "truncate":
        bad, where = log[:8], "removed"
    else:
        bad, where = log, "signature"
        cp = dataclasses.replace(cp, count=cp.count - 1)  # a forged statement, old signature
    problem = checkpoint.check(bad, cp)
    assert problem is not None and where in problem
    assert checkpoint.check(log, cp, trusted={"ed25519:someone-else"}) is not None
