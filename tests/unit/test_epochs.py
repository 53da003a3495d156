"""Epochs of the audit log (core.epochs): where an epoch may be cut, and the seal."""

from __future__ import annotations

import dataclasses

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.core import epochs


def test_the_cut_stops_before_the_oldest_open_chain_and_a_seal_verifies():
    def trailer(seq, verdict=None, to_stage="triage", at=1):
        return {"seq": seq, "to_stage": to_stage, "verdict": verdict, "at": at}

    scan = epochs.Scan()
    scan.feed(1, "improve.audit.svc.a", trailer(0, to_stage="propose"))
    scan.feed(2, "improve.audit.svc.a", trailer(1, "reject"))  # closed
    scan.feed(3, "improve.audit._policy.p", trailer(0, "policy"))  # a mesh chain: not held
    scan.feed(4, "improve.audit.svc.b", trailer(0, to_stage="propose"))  # pending: open
    scan.feed(5, "improve.audit.svc.c", trailer(0, to_stage="propose"))
    assert scan.cut(10, now=100, retention_days=0) == 3
    assert epochs.closed("applied", last_at=5, horizon=5)
    assert not epochs.closed("applied", last_at=6, horizon=5)
    assert not epochs.closed("approved", last_at=0, horizon=5)

    key = Ed25519PrivateKey.generate()
    seal = epochs.make(1, 3, (), 0, "", 2, 7, key)
    body = {"refs": list(epochs.draft(seal, "improved:x").refs)}
    read = epochs.from_trailer(body)
    assert read == seal and epochs.problem(read, {seal.keyid}) is None
    assert "not a trusted" in (epochs.problem(read, {"ed25519:" + "0" * 64}) or "")
    assert epochs.problem(read, set()) is None  # no trust anchor: its key is not checked
    forged = dataclasses.replace(read, removable=99)
    assert "signature" in (epochs.problem(forged, {seal.keyid}) or "")


def _epoch(prev: epochs.Seal | None = None, upto: int = 6):
    """Trailers from after `prev` up to stream sequence `upto` (the checkpoint at the third),
    and the seal over them."""
    from improved.core import audit, merkle

    first = prev.upto + 1 if prev else 1
    trailers = []
    for seq in range(first, upto + 1):
        subject = epochs.CHECKPOINT_SUBJECT if seq == first + 2 else \
            ("improve.audit._policy.p" if seq == first + 1 else f"improve.audit.svc.c{seq}")
        body = {"proposal_id": subject.rsplit(".", 1)[1], "seq": 0, "n": seq}
        trailers.append((seq, subject, {**body, "hash": audit.trailer_hash(body)}))
    counted = [(s, b) for s, subject, b in trailers if subject != epochs.CHECKPOINT_SUBJECT]
    tree = merkle.Tree(prev.frontier, prev.count) if prev else merkle.Tree()
    for _, body in counted:
        tree.add(body["hash"])
    removable = (prev.removable if prev else 0) + sum(
        epochs.is_proposal_chain(subject) for _, subject, _ in trailers
        if subject != epochs.CHECKPOINT_SUBJECT)
    seal = epochs.make(prev.epoch + 1 if prev else 1, upto, tree.frontier(), tree.count,
                       counted[-1][1]["hash"], removable, 7, Ed25519PrivateKey.generate())
    return trailers, seal


def _checked(trailers, seal, prev=None) -> str | None:
    check = epochs.EpochCheck(seal, prev)
    for seq, subject, body in trailers:
        check.feed(seq, subject, body)
    return check.problem()


def test_an_epoch_checks_out_exactly_against_its_seal_and_each_fault_is_named():
    trailers, seal = _epoch()
    assert _checked(trailers, seal) is None
    later, second = _epoch(seal, upto=12)
    assert _checked(later, second, seal) is None  # folded on from the first seal

    missing = _checked(trailers[:3] + trailers[4:], seal) or ""
    assert "stream sequence 4 is missing" in missing and "4 trailers" in missing
    assert "stream sequence 3 is missing" in (_checked(trailers[:2] + trailers[3:], seal) or "")
    twice = _checked(trailers[:4] + trailers[3:], seal) or ""
    assert "stream sequence 4 comes twice" in twice and "6 trailers" in twice
    swapped = _checked([trailers[0], trailers[3], trailers[2], trailers[1], *trailers[4:]],
                       seal) or ""
    assert "out of order" in swapped and "missing" not in swapped and "root" in swapped
    assert "outside the epoch (7..12)" in (_checked([trailers[-1], *later], second, seal) or "")
    seq, subject, body = trailers[1]
    altered = _checked([trailers[0], (seq, subject, {**body, "n": 0}), *trailers[2:]], seal)
    assert "the trailer at stream sequence 2 does not hash" in (altered or "")
    moved = _checked([trailers[0], (seq, "improve.audit.svc.p", body), *trailers[2:]], seal)
    assert "5 of them of proposal chains, where the seal counts 5 and 4" in (moved or "")
    check = epochs.EpochCheck(seal, None)
    for seq, subject, body in trailers:
        if seq == 5:
            check.bad_line(5, "not JSON")
        else:
            check.feed(seq, subject, body)
    assert "line 5 is not an exported trailer (not JSON)" in (check.problem() or "")
    empty = epochs.EpochCheck(seal, None)
    assert "stream sequences 1, 2, 3, 4, 5 and 1 more are missing" in (empty.problem() or "")
