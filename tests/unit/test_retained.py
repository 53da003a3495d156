"""The retained records a record shows (`core.retained`), said once for the daemon's publisher
and for `improved audit rebuild`: which subjects, which of them again after a change, the TTL
of a closed proposal's, and the states an audit accepts as the chain's."""

from __future__ import annotations

from improved.core import propose, retained
from improved.core.policy import Policy
from improved.core.record import ProposalRecord, state_of
from improved.protocol import subjects as S
from improved.protocol.model import ApplyOutcome, TriageDecision
from tests.builders import NOW, TRIAGER, make_proposal

POLICY = Policy()


def registered(**over) -> ProposalRecord:
    proposal = make_proposal(**over)
    pid, dedup = propose.identify(proposal)
    return propose.register(proposal, pid, dedup, POLICY, NOW - 10)[0]


def decided(record: ProposalRecord, verdict: str = "defer") -> ProposalRecord:
    return record.replace(decision=TriageDecision(
        proposal_id=record.proposal_id, service=record.service, verdict=verdict,
        cause="awaiting_operator" if verdict == "defer" else None, gate_class="L2",
        rationale="", actor=TRIAGER, at=NOW - 5))


def test_a_new_record_shows_its_state_alone():
    record = registered()
    assert retained.shown(record, NOW) == [
        (S.proposal_state("svc", record.proposal_id), state_of(record, NOW))]


def test_a_decided_and_applied_record_shows_its_decision_and_outcome():
    record = decided(registered())
    applied = record.replace(status="applied", outcome=ApplyOutcome(
        proposal_id=record.proposal_id, service="svc", ok=True, applied_id="a1",
        authority="operator", at=NOW))
    pid = record.proposal_id
    assert [subject for subject, _ in retained.shown(applied, NOW)] == [
        S.proposal_state("svc", pid), S.triage_decision("svc", pid), S.apply_outcome("svc", pid)]
    # since the record they were last shown for: the state, and only what changed
    assert [subject for subject, _ in retained.shown(applied, NOW, since=record)] == [
        S.proposal_state("svc", pid), S.apply_outcome("svc", pid)]


def test_a_closed_proposals_records_carry_the_ttl_an_open_ones_none():
    record = decided(registered())
    assert retained.ttl_of(record, 86400) is None
    rejected = record.replace(status="rejected")
    assert retained.ttl_of(rejected, 86400) == 86400
    assert retained.ttl_of(rejected, 0) is None  # kept for good


def test_a_state_shown_before_valid_to_passed_is_still_the_chains():
    record = decided(registered(valid_to=NOW))
    as_of_now, as_chained = retained.states(record, NOW + 1)
    assert (as_of_now.status, as_chained.status) == ("expired", "pending")
    assert state_of(record, NOW - 1) in retained.states(record, NOW + 1)
    assert state_of(record.replace(status="approved"), NOW - 1) \
        not in retained.states(record, NOW + 1)
