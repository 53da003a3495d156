"""The rules of an L3 grant: what it covers (core.authority.grant_covers, used by the daemon's
gate, the skills store's reads and a service's acceptance check alike), what it was as of a
stream sequence (core.authority.grant_as_of, which an intent is judged by) and when one may be
granted at all (core.authority.tofu_problem)."""

from __future__ import annotations

import pytest

from improved.core.authority import grant_as_of, grant_covers, tofu_problem
from improved.core.record import ProposalRecord
from improved.protocol.model import Grant, GrantCommand
from tests.builders import make_proposal

SKILL = "greet:" + "a" * 64
NOW = 1_700_000_000_000


def grant(**over) -> Grant:
    fields = dict(skill=SKILL, active=True, principal="operator:alice", reason="ok", at=NOW - 5)
    fields.update(over)
    return Grant(**fields)


@pytest.mark.parametrize(("g", "identity", "covers"), [
    (grant(), SKILL, True),
    (grant(expires_at=NOW + 1), SKILL, True),
    (grant(expires_at=NOW), SKILL, False),  # lapses at its expiry instant
    (grant(active=False), SKILL, False),  # revoked
    (grant(), "greet:" + "b" * 64, False),  # another hash of the same name
    (grant(), "greet", False),  # never by name
], ids=["active", "not yet expired", "expired", "revoked", "other hash", "bare name"])
def test_a_grant_covers_exactly_its_hash_while_active_and_unexpired(g, identity, covers):
    assert grant_covers(g, identity, NOW) is covers


def test_a_grant_as_of_a_sequence_counts_only_the_acts_recorded_below_it():
    granted, revoked, again = grant(), grant(active=False), grant(reason="back")
    acts = ((10, granted), (20, revoked), (30, again))
    assert grant_as_of(acts, 10) is None  # nothing below the first act
    assert grant_as_of(acts, 11) is granted
    assert grant_as_of(acts, 20) is granted  # the revoke at 20 is not below 20
    assert grant_as_of(acts, 21) is revoked
    assert grant_as_of(acts, 31) is again and grant_as_of(acts) is again
    assert grant_as_of((), 5) is None


PID = "c" * 64


def l2(**over) -> ProposalRecord:
    """The L2 proposal a grant names, as rebuilt from its chain."""
    fields = dict(proposal_id=PID, service="demo", dedup_key="d", summary_text="s",
                  proposal=make_proposal(target_ref="skill:greet", change_class="L2"),
                  skill=SKILL, gate_class="L2", status="applied", approved_by="operator:alice")
    fields.update(over)
    return ProposalRecord(**fields)


def command(op="grant", proposal_id=PID) -> GrantCommand:
    return GrantCommand(op=op, skill=SKILL, principal="operator:alice", reason="r", at=NOW,
                        proposal_id=proposal_id)


@pytest.mark.parametrize(("cmd", "record", "refused"), [
    (command(), l2(), False),
    (command(op="revoke", proposal_id=None), None, False),  # withdrawing trust needs nothing
    (command(proposal_id=None), None, True),  # names no L2 proposal
    (command(), None, True),  # names one that is not on the chain
    (command(), l2(skill="greet:" + "b" * 64), True),  # another definition was approved
    (command(), l2(status="approved", approved_by="operator:alice"), True),  # never applied
    (command(), l2(status="rolled_back"), True),  # applied, then undone
    (command(), l2(gate_class="L3"), True),  # applied under a grant, not by an operator
    (command(), l2(approved_by=None), True),
], ids=["applied at L2", "revoke", "no proposal", "unknown proposal", "other hash",
        "not applied", "rolled back", "not L2", "no approval"])
def test_trust_on_first_use_is_granted_only_after_an_approved_l2_apply(cmd, record, refused):
    problem = tofu_problem(cmd, record)
    assert (problem is not None) is refused
    if problem is not None:
        assert problem.code == "not_applied_at_l2"
