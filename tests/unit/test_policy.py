"""Invariants are floors (DESIGN §9), as pure decisions: what a policy may not loosen, which
constitution edit permits the L4 quorum, and how the policy in force is described on its
chain (digest, and what differs from the defaults)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.core import audit, gradient, propose
from improved.core import policy as P
from improved.core.guards import DEFAULT_FORBIDDEN
from improved.core.policy import Policy
from improved.core.record import ChainHead, ProposalRecord
from improved.core.trailers import refs_of
from improved.protocol.model import ProposalEdit, Summary
from tests.builders import CHANGELOG_DIFF, CONSTITUTION, NOW, make_proposal

# -- loosening ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "where"), [
    (Policy(min_class={"binary": "L0"}), ("min_class", "binary")),
    (Policy(min_class={"rank": "L0", "skill": "L1"}), ("min_class", "skill")),
    (Policy(min_class={"unheard-of": "L1"}), ("min_class", "unheard-of")),
    (Policy(fallback_min_class="L1"), ("fallback_min_class",)),
    (Policy(quorum=True), ("quorum",)),
])
def test_each_loosening_is_named(policy, where):
    found = P.loosening(policy)
    assert found is not None and found[0] == where


def test_defaults_and_tightenings_are_no_loosening():
    assert P.loosening(Policy()) is None
    assert P.loosening(Policy(min_class={"rank": "L4", "grain": "L2"}, fallback_min_class="L4",
                              forbidden_targets=())) is None
    assert P.loosening(Policy(quorum=True, quorum_amendment="c" * 64)) is None


@settings(max_examples=300)
@given(st.dictionaries(st.sampled_from(["rank", "code", "binary", "skill", "grain", "x"]),
                       st.sampled_from(gradient.CLASSES), max_size=4),
       st.sampled_from(gradient.CLASSES))
def test_a_policy_passes_exactly_when_nothing_is_below_its_floor(min_class, fallback):
    policy = Policy(min_class=min_class, fallback_min_class=fallback)
    lowered = any(gradient.RANK[c] < gradient.RANK[gradient.floor(s)]
                  for s, c in min_class.items()) or gradient.RANK[fallback] < 2
    assert (P.loosening(policy) is not None) == lowered


def test_the_forbidden_list_in_force_always_holds_the_constitutions():
    assert Policy().forbidden == DEFAULT_FORBIDDEN
    assert Policy(forbidden_targets=(DEFAULT_FORBIDDEN[0],)).forbidden == DEFAULT_FORBIDDEN
    assert Policy(forbidden_targets=("a/**", "a/**", "src/Cargo.toml")).forbidden == (
        *DEFAULT_FORBIDDEN, "a/**")


# -- the amendment that permits the quorum ------------------------------------------------------


def charter(amends: str | None = "VII: IV.2 L4 may pass on a signed quorum (SPEC 09 §6)",
            **overrides) -> ProposalRecord:
    """A constitution edit, as test_l4_e2e proposes one, registered and pending."""
    fields = dict(target_ref=f"doc:{CONSTITUTION}", change_class="L4", scope="charter",
                  amends=amends, summary=Summary(template_id="amend", args={}),
                  proposal_data=None,
                  proposal_edit=ProposalEdit(format="unified", base_digest="sha256:" + "5" * 64,
                                             diff=CHANGELOG_DIFF))
    fields.update(overrides)
    proposal = make_proposal(**fields)
    pid, dedup = propose.identify(proposal)
    record, _ = propose.register(proposal, pid, dedup, Policy(), NOW)
    return record


def approved(record: ProposalRecord) -> ProposalRecord:
    return record.replace(status="approved", approved_by="operator:alice")


def test_an_approved_charter_proposal_that_names_the_quorum_permits_it():
    record = approved(charter())
    assert P.amendment_problem(record.proposal_id, record) is None


@pytest.mark.parametrize(("record", "says"), [
    (None, "has no audit chain"),
    (charter(), "is pending, not approved"),
    (charter().replace(status="rejected"), "is rejected, not approved"),
    (charter().replace(status="approved"), "not approved"),  # no approving principal
    (approved(charter(amends="VII: IV.2 tiers")), "which does not name the quorum"),
    (approved(charter(amends=None, scope="knowledge")), "is not a constitution edit"),
    (approved(charter(change_class="L2", scope="charter")), "is not a constitution edit"),
])
def test_anything_else_does_not(record, says):
    problem = P.amendment_problem("f" * 64, record)
    assert problem is not None and says in problem
    assert "\n" not in problem


# -- the policy in force, on its chain ----------------------------------------------------------


def test_the_effective_policy_is_one_normal_form():
    same = [Policy(), Policy(forbidden_targets=DEFAULT_FORBIDDEN[:2]),
            Policy(min_class={"grain": "L2", "rank": "L0", "code": "L4"}),
            Policy(min_class={"binary": "L0"}, fallback_min_class="L0")]  # built in code: floored
    assert {P.digest(p) for p in same} == {P.digest(Policy())}
    assert all(P.differences(p) == {} for p in same)
    raised = Policy(min_class={"rank": "L2"}, forbidden_targets=("deploy/**",), quorum=True,
                    quorum_amendment="d" * 64, autonomy="off")
    assert P.digest(raised) != P.digest(Policy())
    assert P.differences(raised) == {"min_class": {"rank": "L2"},
                                     "forbidden_targets": ("deploy/**",), "quorum": True,
                                     "quorum_amendment": "d" * 64, "autonomy": "off"}


def test_the_draft_carries_the_digest_and_each_difference():
    policy = Policy(min_class={"rank": "L2"}, forbidden_targets=("deploy/**",))
    draft = P.draft(policy, "improved:test")
    assert draft.verdict == "policy" and draft.observer_type == "rec:system"
    trailer = audit.seal_next(draft, P.POLICY_ID, ChainHead(), "L0", "operation", NOW)
    refs = refs_of(trailer)
    assert refs["digest"] == P.digest(policy)
    assert msgspec.json.decode(refs["min_class"]) == {"rank": "L2"}
    assert msgspec.json.decode(refs["forbidden_targets"]) == ["deploy/**"]
    assert set(refs) == {"digest", "min_class", "forbidden_targets"}
    assert "min_class" in draft.reason and "forbidden_targets" in draft.reason
    body = msgspec.to_builtins(trailer)
    assert P.recorded_digest(body) == P.digest(policy)
    assert P.recorded_digest(None) is None
    assert "the defaults" in P.draft(Policy(), "improved:test").reason
