"""Triage (DESIGN §2, §5.1): every cause, the fixed order of the checks, the class gate, and
when a proposal needs (re-)triage."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from improved.core import gradient, guards, learnback, propose, triage
from improved.core.authority import REVIEWABLE_CAUSES, is_waiting
from improved.core.gradient import CLASSES
from improved.core.guards import DEFAULT_FORBIDDEN
from improved.core.policy import Policy
from improved.core.record import ProposalRecord
from improved.protocol.model import Proposal, Signal, TriageDecision
from tests.builders import NOW, ORIGIN_ACTOR, SKILL, TRIAGER, committed, make_proposal

POLICY = Policy(doc_allowlist=("**",))
def make_record(policy: Policy = POLICY, now: int = NOW, **overrides) -> ProposalRecord:
    proposal = make_proposal(**overrides)
    pid, dedup = propose.identify(proposal)
    record, draft = propose.register(proposal, pid, dedup, policy, now)
    assert record.status == "pending" and draft.to_stage == "propose"
    return record


def signal(actor: str, positive: bool = True, kind: str = "check", service: str = "svc",
           at: int = NOW - 1_000) -> Signal:
    return Signal(kind=kind, actor=actor, service=service, positive=positive, at=at)


def decide(record: ProposalRecord, grant: bool = False, policy: Policy = POLICY,
           now: int = NOW):
    return triage.decide(record, policy, now, grant, TRIAGER)


# -- each cause, in the fixed order ------------------------------------------------------------


def test_forbidden_wins_over_class_scope_and_expiry():
    record = make_record(target_ref="code:src/lib.rs", change_class="L0", scope="knowledge",
                         target_files=["x/../_spec/2026-04-20-00-constitution.md"],
                         valid_to=NOW - 1, signals=[signal("mcp:aaa:7")])
    d = decide(record)
    assert (d.verdict, d.cause) == ("reject", "forbidden_target")
    assert "_spec/2026-04-20-00-constitution.md" in d.rationale


@pytest.mark.parametrize("cls", CLASSES)
def test_forbidden_target_whatever_the_class(cls):
    record = make_record(target_ref="doc:$COSMIX/_spec/CHANGELOG.md", change_class=cls,
                         scope="charter")
    assert decide(record, grant=True).cause == "forbidden_target"


def test_forbidden_via_the_target_ref_alone():
    record = make_record(target_ref="doc:a/../_doc/2026-04-20-declaration.md",
                         scope="charter", change_class="L4")
    assert decide(record).cause == "forbidden_target"


def test_escaping_target_file_is_forbidden():
    record = make_record(target_ref="cache:x", change_class="L0", target_files=["../../x"])
    assert decide(record).cause == "forbidden_target"


def test_class_mismatch_before_scope_mismatch():
    record = make_record(target_ref="code:src/lib.rs", change_class="L2", scope="knowledge")
    d = decide(record)
    assert (d.verdict, d.cause) == ("reject", "class_mismatch")
    assert "L4" in d.rationale


def test_l3_on_a_non_skill_target_is_class_mismatch():
    d = decide(make_record(target_ref="config:a.b", change_class="L3", scope="operation"),
               grant=True)
    assert (d.verdict, d.cause) == ("reject", "class_mismatch")


def test_class_mismatch_is_never_downgraded():
    d = decide(make_record(target_ref="binary:cosmix-foo", change_class="L2", scope="operation"))
    assert d.cause == "class_mismatch"
    assert d.gate_class == "L2"


def test_a_typo_in_the_scheme_is_named_as_the_scheme_not_the_class():
    d = decide(make_record(target_ref="rnk:search.title_boost", change_class="L0"))
    assert (d.verdict, d.cause) == ("reject", "class_mismatch")
    assert d.rationale == ("the target scheme rnk: is not one SPEC 09 lists (did you mean "
                           "rank:?); an unlisted scheme needs at least L2: fix the scheme, or "
                           "propose at L2")
    assert "is below the minimum L4 for binary:" in decide(make_record(
        target_ref="binary:cosmix-foo", change_class="L2", scope="operation")).rationale


@pytest.mark.parametrize(
    ("target_ref", "scope"),
    [("config:a.b", "knowledge"), ("skill:greet", "operation"), ("skill:greet", "charter"),
     ("grain:x", "code"), ("code:src/lib.rs", "operation")],
)
def test_scope_mismatch(target_ref, scope):
    cls = "L4" if target_ref.startswith("code:") else "L2"
    d = decide(make_record(target_ref=target_ref, scope=scope, change_class=cls,
                           valid_to=NOW - 1))
    assert (d.verdict, d.cause) == ("reject", "scope_mismatch")


def test_doc_targets_must_be_on_the_allowlist():
    narrow = Policy(doc_allowlist=("docs/**",))
    listed = make_record(target_ref="doc:docs/guide.md", change_class="L2", policy=narrow)
    assert decide(listed, policy=narrow).cause == "awaiting_operator"
    other = make_record(target_ref="doc:notes/guide.md", change_class="L2", policy=narrow)
    d = decide(other, policy=narrow)
    assert (d.verdict, d.cause) == ("reject", "invalid") and "allowlist" in d.rationale
    sneaky = make_record(target_ref="doc:docs/../notes/guide.md", change_class="L2",
                         policy=narrow)
    assert decide(sneaky, policy=narrow).cause == "invalid"
    # the default lists the documentation: docs/** and *.md at any depth, nothing else
    assert decide(listed, policy=Policy()).cause == "awaiting_operator"
    readme = make_record(target_ref="doc:service/README.md", change_class="L2")
    assert decide(readme, policy=Policy()).cause == "awaiting_operator"
    code = make_record(target_ref="doc:src/main.py", change_class="L2")
    assert decide(code, policy=Policy()).cause == "invalid"
    forbidden = make_record(target_ref="doc:_spec/CHANGELOG.md", change_class="L2")
    assert decide(forbidden, policy=Policy()).cause == "forbidden_target"  # checked first


def test_a_charter_proposal_below_l4_is_refused_as_malformed():
    d = decide(make_record(target_ref="doc:_doc/charter.md", scope="charter", change_class="L2"))
    assert (d.verdict, d.cause) == ("reject", "invalid") and "L4" in d.rationale


@pytest.mark.parametrize("valid_to", [NOW, NOW - 1, 0])
def test_expired(valid_to):
    record = make_record(valid_to=valid_to, signals=[signal("mcp:aaa:7")])
    d = decide(record)
    assert (d.verdict, d.cause) == ("reject", "expired")


def test_not_yet_expired():
    assert decide(make_record(valid_to=NOW + 1)).cause == "awaiting_operator"


def test_feedback_collapse_defers():
    record = make_record(signals=[signal("mcp:aaa:7")])
    assert record.positives == 1 and record.independent_positives == 0
    d = decide(record)
    assert (d.verdict, d.cause) == ("defer", "feedback_collapse")


def test_feedback_collapse_before_gate_even_with_a_grant():
    record = make_record(change_class="L3", signals=[signal(ORIGIN_ACTOR, kind="refine")])
    assert decide(record, grant=True).cause == "feedback_collapse"


def test_independent_negative_does_not_lift_feedback_collapse():
    record = make_record(signals=[signal("mcp:aaa:7"), signal("mcp:bbb:1", positive=False)])
    assert decide(record).cause == "feedback_collapse"


def test_no_positive_evidence_is_not_collapse():
    record = make_record(signals=[signal("mcp:aaa:7", positive=False)])
    assert decide(record).cause == "awaiting_operator"


def test_self_claimed_world_signal_from_another_session_before_apply_is_not_independent():
    # a world signal counts only after apply, so before apply it cannot confirm anything
    record = make_record(signals=[signal("mcp:zzz:1", kind="world", service="other")])
    assert decide(record).cause == "feedback_collapse"


def test_signals_inside_a_proposal_are_its_proposers_own():
    """Whatever actor the proposer writes into its own signals, they never confirm it."""
    record = make_record(signals=[signal("mcp:aaa:7"), signal("mcp:bbb:2"),
                                  signal("operator:alice"), signal("check:ci")])
    assert decide(record).cause == "feedback_collapse"


# -- the class gate ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "target_ref", "scope", "grant", "verdict", "cause", "gate_class"),
    [
        ("L0", "cache:search", "knowledge", False, "accept", None, "L0"),
        ("L0", "rank:search/top", "knowledge", False, "accept", None, "L0"),
        ("L1", "code:src/lib.rs", "code", False, "accept", None, "L1"),
        ("L1", "skill:greet", "knowledge", True, "accept", None, "L1"),
        ("L2", "skill:greet", "knowledge", False, "defer", "awaiting_operator", "L2"),
        ("L2", "grain:x", "knowledge", False, "defer", "awaiting_operator", "L2"),
        ("L4", "code:src/lib.rs", "code", False, "defer", "awaiting_operator", "L4"),
        ("L4", "skill:greet", "knowledge", True, "defer", "awaiting_operator", "L4"),
        ("L3", "skill:greet", "knowledge", True, "accept", None, "L3"),
        ("L3", "skill:greet", "knowledge", False, "defer", "no_grant", "L2"),
    ],
)
def test_gate(cls, target_ref, scope, grant, verdict, cause, gate_class):
    record = make_record(change_class=cls, target_ref=target_ref, scope=scope)
    d = decide(record, grant=grant)
    assert (d.verdict, d.cause, d.gate_class) == (verdict, cause, gate_class)
    assert (d.proposal_id, d.service, d.actor, d.at) == (record.proposal_id, "svc", TRIAGER, NOW)


def test_l4_rationale_says_per_occurrence():
    d = decide(make_record(change_class="L4", target_ref="code:src/lib.rs", scope="code"))
    assert "per occurrence" in d.rationale


def test_a_policy_adds_to_the_floors_and_never_removes_from_them():
    loose = Policy(min_class={"grain": "L0", "binary": "L0"}, fallback_min_class="L0",
                   forbidden_targets=("src/crates/cosmix-mcp/**",), doc_allowlist=("**",))
    # a lower minimum in a Policy built in code lowers nothing
    for ref_, cls in (("grain:x", "L0"), ("binary:art", "L0"), ("query:q", "L0")):
        record = make_record(policy=loose, change_class=cls, target_ref=ref_,
                             scope=gradient.implied_scope(gradient.scheme_of(ref_)))
        assert decide(record, policy=loose).cause == "class_mismatch", ref_
    # a forbidden list naming one pattern still forbids the constitution's other paths
    record = make_record(target_ref="doc:_spec/CHANGELOG.md", scope="knowledge")
    assert decide(record, policy=loose).cause == "forbidden_target"
    assert decide(record, policy=Policy(forbidden_targets=(), doc_allowlist=("**",))).cause \
        == "forbidden_target"
    # what a policy adds is forbidden too, and a raised minimum holds
    strict = Policy(forbidden_targets=("docs/private/**",), min_class={"rank": "L2"},
                    doc_allowlist=("**",))
    record = make_record(target_ref="doc:docs/private/a.md", scope="knowledge")
    assert decide(record, policy=strict).cause == "forbidden_target"
    assert decide(record).cause == "awaiting_operator"
    record = make_record(change_class="L0", target_ref="rank:x", scope="knowledge")
    assert decide(record, policy=strict).cause == "class_mismatch"
    assert decide(record).verdict == "accept"


def test_transition_records_decision_and_gate_class():
    record = make_record(change_class="L3")
    d = decide(record, grant=False)
    draft = triage.transition(record, d)
    new = committed(record, draft, d.at)
    assert new.decision == d
    assert new.gate_class == "L2"
    assert new.updated_at == NOW
    assert (draft.to_stage, draft.verdict, draft.cause) == ("triage", "defer", "no_grant")
    assert draft.from_stage == record.stage
    assert record.decision is None  # the input record is untouched


# -- needs_triage ------------------------------------------------------------------------------


def transitioned(record, d):
    """The record after the decision `d` was committed at its own time."""
    return committed(record, triage.transition(record, d), d.at)


def test_needs_triage_new_then_decided():
    record = make_record()
    assert triage.needs_triage(record)
    record = transitioned(record, decide(record))
    assert record.decision.cause == "awaiting_operator"
    assert not triage.needs_triage(record)


@pytest.mark.parametrize("kwargs", [
    dict(change_class="L0", target_ref="cache:x"),
    dict(change_class="L2", target_ref="code:x.rs"),
    dict(change_class="L3"),
])
def test_no_retriage_after_other_decisions(kwargs):
    record = make_record(**kwargs)
    record = transitioned(record, decide(record))
    assert not triage.needs_triage(record)


def test_feedback_collapse_retriaged_once_independently_confirmed():
    record = make_record(signals=[signal("mcp:aaa:7")])
    record = transitioned(record, decide(record))
    assert record.decision.cause == "feedback_collapse"
    assert not triage.needs_triage(record)

    # more self-confirmation changes nothing
    draft, counted = learnback.observe_signal(record, signal("mcp:bbb:9", at=NOW + 1),
                                              POLICY, NOW + 1, "service:svc")
    record = committed(record, draft, NOW + 1)
    assert not counted.independent and draft.to_stage == "learn-back"
    assert not triage.needs_triage(record)

    # an independent negative is not a confirmation
    draft, counted = learnback.observe_signal(
        record, signal("mcp:bbb:1", positive=False, at=NOW + 2), POLICY, NOW + 2, "check:ci")
    record = committed(record, draft, NOW + 2)
    assert counted.independent
    assert not triage.needs_triage(record)

    # a redelivered signal is not counted twice
    again = signal("mcp:bbb:9", at=NOW + 1)
    assert learnback.observe_signal(record, again, POLICY, NOW + 3) is None

    # an independent positive re-opens triage, which now reaches the gate
    draft, counted = learnback.observe_signal(
        record, signal("mcp:bbb:1", at=NOW + 4), POLICY, NOW + 4, "agent:other:b")
    record = committed(record, draft, NOW + 4)
    assert counted.independent
    assert triage.needs_triage(record)
    d = decide(record, now=NOW + 5)
    assert (d.verdict, d.cause) == ("defer", "awaiting_operator")
    record = transitioned(record, d)
    assert not triage.needs_triage(record)


# -- the order, as a property ------------------------------------------------------------------

SCHEMES = ("cache", "rank", "skill", "doc", "config", "code", "binary", "grain", "query")
RESTS = ("notes/a.md", "_spec/CHANGELOG.md", "x/../_spec/2026-04-20-00-constitution.md",
         "src/crates/cosmix-mcp/lib.rs", "../escape", "greet")
FILES = ("_doc/notes.md", "src/lib.rs", "~/.config/cosmix/harness.toml", "a/../../b",
         "/etc/systemd/system/cosmix-x.timer")
SIGNAL_SPEC = st.tuples(
    st.booleans(),                                           # from the origin's session?
    st.booleans(),                                           # positive?
    st.sampled_from(("refine", "check", "world", "metric")),
)


def expected_cause(p: Proposal, grant: bool, now: int) -> tuple[str, str | None]:
    scheme = gradient.scheme_of(p.target_ref)
    paths = guards.touched_paths(p)
    if guards.uncanonical(paths) is not None:
        return "reject", "invalid"
    if guards.forbidden_match(paths, DEFAULT_FORBIDDEN) is not None:
        return "reject", "forbidden_target"
    if not gradient.class_fits(p.change_class, scheme):
        return "reject", "class_mismatch"
    if not gradient.scope_fits(p.scope, scheme):
        return "reject", "scope_mismatch"
    if p.scope == "charter":  # a constitution edit needs L4, `amends`, a CHANGELOG entry
        return "reject", "invalid"
    if p.valid_to is not None and p.valid_to <= now:
        return "reject", "expired"
    # signals inside a proposal are its proposer's own: never independent
    if any(s.positive for s in p.signals or ()):
        return "defer", "feedback_collapse"
    if p.change_class in ("L0", "L1"):
        return "accept", None
    if p.change_class == "L3":  # a grant covers the definition it hashes, at skill:<name>
        covered = grant and triage.grant_scope_problem(p) is None
        return ("accept", None) if covered else ("defer", "no_grant")
    return "defer", "awaiting_operator"


@settings(max_examples=400, deadline=None)
@given(
    cls=st.sampled_from(CLASSES),
    scheme=st.sampled_from(SCHEMES),
    rest=st.sampled_from(RESTS),
    files=st.none() | st.lists(st.sampled_from(FILES), max_size=2),
    scope=st.sampled_from(("knowledge", "code", "operation", "charter")),
    valid_to=st.none() | st.integers(min_value=-2, max_value=2).map(lambda d: NOW + d),
    signals=st.lists(SIGNAL_SPEC, max_size=4),
    grant=st.booleans(),
)
# a grant covers only the definition it hashes, targeted at skill:<its name>
@example(cls="L3", scheme="skill", rest="notes/a.md", files=None, scope="knowledge",
         valid_to=None, signals=[], grant=True)
def test_cause_is_the_first_failing_check(cls, scheme, rest, files, scope, valid_to, signals,
                                          grant):
    sigs = [signal(f"mcp:aaa:{i + 2}" if own else f"mcp:s{i}:1", positive=pos, kind=kind,
                   service="svc" if own else "other")
            for i, (own, pos, kind) in enumerate(signals)]
    record = make_record(change_class=cls, target_ref=f"{scheme}:{rest}", scope=scope,
                         target_files=files, valid_to=valid_to, signals=sigs or None)
    d = decide(record, grant=grant)
    assert (d.verdict, d.cause) == expected_cause(record.proposal, grant, NOW)
    expected_gate = "L2" if d.cause == "no_grant" else cls
    assert d.gate_class == expected_gate


# -- waiting for an operator: one definition (the review queue, the approval check, the gauge)


@pytest.mark.parametrize(("status", "verdict", "cause", "superseded", "waits"), [
    ("pending", "defer", "awaiting_operator", False, True),
    ("pending", "defer", "no_grant", False, True),
    ("pending", "defer", "awaiting_quorum", False, True),
    ("pending", "defer", "quorum_dissent", False, True),
    ("pending", "defer", "feedback_collapse", False, False),  # released by a signal, not a review
    ("pending", "defer", "circuit_open", False, False),
    ("pending", "accept", None, False, False),  # surfaced L1 or approved: nothing to decide
    ("pending", "defer", "awaiting_operator", True, False),  # superseded by new content
    ("rejected", "defer", "awaiting_operator", False, False),
])
def test_is_waiting_is_the_one_definition(status, verdict, cause, superseded, waits):
    record = make_record()
    d = TriageDecision(proposal_id=record.proposal_id, service=record.service, verdict=verdict,
                       cause=cause, gate_class="L2", rationale="", actor="t", at=1)
    record = record.replace(status=status, decision=d,
                            superseded_by="f" * 64 if superseded else None)
    assert is_waiting(record) is waits
    assert (cause in REVIEWABLE_CAUSES and status == "pending" and verdict == "defer"
            and not superseded) is waits
    assert is_waiting(None) is False


# -- a grant covers exactly what it names (SPEC 09 §4) ------------------------------------------


@pytest.mark.parametrize(("overrides", "why"), [
    ({"proposal_data": {"skill": {**SKILL, "entrypoint": "curl x | sh"}}}, "outside its hashed"),
    ({"proposal_data": {"skill": SKILL, "run": "now"}}, "more than the skill"),
    ({"target_ref": "skill:deploy-prod"}, "not the skill the definition names"),
])
def test_a_grant_covers_the_hashed_definition_and_nothing_beside_it(overrides, why):
    record = make_record(change_class="L3", **overrides)
    d = decide(record, grant=True)
    assert (d.verdict, d.cause, d.gate_class) == ("defer", "no_grant", "L2")
    assert why in d.rationale
    plain = decide(make_record(change_class="L3"), grant=True)
    assert (plain.verdict, plain.gate_class) == ("accept", "L3")


# -- supersession that cannot be squatted or back-dated ------------------------------------------


def test_a_proposal_dated_beyond_the_clock_skew_is_rejected_invalid():
    record = make_record(created_at=NOW + propose.FUTURE_SKEW_MS + 1)
    d = decide(record)
    assert (d.verdict, d.cause) == ("reject", "invalid") and "in the future" in d.rationale
    assert decide(make_record(created_at=NOW + propose.FUTURE_SKEW_MS)).cause != "invalid"


@pytest.mark.parametrize(("status", "superseded_by", "stands"), [
    ("pending", None, True), ("approved", None, True), ("applied", None, True),
    ("rejected", None, False), ("expired", None, False), ("pending", "f" * 64, False),
])
def test_only_standing_content_supersedes(status, superseded_by, stands):
    head = make_record().replace(status=status, superseded_by=superseded_by)
    assert propose.supersedes(head) is stands
    assert propose.supersedes(None) is False


def _registered(created_at: int, **over) -> ProposalRecord:
    p = make_proposal(created_at=created_at, **over)
    pid, dedup = propose.identify(p)
    return propose.register(p, pid, dedup, POLICY, NOW)[0]


@given(a=st.integers(0, 10**12), b=st.integers(0, 10**12),
       status=st.sampled_from(["pending", "approved", "applied", "rejected", "expired"]))
def test_which_of_two_contents_under_one_key_supersedes_the_other(a, b, status):
    """By the chains' own records: exactly one of two different contents under one dedup_key
    is the older (`older_under_key`), and the newer stands over it while it still stands."""
    head = _registered(a).replace(status=status)
    mine = _registered(b)
    if head.proposal_id == mine.proposal_id:
        return
    dedup = mine.dedup_key
    assert head.dedup_key == dedup
    older = propose.older_under_key(head, mine.proposal, mine.proposal_id, dedup)
    stands = propose.stands_over(head, mine.proposal, mine.proposal_id, dedup)
    assert older is not ((a, head.proposal_id) > (b, mine.proposal_id))
    assert stands is (not older and propose.supersedes(head))


def test_a_head_of_another_key_neither_stands_over_nor_is_older():
    """The bucket is a cache anyone could write: a head it names that the chain files under
    another dedup_key decides nothing, however old or new it claims to be."""
    other = _registered(NOW - 10**6, target_ref="skill:other")
    mine = _registered(NOW)
    assert other.dedup_key != mine.dedup_key
    newer = msgspec.structs.replace(other.proposal, created_at=NOW + 10**6)
    for head in (other, other.replace(proposal=newer)):
        assert not propose.older_under_key(head, mine.proposal, mine.proposal_id,
                                           mine.dedup_key)
        assert not propose.stands_over(head, mine.proposal, mine.proposal_id, mine.dedup_key)
    assert not propose.stands_over(None, mine.proposal, mine.proposal_id, mine.dedup_key)
