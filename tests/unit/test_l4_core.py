"""The pure core of L4 safety and the quorum (SPEC 09 §6–§8): what an L4 proposal must carry,
constitution edits that are prepared and never applied, the reversal generated before apply,
and which votes add up."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.core import apply, lkg, propose, quorum, signing, triage
from improved.core.authority import Act
from improved.core.policy import Policy
from improved.core.record import replay
from improved.protocol.model import AnalyzerRef, Origin, Proposal, ProposalEdit, Summary, Vote
from tests.builders import (
    CHANGELOG_DIFF,
    CONSTITUTION,
    DIGEST_A,
    NOW,
    QUORUM_POLICY,
    TRIAGER,
    committed,
    l4,
    report,
)
from tests.keys import TRUST, VOTERS

POLICY = Policy(doc_allowlist=("docs/**",))
def charter(**overrides) -> Proposal:
    fields = dict(
        service="docs", target_ref=f"doc:{CONSTITUTION}", change_class="L4", scope="charter",
        origin=Origin(actor="operator:alice", service="docs"),
        analyzer=AnalyzerRef(id="pub.amend/1"), summary=Summary(template_id="amend", args={}),
        created_at=NOW - 1000, amends="VII.1: IV.2",
        proposal_edit=ProposalEdit(format="unified", base_digest="sha256:" + "0" * 64,
                                   diff=CHANGELOG_DIFF),
        target_files=[CONSTITUTION, "_spec/CHANGELOG.md"],
    )
    fields.update(overrides)
    return Proposal(**fields)


def registered(p: Proposal, policy: Policy = POLICY):
    pid, dedup = propose.identify(p)
    return propose.register(p, pid, dedup, policy, NOW)[0]


def decide(record, policy: Policy = POLICY):
    return triage.decide(record, policy, NOW, False, TRIAGER)


# -- what L4 must carry ------------------------------------------------------------------------


def test_a_well_formed_l4_waits_for_an_operator_per_occurrence():
    d = decide(registered(l4()))
    assert (d.verdict, d.cause) == ("defer", "awaiting_operator") and "per occurrence" in d.rationale


@pytest.mark.parametrize("lkg_value, why", [
    (None, "every artefact"),
    ([], "every artefact"),
    ([{"artefact": "a", "digest": "md5:1", "smoke_test": "x"}], "lkg"),
    ([{"artefact": "a", "digest": DIGEST_A}], "smoke_test"),
    ([{"artefact": "a", "digest": DIGEST_A, "smoke_test": "x"}] * 2, "twice"),
])
def test_an_l4_without_a_complete_lkg_list_is_rejected_invalid(lkg_value, why):
    d = decide(registered(l4(lkg=lkg_value)))
    assert (d.verdict, d.cause) == ("reject", "invalid") and why in d.rationale


def test_with_quorum_on_l4_awaits_the_quorum():
    d = decide(registered(l4(), QUORUM_POLICY), QUORUM_POLICY)
    assert (d.verdict, d.cause) == ("defer", "awaiting_quorum")


# -- constitution edits (SPEC 09 §8) -----------------------------------------------------------


def test_a_constitution_edit_is_prepared_for_an_operator_and_never_applied():
    record = registered(charter())
    d = decide(record)
    assert (d.verdict, d.cause) == ("defer", "awaiting_operator")
    assert "never applies" in d.rationale
    approved = record.replace(decision=d.__class__(**{**msgspec.structs.asdict(d),
                                                      "verdict": "accept", "cause": None}),
                              status="approved", approved_by="operator:alice")
    assert not apply.needs_apply(approved)  # an operator commits it by hand


@pytest.mark.parametrize("overrides, why", [
    ({"amends": None, "scope": "charter"}, "amends"),
    ({"change_class": "L2"}, "L4"),
    ({"proposal_edit": ProposalEdit(format="unified", base_digest="x",
                                    diff=f"+++ b/{CONSTITUTION}\n+version: 6\n")}, "CHANGELOG"),
])
def test_a_constitution_edit_needs_amends_l4_and_a_changelog_entry(overrides, why):
    d = decide(registered(charter(**overrides)))
    assert d.verdict == "reject" and d.cause in ("invalid", "forbidden_target")
    if d.cause == "invalid":
        assert why in d.rationale


def test_a_malformed_constitution_edit_hits_the_forbidden_list():
    d = decide(registered(charter(amends=None)))
    assert (d.verdict, d.cause) == ("reject", "forbidden_target")


def test_a_constitution_edit_cannot_smuggle_other_forbidden_files():
    d = decide(registered(charter(target_files=[CONSTITUTION, "src/Cargo.toml"])))
    assert (d.verdict, d.cause) == ("reject", "forbidden_target")


def test_a_knowledge_edit_of_the_constitution_stays_forbidden():
    p = charter(scope="knowledge", amends=None, change_class="L2")
    assert decide(registered(p)).cause == "forbidden_target"


@given(st.lists(st.text(max_size=30), max_size=6))
@settings(max_examples=200)
def test_changelog_detection_needs_an_added_line_under_a_changelog_header(lines):
    diff = "\n".join(lines)
    expected = False
    inside = False
    for line in diff.splitlines():
        if line.startswith("+++ "):
            inside = line.split()[-1].endswith("CHANGELOG.md") if len(line.split()) > 1 else False
        elif line.startswith(("--- ", "diff ")):
            continue
        elif inside and line.startswith("+") and line[1:].strip():
            expected = True
            break
    assert lkg.changelog_entry(diff) == expected


# -- the reversal, generated before apply ---------------------------------------------------------


def approved(p: Proposal):
    record = registered(p)
    return record.replace(status="approved", approved_by="operator:alice")


def test_an_unhealthy_last_known_good_refuses_the_apply_before_any_order():
    record = approved(l4())
    assert lkg.needs_check(record)
    why = lkg.report_problem(record, report(rc_b=1))
    assert why is not None and "b (rc 1)" in why
    after = committed(record, lkg.refused(record, why, "operator:alice"))
    assert after.outcome.ok is False and after.outcome.error.startswith("lkg:")
    assert not apply.needs_apply(after) and not lkg.needs_check(after)


def test_a_report_silent_about_an_artefact_is_not_healthy():
    rep = lkg.LkgReport(ok=True, artefacts=report().artefacts[:1])
    assert "b" in lkg.report_problem(approved(l4()), rep)


def test_the_reversal_restores_every_artefact_and_is_recorded_before_apply():
    record = approved(l4())
    rev = lkg.reversal(record, report())
    assert rev.proposal_data == {"restore": {"a": "sha256:" + "1" * 64,
                                             "b": "sha256:" + "2" * 64}}
    assert lkg.reverts(rev) == record.proposal_id and not lkg.needs_lkg(rev)
    rev_id, _ = propose.identify(rev)
    draft = lkg.verified(record, report(), rev, rev_id, TRIAGER)
    after = committed(record, draft)
    assert after.revert_id == rev_id and not lkg.needs_check(after)
    assert apply.needs_apply(after)
    # the chain alone rebuilds it (the reversal travels in the trailer)
    from improved.core import audit

    trailer = audit.seal(draft, record, NOW)
    rebuilt = replay(record.replace(revert=None, revert_id=None), [trailer], [7])
    assert rebuilt.revert == rev and rebuilt.revert_id == rev_id


def test_the_proposers_own_revert_body_is_used_when_given():
    record = approved(l4(revert={"restore": {"a": "sha256:" + "9" * 64}}))
    assert lkg.reversal(record, report()).proposal_data == {"restore": {"a": "sha256:" + "9" * 64}}


def test_the_reversal_inherits_the_approval_only_of_its_applied_original():
    original = approved(l4())
    rev = lkg.reversal(original, report())
    rev_id, _ = propose.identify(rev)
    original = committed(original, lkg.verified(original, report(), rev, rev_id, TRIAGER))
    reversal = registered(rev)
    assert lkg.inherit(reversal, original) is None  # not applied yet
    applied = original.replace(status="applied")
    draft = lkg.inherit(reversal, applied)
    new = committed(reversal, draft)
    assert new.approved_by == "operator:alice" and draft.verdict == "inherit"
    other = registered(l4(created_at=NOW - 5))  # a look-alike that was not recorded
    assert lkg.inherit(other.replace(proposal=rev), applied.replace(revert_id="0" * 64)) is None


def test_an_inherited_reversal_records_its_own_reversal_back_to_what_the_original_installed():
    """SPEC 09 §7.3: every applied L4 emits its revert_proposal_id, a reversal too. The
    reversal's own way back is generated and validated when it inherits, before it runs, and
    the applied reversal names it; it in turn inherits the same approval."""
    from improved.core import planner
    from improved.core.apply import transition
    from improved.core.boundary import Attested
    from improved.protocol.model import ApplyResult

    original = approved(l4())
    rev = lkg.reversal(original, report())
    rev_id, _ = propose.identify(rev)
    original = committed(original, lkg.verified(original, report(), rev, rev_id, TRIAGER))
    applied = original.replace(status="applied")
    step = planner.next_step(registered(rev), planner.View(now=NOW, original=applied), POLICY,
                             TRIAGER)
    assert isinstance(step, planner.Commit) and step.why == "inherit"
    reversal = committed(registered(rev), step.draft)
    assert reversal.approved_by == "operator:alice" and reversal.revert_id is not None
    back = reversal.revert
    assert propose.identify(back)[0] == reversal.revert_id
    assert lkg.reverts(back) == rev_id and back.change_class == "L4"
    assert back.proposal_data == {"restore": {"a": DIGEST_A, "b": l4().lkg[1]["digest"]}}
    assert f"revert_proposal_id:{reversal.revert_id}" in step.draft.refs
    answer = Attested(ApplyResult(ok=True, applied_id="m@2"), "service:deploy", "signature")
    done = committed(reversal, transition(reversal, answer, "operator:alice"))
    assert done.outcome.ok and done.outcome.revert_proposal_id == reversal.revert_id
    # and the reversal's reversal runs under the same approval, with a way back of its own
    step = planner.next_step(registered(back), planner.View(now=NOW, original=done.replace(
        status="applied")), POLICY, TRIAGER)
    again = committed(registered(back), step.draft)
    assert again.approved_by == "operator:alice"
    assert again.revert.proposal_data == {"restore": {"a": "sha256:" + "1" * 64,
                                                      "b": "sha256:" + "2" * 64}}


# -- the quorum ------------------------------------------------------------------------------------

def open_record():
    record = registered(l4(), QUORUM_POLICY)
    d = decide(record, QUORUM_POLICY)
    return record.replace(decision=d, gate_class=d.gate_class)


_SEQ = iter(range(1, 10**6))


def cast(record, voter: str, session: str, vote: str = "approve", read=None):
    v = Vote(proposal_id=record.proposal_id, vote=vote, voter=voter, session=session,
             read=read if read is not None else quorum.expected_reads(record), at=NOW)
    env = signing.sign(signing.PAYLOAD_TYPES["vote"], msgspec.json.encode(v), VOTERS[voter])
    verified = TRUST.verify(env, signing.PAYLOAD_TYPES["vote"])
    draft = quorum.count(record, Act(verified.digest, next(_SEQ)), verified, v,
                         env.signatures[0].sig, TRIAGER)
    new = committed(record, draft)
    step = quorum.decided(new, TRIAGER)
    if step is not None:
        new = committed(new, step)
    return new, draft


def test_two_votes_do_not_approve_three_non_correlated_do():
    r = open_record()
    r, _ = cast(r, "agent-a", "s1")
    r, _ = cast(r, "agent-b", "s2")
    assert r.approved_by is None and quorum.is_open(r)
    r, _ = cast(r, "agent-c", "s3")
    assert r.approved_by == quorum.authority_of(r) and r.decision.verdict == "accept"
    rec = quorum.quorum_record(r)
    assert rec.outcome == "approved" and rec.approvals == 3
    assert {v.voter for v in rec.votes} == {"agent-a", "agent-b", "agent-c"}
    assert all(v.sig for v in rec.votes)


def test_the_same_key_three_times_never_adds_up():
    r = open_record()
    codes = []
    for _ in range(3):
        r, draft = cast(r, "agent-a", f"s{len(codes)}")
        codes.append(draft.verdict)
    assert codes == ["vote", "refused", "refused"] and quorum.is_open(r)


@pytest.mark.parametrize("second_session, code", [
    ("s1", "correlated_session"),          # two keys of one session
    ("agentd:run-1", "proposer_session"),  # the proposer's own session
    ("agentd:run-1:9", "proposer_session"),
])
def test_correlated_votes_are_refused(second_session, code):
    r = open_record()
    r, _ = cast(r, "agent-a", "s1")
    r, draft = cast(r, "agent-b", second_session)
    assert draft.verdict == "refused" and f"({code})" in draft.reason
    assert len(r.ballots) == 1


def test_a_vote_that_did_not_read_everything_is_refused():
    r = open_record()
    r, draft = cast(r, "agent-a", "s1", read=quorum.expected_reads(r)[:2])
    assert draft.verdict == "refused" and "triage" in draft.reason and "spec" in draft.reason


@pytest.mark.parametrize("kind", ["diff", "triage", "spec", "proposal"])
def test_a_vote_naming_a_digest_of_something_else_is_refused_unread(kind):
    """`read` claims are digests of what is on the chain; free text, or a digest of another
    body or triage record, is not a read of this one."""
    r = open_record()
    reads = [f"{kind}:{'0' * 64}" if x.startswith(f"{kind}:") else x
             for x in quorum.expected_reads(r)]
    r, draft = cast(r, "agent-a", "s1", read=reads)
    assert draft.verdict == "refused" and "(unread)" in draft.reason and kind in draft.reason
    assert not r.ballots


@pytest.mark.parametrize("voter", ["agentd", "agent:deploy:x", "agent:agentd:y"])
def test_the_proposer_never_votes_whatever_its_session(voter):
    """The origin declares `agentd:run-1`: a voter of that name, or an agent of the proposing
    service, is the proposer, under any session spelling."""
    r = open_record()
    v = Vote(proposal_id=r.proposal_id, vote="approve", voter=voter, session="S-OTHER",
             read=quorum.expected_reads(r), at=NOW)
    key = VOTERS["agent-a"]
    env = signing.sign(signing.PAYLOAD_TYPES["vote"], msgspec.json.encode(v), key)
    verified = signing.Verified(b"", "ed25519:x", voter, signing.envelope_digest(env), env)
    draft = quorum.count(r, Act(verified.digest, next(_SEQ)), verified, v, "sig", TRIAGER)
    r2 = committed(r, draft)
    assert draft.verdict == "refused" and "(proposer)" in draft.reason
    assert not r2.ballots


def test_one_dissent_among_four_defers_to_the_operator():
    r = open_record()
    r, _ = cast(r, "agent-a", "s1")
    r, _ = cast(r, "agent-b", "s2", vote="dissent")
    assert (r.decision.verdict, r.decision.cause) == ("defer", "quorum_dissent")
    r, d3 = cast(r, "agent-c", "s3")
    r, d4 = cast(r, "agent-d", "s4")
    assert d3.verdict == d4.verdict == "refused"  # closed: the operator decides now
    assert r.approved_by is None
    assert quorum.quorum_record(r).outcome == "deferred"


def test_quorum_ballots_survive_a_rebuild_from_the_chain():
    from improved.core import audit

    r = open_record()
    start = r
    trailers = []
    for voter, session in (("agent-a", "s1"), ("agent-b", "s2"), ("agent-c", "s3")):
        before = r
        r, draft = cast(r, voter, session)
        trailers.append(audit.seal(draft, before, NOW))
    assert len(replay(start, trailers[:1], [1]).ballots) == 1
    rebuilt = replay(start, trailers, [1, 2, 3])
    assert [b.voter for b in rebuilt.ballots] == ["agent-a", "agent-b", "agent-c"]


# -- the operator approves what they saw ----------------------------------------------------------


def _approve(record, body_digest):
    from improved.core import authority
    from improved.protocol.model import Review
    from tests.keys import ALICE

    rv = Review(proposal_id=record.proposal_id, verdict="approve", principal=ALICE[0],
                reason="seen", at=NOW, body_digest=body_digest)
    env = signing.sign(signing.PAYLOAD_TYPES["review"], msgspec.json.encode(rv), ALICE[1])
    verified = signing.Verified(b"", "ed25519:alice", ALICE[0], signing.envelope_digest(env),
                                env)
    draft = authority.review(record, Act(verified.digest, 1), verified, rv, False, TRIAGER, NOW)
    return committed(record, draft), draft


def _waiting(p: Proposal):
    record = registered(p)
    d = decide(record)
    assert d.cause == "awaiting_operator"
    return record.replace(decision=d, gate_class=d.gate_class)


def test_a_proposer_chosen_reversal_never_runs_under_an_approval_that_did_not_sign_it():
    """The L4 names its own reversal body ("MALICIOUS build"): an approval without the digest
    of what will run, or with the digest of something else, is refused; one that signs it
    approves — the reversal the operator saw is the one that runs later."""
    from improved.core.authority import will_run_digest

    p = l4(revert={"restore": {"a": "MALICIOUS build, not the last-known-good"}})
    record = _waiting(p)
    for digest in (None, will_run_digest(l4())):
        _, draft = _approve(record, digest)
        assert draft.verdict == "refused" and "(unseen_body)" in draft.reason
    approved, draft = _approve(record, will_run_digest(p))
    assert draft.verdict == "approve" and approved.approved_by == "operator:alice"


def test_an_lkg_derived_reversal_needs_no_digest_but_a_wrong_one_is_refused():
    from improved.core.authority import will_run_digest

    record = _waiting(l4())
    assert _approve(record, None)[1].verdict == "approve"
    assert _approve(record, will_run_digest(l4())) [1].verdict == "approve"
    wrong = will_run_digest(l4(proposal_data={"artefacts": {"a": "other", "b": "x"}}))
    assert "(unseen_body)" in _approve(record, wrong)[1].reason


# -- constitution VII.1: autonomous paths may not propose amendments ----------------------------


@pytest.mark.parametrize("actor", ["agentd:run-1:3", "curator", "mcp:aaa:1", "operator",
                                   "operators:alice"])
def test_a_constitution_edit_from_an_autonomous_origin_is_refused(actor):
    p = charter(origin=Origin(actor=actor, service="docs"))
    d = decide(registered(p))
    assert (d.verdict, d.cause) == ("reject", "forbidden_target")
    assert "VII.1" in d.rationale and actor in d.rationale and "operator" in d.rationale


def test_an_autonomous_origin_is_refused_even_off_the_constitution_file():
    """Scope charter on another document (the amendment is what is refused, not the path)."""
    p = charter(origin=Origin(actor="agentd:run-1:3", service="docs"),
                target_ref="doc:docs/notes.md", target_files=["docs/notes.md"],
                proposal_edit=ProposalEdit(
                    format="unified", base_digest="sha256:" + "0" * 64,
                    diff="--- a/CHANGELOG.md\n+++ b/CHANGELOG.md\n@@ -1 +1,2 @@\n x\n+- y\n"))
    d = decide(registered(p))
    assert (d.verdict, d.cause) == ("reject", "forbidden_target") and "VII.1" in d.rationale


def test_an_operator_origin_is_prepared_for_the_operator():
    d = decide(registered(charter()))
    assert (d.verdict, d.cause) == ("defer", "awaiting_operator")


# -- schema changes carry their way back (SPEC 09 §7.4) ----------------------------------------

HEADS = {"a": "sha256:" + "1" * 64, "b": "sha256:" + "2" * 64}


def schema_change(**overrides) -> Proposal:
    return l4(target_ref="schema:deploy", **overrides)


@pytest.mark.parametrize("revert, why", [
    (None, "schema_revert: a schema change carries its backward-compatible revert"),
    ({"artefacts": {"a": "{}", "b": "{}"}}, "restores the prior schema"),
    ({"restore": {"a": HEADS["a"]}}, "not the artefacts the change swaps"),
])
def test_a_schema_change_without_its_revert_is_rejected_invalid(revert, why):
    d = decide(registered(schema_change(revert=revert)))
    assert (d.verdict, d.cause) == ("reject", "invalid") and why in d.rationale


def test_a_schema_change_with_its_revert_waits_for_the_operator_like_any_l4():
    d = decide(registered(schema_change(revert={"restore": HEADS})))
    assert (d.verdict, d.cause) == ("defer", "awaiting_operator")


def test_a_claimed_base_other_than_the_owners_head_refuses_the_apply_before_any_order():
    """The proposer says which schema it changes from; the owner's answer decides."""
    assert lkg.report_problem(approved(schema_change(revert={"restore": HEADS})), report()) \
        is None
    lied = approved(schema_change(revert={"restore": {**HEADS, "b": "sha256:" + "7" * 64}}))
    why = lkg.report_problem(lied, report())
    assert why is not None and why.startswith("schema_base: the revert restores b to sha256:7")
