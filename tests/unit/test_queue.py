"""The operator's queue (core.queue): what `review` lists, and when a pass writes the review
index — only when the entry changes, on a republish, and never for an L0 proposal."""

from __future__ import annotations

from improved.core import propose, queue
from improved.core.policy import Policy
from improved.core.record import ProposalRecord
from improved.protocol.model import ReviewEntry, TriageDecision
from tests.builders import NOW, make_proposal


def record(cls: str = "L2", verdict: str | None = "defer", cause: str | None = "awaiting_operator",
           status: str = "pending", at: int = NOW, **over) -> ProposalRecord:
    proposal = make_proposal(change_class=cls, **({"target_ref": "rank:x"} if cls == "L0"
                                                  else {}))
    pid, dedup = propose.identify(proposal)
    rec, _ = propose.register(proposal, pid, dedup, Policy(), NOW - 10)
    decision = None if verdict is None else TriageDecision(
        proposal_id=pid, service="svc", verdict=verdict, cause=cause, gate_class=cls,
        rationale="", actor="improved:test", at=at)
    return rec.replace(decision=decision, status=status, **over)


def test_queued_is_waiting_or_a_surfaced_l1():
    assert queue.queued(record())
    assert queue.queued(record("L1", "accept", None))
    assert queue.queued(record("L4", cause="awaiting_quorum"))
    assert not queue.queued(record(verdict=None))  # not triaged yet
    assert not queue.queued(record("L0", "accept", None))
    assert not queue.queued(record("L0", cause="circuit_open"))  # held back, not for review
    assert not queue.queued(record(status="approved", verdict="approve", cause=None))
    assert not queue.queued(record(superseded_by="f" * 64))
    assert not queue.queued(record("L1", "accept", None, status="rejected"))
    assert not queue.queued(None)


def test_the_entry_says_where_to_look_and_since_when():
    r = record(at=NOW + 5)
    assert queue.entry_of(r) == ReviewEntry(proposal_id=r.proposal_id, service="svc",
                                            since=NOW + 5)
    assert queue.entry_of(record(verdict="reject", cause=None, status="rejected")) is None


def test_a_pass_writes_the_index_only_when_the_queue_changed():
    waiting, approved = record(), record(status="approved", verdict="approve", cause=None)
    entry = queue.entry_of(waiting)
    assert queue.change(None, waiting, False) == queue.Write(entry)  # enters
    assert queue.change(waiting, approved, False) == queue.Write(None)  # leaves: a tombstone
    assert queue.change(waiting, waiting, False) is None
    assert queue.change(approved, approved, False) is None
    # a new chain had no entry: nothing to take out
    assert queue.change(None, approved, False) is None
    assert queue.change(None, approved, True) is None
    # still waiting, on another cause (a quorum dissent): the entry moves with its decision
    assert queue.change(waiting, record(cause="quorum_dissent", at=NOW + 1), False) is not None


def test_a_republish_writes_again_except_for_l0():
    waiting, rejected = record(), record(verdict="reject", cause=None, status="rejected")
    assert queue.change(waiting, waiting, True) == queue.Write(queue.entry_of(waiting))
    assert queue.change(rejected, rejected, True) == queue.Write(None)  # a lost tombstone
    applied = record("L0", "accept", None, status="applied")
    assert queue.change(applied, applied, True) is None
    assert queue.change(None, applied, True) is None
