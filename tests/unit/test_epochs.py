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
    assert "not a trusted" in (epochs.problem(read, set()) or "")
    forged = dataclasses.replace(read, removable=99)
    assert "signature" in (epochs.problem(forged, {seal.keyid}) or "")
