"""Expiry as a computed status (issue 19, item 6; OMS §8.12: `expired` is computed from
`valid_to`, reachable from pending or approved, withdraws an approval, is never applied).

`record.status_at` is the one definition: every place that shows a status or decides on one
asks it, so a proposal past its `valid_to` is expired from that instant — in `show`, in
`review`, in the retained state, to an operator's approval — whether or not its chain has
recorded the expiry yet; the daemon records it at the first pass after `valid_to`."""

from __future__ import annotations

import base64

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from improved.core import authority, planner, propose, queue, signing
from improved.core.authority import Act
from improved.core.policy import Policy
from improved.core.record import ProposalRecord, status_at
from improved.core.signing import TrustStore
from improved.protocol.model import Review, Signal, TriageDecision
from tests.builders import NOW, TRIAGER, committed, make_proposal

POLICY = Policy()
STATUSES = ("pending", "approved", "rejected", "applied", "rolled_back", "expired")


def record(valid_to: int | None = NOW + 10, status: str = "pending",
           cause: str | None = "awaiting_operator", verdict: str = "defer",
           cls: str = "L2", **over) -> ProposalRecord:
    proposal = make_proposal(valid_to=valid_to, change_class=cls)
    pid, dedup = propose.identify(proposal)
    rec, _ = propose.register(proposal, pid, dedup, POLICY, NOW - 10)
    decision = TriageDecision(proposal_id=pid, service="svc", verdict=verdict, cause=cause,
                              gate_class=cls, rationale="", actor=TRIAGER, at=NOW - 5)
    return rec.replace(decision=decision, status=status, **over)


# -- the one definition ------------------------------------------------------------------------


@given(status=st.sampled_from(STATUSES), valid_to=st.none() | st.integers(NOW - 5, NOW + 5),
       in_flight=st.booleans(), now=st.integers(NOW - 10, NOW + 10))
def test_status_at_is_the_chains_status_until_valid_to(status, valid_to, in_flight, now):
    r = record(valid_to=valid_to, status=status,
               **({"dispatched_at": NOW - 1, "dispatched_by": "operator:alice"}
                  if in_flight else {}))
    expires = (status in ("pending", "approved") and not in_flight
               and valid_to is not None and valid_to <= now)
    assert status_at(r, now) == ("expired" if expires else status)


def test_an_order_in_flight_is_not_expired_its_outcome_decides():
    r = record(status="approved", dispatched_at=NOW - 1, dispatched_by="operator:alice")
    assert status_at(r, NOW + 100) == "approved"


def test_expired_from_the_very_millisecond_of_valid_to():
    r = record()
    assert status_at(r, NOW + 9) == "pending" and status_at(r, NOW + 10) == "expired"


# -- the queue and the operator's acts ---------------------------------------------------------


def test_an_expired_proposal_leaves_the_queue_at_valid_to():
    waiting, surfaced = record(), record(cls="L1", verdict="accept", cause=None)
    for r in (waiting, surfaced):
        assert queue.queued(r, NOW + 9) and not queue.queued(r, NOW + 10)
        assert queue.queued(r)  # the chain's word alone: the index entry until it is recorded
    assert authority.is_waiting(waiting, NOW + 9) and not authority.is_waiting(waiting, NOW + 10)


def test_the_index_entry_carries_valid_to():
    r = record()
    entry = queue.entry_of(r)
    assert entry is not None and entry.valid_to == NOW + 10
    assert queue.entry_of(record(valid_to=None)).valid_to is None


ALICE = Ed25519PrivateKey.generate()
OPERATORS = TrustStore.from_config({
    "operator:alice": base64.b64encode(signing.raw_public(ALICE.public_key())).decode()})


def review_at(r: ProposalRecord, verdict: str, now: int):
    rv = Review(proposal_id=r.proposal_id, verdict=verdict, principal="operator:alice",
                reason="ok", at=now)
    env = signing.sign(signing.PAYLOAD_TYPES["review"], msgspec.json.encode(rv), ALICE)
    verified = OPERATORS.verify(env, signing.PAYLOAD_TYPES["review"])
    return authority.review(r, Act(verified.digest, 7), verified, rv, False, TRIAGER, now)


@pytest.mark.parametrize("verdict", ["approve", "reject"])
def test_a_review_after_valid_to_is_refused_even_before_the_expiry_is_recorded(verdict):
    r = record()
    ok = review_at(r, verdict, NOW + 9)
    assert ok.verdict == verdict
    late = review_at(r, verdict, NOW + 10)
    assert late.verdict == "refused" and "code:not_awaiting_review" in late.refs
    assert "expired" in late.reason and str(NOW + 10) in late.reason
    after = committed(r, late, NOW + 10)
    assert (after.status, after.approved_by) == ("pending", None)


# -- the daemon records it at the first pass after valid_to --------------------------------------


def step_at(r: ProposalRecord, now: int) -> planner.Step:
    return planner.next_step(r, planner.View(now=now), POLICY, TRIAGER)


@pytest.mark.parametrize("r", [
    record(),  # waiting for an operator
    record(cls="L1", verdict="accept", cause=None),  # surfaced
    record(cause="awaiting_quorum", cls="L4"),
    record(cause="feedback_collapse", signals=()),  # deferred as self-confirmed
    record(status="approved", verdict="accept", cause=None, approved_by="operator:alice"),
], ids=["waiting", "surfaced", "quorum", "collapse", "approved"])
def test_a_pass_after_valid_to_records_the_expiry(r):
    assert not (isinstance(s := step_at(r, NOW + 9), planner.Commit)
                and s.draft.cause == "expired")
    step = step_at(r, NOW + 10)
    assert isinstance(step, planner.Commit), step
    assert (step.draft.to_stage, step.draft.verdict, step.draft.cause) == (
        "triage", "reject", "expired")
    assert committed(r, step.draft, NOW + 10).decision.cause == "expired"


def test_a_superseded_proposal_is_left_as_it_is():
    r = record(superseded_by="f" * 64)
    assert status_at(r, NOW + 10) == "expired"  # shown so: it will never be applied
    assert step_at(r, NOW + 10) == planner.DONE  # nothing more is written on its chain


def test_a_signal_after_valid_to_does_not_release_an_expired_proposal():
    r = record(cause="feedback_collapse")
    sig = Signal(kind="check", actor="check:ci", service="ci", positive=True, at=NOW + 11)
    counted = propose.count(sig, "d" * 64, r.proposal, None, POLICY, emitter="check:ci")
    released = r.replace(signals=(counted,))
    step = step_at(released, NOW + 12)
    assert isinstance(step, planner.Commit) and step.draft.cause == "expired"
