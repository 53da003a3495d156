"""Signed checkpoints over the whole audit log, pure: the Merkle root (RFC 6962) and every kind
of tampering a checkpoint detects. The crisis a broken log puts the daemon in is in
tests/integration/test_checkpoint.py."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.core import checkpoint, merkle


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
    from improved.core.trailers import ref

    chain = [{"verdict": "crisis", "refs": [ref("crisis", "crisis-1")]},
             {"verdict": "crisis_resolved", "refs": [ref("resolved", "crisis-1")]}]
    assert breaker.resolved(chain, "crisis-1")
    assert not breaker.resolved(chain, "crisis-2")
    assert not breaker.resolved(chain[:1], "crisis-1")


# -- carrying a checkpoint forward: the Merkle frontier and the O(1) prefix check ---------------


def _reference_root(leaves: list[str]) -> str:
    """RFC 6962 §2.1 as written: split at the largest power of two below n, recurse."""
    def mth(nodes: list[bytes]) -> bytes:
        if len(nodes) == 1:
            return hashlib.sha256(b"\x00" + nodes[0]).digest()
        k = 1
        while k * 2 < len(nodes):
            k *= 2
        return hashlib.sha256(b"\x01" + mth(nodes[:k]) + mth(nodes[k:])).digest()

    return mth([bytes.fromhex(h) for h in leaves]).hex() if leaves else \
        hashlib.sha256(b"").hexdigest()


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=300), st.data())
def test_a_frontier_carried_forward_gives_the_root_of_the_whole_log(n, data):
    """Whatever the point a checkpoint was signed at, continuing from its frontier gives the
    root a reader hashing every trailer from the first gets."""
    leaves = [leaf(i) for i in range(n)]
    cut = data.draw(st.integers(min_value=0, max_value=n))
    carried = merkle.extend(merkle.extend((), 0, leaves[:cut]), cut, leaves[cut:])
    assert merkle.well_formed(carried, n)
    assert merkle.root(carried) == _reference_root(leaves) == checkpoint.merkle_root(leaves)


def test_a_checkpoint_continues_only_with_a_frontier_that_is_one_with_its_root():
    log, cp, anchor, key = anchored(11)
    assert checkpoint.continues(cp) and checkpoint.anchor_continues(anchor)
    assert cp.last_hash == log[-1] and len(cp.frontier) == 3  # 11 = 8 + 2 + 1
    body = {"refs": list(checkpoint.draft(cp, "improved:a").refs)}
    assert checkpoint.from_trailer(body) == cp  # the trailer carries everything it needs
    forged = dataclasses.replace(cp, frontier=(leaf(1), leaf(2), leaf(3)))
    assert not checkpoint.continues(forged)  # well formed, but not the tree it signed
    assert not checkpoint.continues(dataclasses.replace(cp, frontier=cp.frontier[:2]))
    old = dataclasses.replace(anchor, frontier=(), last_hash="")  # kept before frontiers
    assert not checkpoint.anchor_continues(old)
    assert checkpoint.anchor_from(checkpoint.anchor_dict(anchor)) == anchor
    doc = {k: v for k, v in checkpoint.anchor_dict(anchor).items()
           if k not in ("frontier", "last_hash", "scrubbed_to")}
    assert checkpoint.anchor_from(doc) == old  # an anchor file written before still reads
    with pytest.raises(ValueError, match="frontier"):
        checkpoint.anchor_from({**checkpoint.anchor_dict(anchor), "frontier": [leaf(1)]})


@pytest.mark.parametrize(("view", "found", "named"), [
    (checkpoint.StreamView(CREATED, 14, first_seq=1, messages=14), "last", None),
    (checkpoint.StreamView(None), None, "does not exist"),
    (checkpoint.StreamView("2026-02-01 00:00:00+00:00", 14, first_seq=1, messages=14), "last",
     "re-created"),
    (checkpoint.StreamView(CREATED, 14, first_seq=1, messages=13), "last", "removed or lost"),
    (checkpoint.StreamView(CREATED, 14, first_seq=3, messages=12), "last", "removed or lost"),
    (checkpoint.StreamView(CREATED, 8, first_seq=1, messages=8), None, "removed or lost"),
    (checkpoint.StreamView(CREATED, 14, first_seq=1, messages=14), leaf(3), "not the one"),
], ids=["grown", "gone", "re-created", "a message deleted", "head purged", "shorter",
        "rewritten"])
def test_the_stream_still_holds_what_the_last_checkpoint_covered_in_o1(view, found, named):
    log, _, anchor, _ = anchored(10)
    problem = checkpoint.prefix_problem(anchor, view, log[-1] if found == "last" else found)
    if named is None:
        assert problem is None
    else:
        assert problem is not None and named in problem and "10 trailers" in problem, problem


def test_a_checkpoint_witnesses_the_runtime_chain_heads_outside_its_statement():
    """The tool runtimes' chain heads ride on the checkpoint trailer (`runtime_heads:`), not
    in the signed statement: a checkpoint with or without them signs the same bytes, and a
    malformed ref witnesses nothing."""
    from improved.core import audit
    from improved.core.record import ChainHead

    key = Ed25519PrivateKey.generate()
    heads = [("b" * 64, 3, "c" * 64, 9), ("a" * 64, 1, "d" * 64, 4)]
    cp = checkpoint.make_from((), 0, 0, "", 1000, key, heads)
    bare = checkpoint.make_from((), 0, 0, "", 1000, key)
    assert cp.statement() == bare.statement() and checkpoint.signature_ok(cp)
    body = msgspec_body(audit.seal_next(checkpoint.draft(cp, "improved:x"),
                                        checkpoint.CHECKPOINT_ID, ChainHead(), "L0",
                                        "operation", 1000))
    assert checkpoint.runtime_heads(body) == tuple(sorted(heads))
    assert checkpoint.from_trailer(body).runtimes == tuple(sorted(heads))
    assert not any(r.startswith("runtime_heads:") for r in checkpoint.draft(bare, "x").refs)
    for bad in ("runtime_heads:[1]", "runtime_heads:{", 'runtime_heads:{"a":[0,"x",1]}',
                'runtime_heads:{"a":[true,"x",1]}', 'runtime_heads:{"a":[1,"x"]}',
                'runtime_heads:{"a":[1,"x",0]}'):
        assert checkpoint.runtime_heads({"refs": [bad]}) == ()


def test_the_longest_witnessed_head_is_what_a_runtime_chain_must_still_hold():
    """Each chain's longest witnessed head is kept; one a longer head replaces is handed back
    to be looked up where it was, and a later witness shorter than, or as long as but other
    than, an earlier one is named at once."""
    seen: checkpoint.Witness = {}
    assert checkpoint.witness(seen, [("c", 2, "h2", 7)], 10) == ([], [])
    assert checkpoint.witness(seen, [("c", 2, "h2", 7)], 15) == ([], [])  # the same again
    assert checkpoint.witness(seen, [("c", 5, "h5", 9)], 20) == ([("c", (2, "h2", 7, 10))], [])
    superseded, problems = checkpoint.witness(seen, [("c", 4, "h4", 8), ("d", 1, "x", 3)], 30)
    assert superseded == [] and [cid for cid, _ in problems] == ["c"]
    assert "the chain was cut short between them" in problems[0][1]
    _, problems = checkpoint.witness(seen, [("c", 5, "other", 9)], 40)
    assert "the chain was replaced between them" in problems[0][1]
    assert seen == {"c": (5, "h5", 9, 20), "d": (1, "x", 3, 30)}
    problem = checkpoint.runtime_chain_problem
    assert problem("c", seen["c"], 5, "h5") is None
    assert problem("c", seen["c"], 9, "h5") is None
    assert problem("c", seen["c"], 9, None) is None  # that trailer not seen: not judged
    assert "the chain is missing" in problem("c", seen["c"], None, None)
    assert "the chain holds 4 trailers" in problem("c", seen["c"], 4, None)
    assert problem("c", seen["c"], 9, "other").startswith("c trailer 4: it is not the trailer")
    found = checkpoint.witnessed_trailer_problem
    assert found("c", "s.c", seen["c"], ("s.c", {"seq": 4, "hash": "h5"})) is None
    assert "it is gone" in found("c", "s.c", seen["c"], None)
    for other in (("s.d", {"seq": 4, "hash": "h5"}), ("s.c", {"seq": 3, "hash": "h5"}),
                  ("s.c", {"seq": 4, "hash": "h4"}), ("s.c", None)):
        assert "another message is there" in found("c", "s.c", seen["c"], other)


def msgspec_body(trailer) -> dict:
    import msgspec

    return msgspec.to_builtins(trailer)


def test_a_data_directory_is_another_deployments_only_when_the_log_shows_another_writer():
    """The data directory's key and kept checkpoint are left out as another deployment's only
    when no configured key vouches for them, a daemon signed this log, and it is not theirs:
    a stream deleted and re-created empty, or re-signed by the same daemon, stays theirs (a
    break), and so does any log when their key is configured."""
    ours, other = {"ed25519:ours"}, {"ed25519:other"}
    assert checkpoint.kept_elsewhere(ours, set(), other)  # another daemon writes this log
    assert not checkpoint.kept_elsewhere(ours, set(), set())  # empty or unsigned: re-created
    assert not checkpoint.kept_elsewhere(ours, set(), ours | other)  # ours writes here too
    assert not checkpoint.kept_elsewhere(ours, ours, other)  # configured: any gap is a break
    assert checkpoint.kept_elsewhere(ours, other, other)  # the configured key is the log's
