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


# -- the checkpoint kept outside the stream ------------------------------------------------------

CREATED = "2026-01-01 00:00:00+00:00"


def anchored(n: int = 10):
    key = Ed25519PrivateKey.generate()
    log = [leaf(i) for i in range(n)]
    cp = checkpoint.make(log, last_seq=n, at=1, key=key)
    return log, cp, checkpoint.anchor_of(cp, CREATED), key


def test_the_kept_checkpoint_holds_for_the_same_stream_grown_longer():
    log, _, anchor, _ = anchored()
    view = checkpoint.StreamView(CREATED, 14)
    assert checkpoint.against_anchor(anchor, view, log + [leaf(10), leaf(11)]) is None


@pytest.mark.parametrize(("view", "cut", "named"), [
    (checkpoint.StreamView(None), 10, "does not exist"),
    (checkpoint.StreamView("2026-02-01 00:00:00+00:00", 3), 0, "re-created"),
    (checkpoint.StreamView(CREATED, 7), 7, "only 7 trailers"),
    (checkpoint.StreamView(CREATED, 12), 10, "no longer hash"),
])
def test_a_lost_shorter_recreated_or_rewritten_stream_is_named(view, cut, named):
    log, _, anchor, _ = anchored()
    log = log[:cut]
    if named == "no longer hash":
        log[3] = leaf(99)
    problem = checkpoint.against_anchor(anchor, view, log)
    assert problem is not None and named in problem, problem
    assert "10 trailers" in problem


def test_unreadable_sequences_are_named():
    view = checkpoint.StreamView(CREATED, 30, tuple(range(1, 13)))
    problem = checkpoint.unreadable_problem(view)
    assert problem is not None and "stream sequence 1, 2" in problem and "2 more" in problem
    assert checkpoint.unreadable_problem(checkpoint.StreamView(CREATED, 30)) is None


def test_a_checkpoint_by_an_untrusted_key_is_a_break():
    log, cp, _, key = anchored()
    own = cp.keyid
    assert checkpoint.check(log, cp, {own}) is None
    problem = checkpoint.check(log, cp, {"ed25519:" + "0" * 64})
    assert problem is not None and own in problem and "not a trusted daemon key" in problem


def test_log_problems_reads_the_last_checkpoint_on_the_stream():
    from improved.protocol import subjects as S

    log, cp, anchor, _ = anchored(4)
    cp_subject = S.checkpoint_audit(checkpoint.CHECKPOINT_ID)
    bodies = [(i + 1, "improve.audit.svc.x", {"hash": h}) for i, h in enumerate(log)]
    trailer = {"refs": list(checkpoint.draft(cp, "improved:a").refs)}
    whole = [*bodies, (5, cp_subject, trailer)]
    view = checkpoint.StreamView(CREATED, 5)
    assert checkpoint.log_problems(whole, view, anchor, {cp.keyid}) == []
    found = checkpoint.log_problems(whole[1:], view, anchor, set())
    assert len(found) == 2 and "only 3 trailers" in found[0] and "not a trusted" in found[1]


def test_the_anchor_round_trips_and_refuses_a_bad_file():
    _, _, anchor, _ = anchored()
    assert checkpoint.anchor_from(checkpoint.anchor_dict(anchor)) == anchor
    with pytest.raises(ValueError, match="count"):
        checkpoint.anchor_from({**checkpoint.anchor_dict(anchor), "count": "10"})
    with pytest.raises(ValueError, match="root"):
        checkpoint.anchor_from({k: v for k, v in checkpoint.anchor_dict(anchor).items()
                                if k != "root"})


def test_a_crisis_is_resolved_only_by_a_trailer_that_names_it():
    from improved.core import breaker
    from improved.core.record import ref

    chain = [{"verdict": "crisis", "refs": [ref("crisis", "crisis-1")]},
             {"verdict": "crisis_resolved", "refs": [ref("resolved", "crisis-1")]}]
    assert breaker.resolved(chain, "crisis-1")
    assert not breaker.resolved(chain, "crisis-2")
    assert not breaker.resolved(chain[:1], "crisis-1")
