"""The planner (improved/planner.py): every next step the engine takes, in its priority order,
decided without a broker. Each case mirrors an end-to-end case of the loop tests; here the
record is walked through its transitions purely (seal the draft, append it, ask again)."""

from __future__ import annotations

import base64
import itertools

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.core import apply, audit, authority, learnback, lkg, planner, propose, quorum, signing
from improved.core.authority import Act
from improved.core.boundary import Conflict, Unattested
from improved.core.breaker import Autonomy
from improved.core.policy import Policy
from improved.core.record import ProposalRecord, fold, replay, same_state
from improved.core.signing import TrustStore
from improved.protocol.model import (
    ApplyResult,
    MeasureRequest,
    MetricSnapshot,
    Review,
    Signal,
    Vote,
)
from tests.builders import NOW, QUORUM_POLICY, TRIAGER, l4, make_proposal, report, said
from tests.keys import TRUST, VOTERS

POLICY = Policy(doc_allowlist=("**",))
PRINCIPAL = POLICY.policy_principal
_SEQ = itertools.count(100)
OPEN = Autonomy()
BREAKER = Autonomy(paused_until=NOW + 3_600_000)
SWITCHED_OFF = Autonomy(switch="off")
CRISIS = Autonomy(crisis="crisis-1")


def registered(policy: Policy = POLICY, **overrides) -> ProposalRecord:
    proposal = make_proposal(**overrides)
    pid, dedup = propose.identify(proposal)
    record, draft = propose.register(proposal, pid, dedup, policy, NOW - 1)
    return commit(record, draft)


CHAINS: dict[str, list] = {}  # proposal id → its chain as `commit` appended it


def commit(record: ProposalRecord, draft, at: int = NOW) -> ProposalRecord:
    """What the engine's commit does, without the broker: seal, append, fold the trailer in."""
    trailer, seq = audit.seal(draft, record, at), next(_SEQ)
    if trailer.seq == 0:
        CHAINS[record.proposal_id] = []
    CHAINS[record.proposal_id].append((trailer, seq))
    return fold(record, trailer, seq)


def rebuilt(record: ProposalRecord) -> ProposalRecord:
    """`record` rebuilt from its chain alone, as another replica or a restart would."""
    chain = CHAINS[record.proposal_id]
    return propose.rebuild_record([t for t, _ in chain], [q for _, q in chain], POLICY)


def view(autonomy: Autonomy = OPEN, now: int = NOW, **over) -> planner.View:
    return planner.View(now=now, autonomy=autonomy, **over)


def step_of(record: ProposalRecord, v: planner.View | None = None,
            policy: Policy = POLICY) -> planner.Step:
    return planner.next_step(record, v or view(), policy, TRIAGER)


def settle(record: ProposalRecord, v: planner.View | None = None, policy: Policy = POLICY,
           grant: bool | None = None, at_intent: bool | None = None,
           ) -> tuple[ProposalRecord, list[str], planner.Step]:
    """Carry out every commit (and the reads) the planner asks for; stop at the first step
    that needs the world. Returns the record, the commits' rules in order, and that step.
    `at_intent`: the grant as of the intent's stream sequence (by default, as `grant`)."""
    v = v or view()
    rules: list[str] = []
    for _ in range(20):
        step = planner.next_step(record, v, policy, TRIAGER)
        if isinstance(step, planner.ReadGrant):
            assert grant is not None, "the planner asked for a grant the case did not expect"
            v = planner.with_read(v, step, grant)
            continue
        if isinstance(step, planner.ConfirmGrant):
            assert grant is not None, "the planner asked for a grant the case did not expect"
            v = planner.with_read(v, step, grant if at_intent is None else at_intent)
            continue
        if not isinstance(step, planner.Commit):
            return record, rules, step
        rules.append(step.why)
        record = commit(record, step.draft)
    raise AssertionError(f"the planner kept committing: {rules}")


def applied(record: ProposalRecord, step: planner.SendApply, ok: bool = True,
            **result) -> ProposalRecord:
    res = ApplyResult(ok=ok, applied_id="a-1" if ok else "", **result)
    return commit(record, apply.transition(record, said(res), step.authority))


ALICE = Ed25519PrivateKey.generate()
OPERATORS = TrustStore.from_config({
    "operator:alice": base64.b64encode(signing.raw_public(ALICE.public_key())).decode()})


def signed_review(record: ProposalRecord, verdict: str) -> ProposalRecord:
    """An operator's signed review, verified and recorded as the review ingest does."""
    rv = Review(proposal_id=record.proposal_id, verdict=verdict, principal="operator:alice",
                reason="looked at it", at=NOW)
    env = signing.sign(signing.PAYLOAD_TYPES["review"], msgspec.json.encode(rv), ALICE)
    verified = OPERATORS.verify(env, signing.PAYLOAD_TYPES["review"])
    return commit(record, authority.review(record, Act(verified.digest, next(_SEQ)), verified, rv,
                                    False, TRIAGER, NOW))


def approved(record: ProposalRecord) -> ProposalRecord:
    record, _, _ = settle(record)
    after = signed_review(record, "approve")
    assert after.approved_by == "operator:alice", after.decision
    return after


# -- triage first, then the apply --------------------------------------------------------------


def test_an_l0_is_triaged_then_sent_under_the_policy_principal():
    record, rules, step = settle(registered(target_ref="rank:x", change_class="L0",
                                            proposal_data={"set": {"key": "x", "value": 1}}))
    assert rules == ["triage", "dispatched"] and record.decision.verdict == "accept"
    assert record.in_flight and record.status == "pending"
    assert isinstance(step, planner.SendApply)
    assert step.authority == PRINCIPAL == record.dispatched_by
    assert step.order.proposal_id == record.proposal_id


def test_without_dispatch_an_accepted_l0_is_left_for_the_inbound_consumer():
    record, rules, step = settle(registered(target_ref="rank:x", change_class="L0",
                                            proposal_data={"set": {"key": "x", "value": 1}}),
                                 view(dispatch=False))
    assert rules == ["triage"] and step == planner.DONE


def test_an_l2_waits_for_an_operator_and_then_runs_under_the_operators_authority():
    record, rules, step = settle(registered())
    assert rules == ["triage"] and step == planner.DONE
    assert (record.decision.verdict, record.decision.cause) == ("defer", "awaiting_operator")
    _, rules, step = settle(approved(record))
    assert rules == ["dispatched"]
    assert isinstance(step, planner.SendApply) and step.authority == "operator:alice"


def test_an_l3_reads_its_grant_before_triage_and_stays_bound_to_it():
    record = registered(change_class="L3")
    assert step_of(record) == planner.ReadGrant(record.skill)
    granted, rules, step = settle(record, grant=True)
    assert rules == ["triage", "dispatched"] and granted.decision.verdict == "accept"
    assert isinstance(step, planner.SendApply) and step.authority == PRINCIPAL
    waiting, _, step = settle(record, grant=False)
    assert (waiting.decision.cause, waiting.gate_class) == ("no_grant", "L2")
    assert step == planner.DONE


def test_a_grant_revoked_before_the_dispatch_regates_the_l3_as_l2():
    record, rules, _ = settle(registered(change_class="L3"), view(dispatch=False), grant=True)
    assert rules == ["triage"] and not record.in_flight
    # the grant is read again right before the dispatch would be recorded
    assert step_of(record) == planner.ReadGrant(record.skill)
    record, rules, step = settle(record, grant=False)
    assert rules == ["revoked"] and step == planner.DONE and not record.in_flight
    assert (record.decision.cause, record.gate_class) == ("no_grant", "L2")


# -- the dispatch on the chain: an intent before every order (issue 13.5) -----------------------


def review_of(record: ProposalRecord, verdict: str):
    """The draft of an operator's signed review, as the review ingest makes it."""
    rv = Review(proposal_id=record.proposal_id, verdict=verdict, principal="operator:alice",
                reason="changed my mind", at=NOW)
    env = signing.sign(signing.PAYLOAD_TYPES["review"], msgspec.json.encode(rv), ALICE)
    verified = OPERATORS.verify(env, signing.PAYLOAD_TYPES["review"])
    return authority.review(record, Act(verified.digest, next(_SEQ)), verified, rv, False,
                            TRIAGER, NOW)


def test_an_accepted_proposal_commits_its_dispatch_before_the_order_is_sent():
    record = approved(registered())
    intent = step_of(record)
    assert isinstance(intent, planner.Commit) and intent.why == "dispatched"
    d = intent.draft
    assert (d.to_stage, d.verdict, d.actor, d.observer_type) == ("apply", "dispatched", TRIAGER,
                                                                 "rec:system")
    assert d.refs == ("dispatch:apply", f"order:{record.proposal_id}",
                      "authority:operator:alice")
    sent = commit(record, intent.draft)
    assert sent.in_flight and sent.status == "approved" and sent.stage == "apply"
    assert (sent.dispatched_by, sent.dispatched_at) == ("operator:alice", NOW)
    step = step_of(sent)
    assert isinstance(step, planner.SendApply)
    assert step.order == apply.order(record, POLICY, 1)  # the order the intent names
    done = applied(sent, step)
    assert done.status == "applied" and not done.in_flight and step_of(done) == planner.DONE


def test_a_pending_intent_after_a_restart_sends_the_same_order_and_records_its_outcome():
    trailers: list = []

    def on_chain(record: ProposalRecord, draft) -> ProposalRecord:
        trailers.append(audit.seal(draft, record, NOW))
        return fold(record, trailers[-1], len(trailers))

    proposal = make_proposal()
    pid, dedup = propose.identify(proposal)
    record = on_chain(*propose.register(proposal, pid, dedup, POLICY, NOW - 1))
    triaged = step_of(record)
    record = on_chain(record, triaged.draft)
    record = on_chain(record, review_of(record, "approve"))
    intent = step_of(record)
    record = on_chain(record, intent.draft)
    before = step_of(record)
    # the replica dies here, the order maybe sent; another rebuilds the record from the chain
    rebuilt = propose.rebuild_record(trailers, list(range(1, len(trailers) + 1)), POLICY)
    assert rebuilt == record
    assert rebuilt.in_flight and rebuilt.dispatched_by == "operator:alice"
    again = step_of(rebuilt)
    assert isinstance(again, planner.SendApply) and again == before  # no second intent
    done = applied(rebuilt, again)
    assert done.status == "applied" and step_of(done) == planner.DONE


@pytest.mark.parametrize("verdict", ["reject", "approve"])
def test_a_review_after_the_intent_is_refused_and_changes_nothing(verdict):
    sent, _, send = settle(approved(registered()))
    draft = review_of(sent, verdict)
    assert (draft.to_stage, draft.verdict) == ("triage", "refused")
    assert "code:apply_in_flight" in draft.refs and "apply_in_flight" in draft.reason
    refused = commit(sent, draft)
    assert (refused.status, refused.decision, refused.approved_by) == (
        sent.status, sent.decision, sent.approved_by)
    assert step_of(refused) == send  # the same order, and its outcome is still recorded
    assert applied(refused, send).status == "applied"


def test_a_reject_before_any_approval_wins_and_no_order_is_sent():
    record, _, _ = settle(registered())
    rejected = commit(record, review_of(record, "reject"))
    assert rejected.status == "rejected" and step_of(rejected) == planner.DONE


def test_an_approved_proposal_cannot_be_rejected():
    """OMS has no approved → rejected: the reject is refused on the chain, the approval
    stands and its apply goes on (rollback, once applied, is the way back)."""
    record = approved(registered())
    draft = review_of(record, "reject")
    assert (draft.to_stage, draft.verdict) == ("triage", "refused")
    assert "code:not_awaiting_review" in draft.refs
    assert "approved" in draft.reason and "rollback" in draft.reason
    refused = commit(record, draft)
    assert (refused.status, refused.approved_by) == ("approved", "operator:alice")
    _, rules, send = settle(refused)
    assert rules == ["dispatched"] and isinstance(send, planner.SendApply)


def test_a_review_trailer_says_approved_or_rejected_and_the_old_wording_still_verifies():
    """The reason is inside the trailer's hash: fixing "rejectd" changes new trailers only, and
    a chain that recorded the old wording verifies as it was written."""
    proposal = make_proposal()
    record, draft = propose.register(proposal, *propose.identify(proposal), POLICY, NOW - 1)
    trailers = []
    while True:  # registered, then triaged: the chain an operator's review continues
        trailers.append(audit.seal(draft, record, NOW))
        record = fold(record, trailers[-1], next(_SEQ))
        if not isinstance(step := step_of(record), planner.Commit):
            break
        draft = step.draft
    assert review_of(record, "approve").reason == "approved by operator:alice: changed my mind"
    draft = review_of(record, "reject")
    assert draft.reason == "rejected by operator:alice: changed my mind"
    old = msgspec.structs.replace(draft, reason="rejectd by operator:alice: changed my mind")
    bodies = [msgspec.to_builtins(t) for t in (*trailers, audit.seal(old, record, NOW))]
    assert audit.verify_chain(record.proposal_id, bodies) is None


def test_after_the_intent_neither_expiry_nor_a_hold_nor_new_content_stops_the_outcome():
    record, rules, send = settle(registered(valid_to=NOW + 10, **L0))
    assert rules == ["triage", "dispatched"] and isinstance(send, planner.SendApply)
    for late in (view(now=NOW + 10), view(BREAKER), view(SWITCHED_OFF)):
        assert step_of(record, late) == send
    assert propose.supersede(record, "f" * 64, TRIAGER) is None


def test_an_order_that_provably_reached_no_service_withdraws_its_dispatch():
    sent, _, send = settle(approved(registered()))
    # an earlier pass recorded it, or an attempt timed out: it may have been delivered
    assert planner.unreachable(sent, False, False, "no service", TRIAGER) is None
    assert planner.unreachable(sent, True, True, "timed out", TRIAGER) is None
    void = planner.unreachable(sent, True, False, "no service answers svc.improve.apply",
                               TRIAGER)
    assert void is not None and (void.draft.to_stage, void.draft.verdict) == ("apply",
                                                                              "undelivered")
    back = commit(sent, void.draft)
    assert not back.in_flight and back.status == "approved"
    # open to a decision again: new content supersedes it (an approval is never rejected)
    assert propose.supersede(back, "f" * 64, TRIAGER) is not None
    assert review_of(back, "reject").verdict == "refused"
    _, rules, step = settle(back)
    assert rules == ["dispatched"] and step == send  # or recorded and sent again


def test_an_l3_intent_is_judged_as_of_its_own_stream_sequence_before_its_order_is_sent():
    """The grant read before the intent is a hint: a revoke on the grant chain can land
    between that read and the intent's append without conflicting with it. Once the intent is
    on the chain the planner asks for the grant as of the intent's stream sequence and time;
    only then is the order sent."""
    record, rules, _ = settle(registered(change_class="L3"), grant=True,
                              v=view(dispatch=False))
    assert rules == ["triage"]
    intent = step_of(record, view(grant=True))
    assert isinstance(intent, planner.Commit) and intent.why == "dispatched"
    sent = commit(record, intent.draft)
    assert sent.dispatched_seq == sent.chain.stream_seq  # the intent's own sequence
    ask = step_of(sent, view(grant=True))
    assert ask == planner.ConfirmGrant(sent.skill, sent.dispatched_seq, sent.dispatched_at)
    # another intent's answer (an earlier sequence) is no answer for this one
    stale = view(grant=True, grant_at_intent=(sent.dispatched_seq - 1, True))
    assert step_of(sent, stale) == ask
    send = step_of(sent, planner.with_read(view(grant=True), ask, True))
    assert isinstance(send, planner.SendApply) and send.authority == PRINCIPAL


def test_an_l3_intent_recorded_after_its_grant_was_revoked_is_withdrawn_and_never_sent():
    record, rules, step = settle(registered(change_class="L3"), grant=True, at_intent=False)
    assert rules == ["triage", "dispatched", "revoked"] and step == planner.DONE
    assert not record.in_flight and record.dispatched_seq is None
    assert (record.decision.cause, record.gate_class) == ("no_grant", "L2")
    # open to an operator now, as any L2: an approval applies it under their authority
    _, rules, send = settle(approved(record))
    assert rules == ["dispatched"] and send.authority == "operator:alice"


@pytest.mark.parametrize("stood", [True, False])
def test_a_pass_that_finds_an_l3_intent_judges_it_as_of_its_sequence_before_sending(stood):
    """A redelivery, a restart or the other replica rebuilds an in-flight L3 from the chain:
    before the order goes out (again) the grant is judged as of the intent's sequence, not
    now. An intent that stood is finished whatever was revoked since; one that did not was
    never sent by anyone, and is withdrawn."""
    trailers: list = []

    def on_chain(record: ProposalRecord, draft) -> ProposalRecord:
        trailers.append(audit.seal(draft, record, NOW))
        return fold(record, trailers[-1], 10 * len(trailers))

    proposal = make_proposal(change_class="L3")
    record = on_chain(*propose.register(proposal, *propose.identify(proposal), POLICY, NOW - 1))
    triaged = planner.next_step(record, view(grant=True), POLICY, TRIAGER)
    record = on_chain(record, triaged.draft)
    intent = planner.next_step(record, view(grant=True), POLICY, TRIAGER)
    record = on_chain(record, intent.draft)
    rebuilt = propose.rebuild_record(trailers, [10 * (i + 1) for i in range(len(trailers))],
                                     POLICY)
    assert rebuilt == record and rebuilt.in_flight and rebuilt.dispatched_seq == 30
    # revoked now, whichever way it stood then: no re-read of the current grant decides it
    ask = step_of(rebuilt, view(grant=False))
    assert ask == planner.ConfirmGrant(rebuilt.skill, 30, NOW)
    after = step_of(rebuilt, planner.with_read(view(grant=False), ask, stood))
    if stood:
        assert isinstance(after, planner.SendApply)
        assert after.order == apply.order(rebuilt, POLICY, 1)
    else:
        assert isinstance(after, planner.Commit) and after.why == "revoked"
        assert not commit(rebuilt, after.draft).in_flight


def test_a_retried_l3_order_rechecks_its_grant_only_while_its_dispatch_may_be_withdrawn():
    sent, rules, _ = settle(registered(change_class="L3"), grant=True)
    assert rules == ["triage", "dispatched"]
    assert planner.recheck_grant(sent, True, False)
    assert not planner.recheck_grant(sent, True, True)  # a timed-out attempt may have landed
    assert not planner.recheck_grant(sent, False, False)  # recorded by an earlier pass
    c = planner.revoked(sent, POLICY, NOW, TRIAGER)
    back = commit(sent, c.draft)
    assert not back.in_flight and back.decision.cause == "no_grant"
    assert step_of(back) == planner.DONE


# -- the autonomy chain: holds, re-holds, releases, crisis -------------------------------------


L0 = dict(target_ref="rank:x", change_class="L0", proposal_data={"set": {"key": "x", "value": 1}})


@pytest.mark.parametrize("state,cause", [(BREAKER, "circuit_open"),
                                         (SWITCHED_OFF, "autonomy_off")])
def test_a_held_back_l0_is_deferred_and_released_once_autonomy_is_back(state, cause):
    record, rules, step = settle(registered(**L0), view(state))
    assert (record.decision.cause, step) == (cause, planner.DONE)
    record, rules, step = settle(record, view(OPEN))
    assert rules == ["triage", "dispatched"] and record.decision.verdict == "accept"
    assert isinstance(step, planner.SendApply)


def test_an_l0_accepted_before_the_breaker_opened_is_held_back_before_its_order():
    record, _, _ = settle(registered(**L0), view(dispatch=False))
    record, rules, step = settle(record, view(BREAKER))
    assert rules == ["hold"] and record.decision.cause == "circuit_open"
    assert step == planner.DONE


def test_an_operator_approved_l2_is_not_held_by_the_breaker():
    record, _, _ = settle(registered())
    _, _, step = settle(approved(record), view(BREAKER))
    assert isinstance(step, planner.SendApply)


def test_a_crisis_halts_every_dispatch_but_not_triage():
    record, rules, step = settle(registered(**L0), view(CRISIS))
    assert rules == ["triage"] and isinstance(step, planner.Halt)
    assert "crisis-1" in step.reason
    record, _, _ = settle(registered())
    assert isinstance(step_of(approved(record), view(CRISIS)), planner.Halt)


def test_an_accepted_proposal_that_expired_before_its_apply_is_rejected_instead():
    record, _, _ = settle(registered(valid_to=NOW + 10, **L0), view(dispatch=False))
    record, rules, step = settle(record, view(now=NOW + 10))
    assert rules == ["triage"] and record.decision.cause == "expired"
    assert step == planner.DONE


def test_a_self_confirmed_proposal_waits_and_an_independent_signal_releases_it():
    own = Signal(kind="check", actor=make_proposal().origin.actor, service="svc",
                 positive=True, at=NOW - 5)
    record, _, step = settle(registered(signals=[own]))
    assert record.decision.cause == "feedback_collapse" and step == planner.DONE
    other = Signal(kind="check", actor="mcp:other:1", service="other", positive=True,
                   at=NOW - 4)
    draft, _ = learnback.observe_signal(record, other, POLICY, NOW, "check:ci")
    record, rules, _ = settle(commit(record, draft))
    assert rules == ["triage"] and record.decision.cause == "awaiting_operator"


# -- quorum, L4 and reversals -------------------------------------------------------------------


def vote(record: ProposalRecord, voter: str, session: str, verdict: str = "approve"):
    """A signed vote counted on the chain (the ingest); what the quorum decides is the
    planner's."""
    v = Vote(proposal_id=record.proposal_id, vote=verdict, voter=voter, session=session,
             read=quorum.expected_reads(record), at=NOW)
    env = signing.sign(signing.PAYLOAD_TYPES["vote"], msgspec.json.encode(v), VOTERS[voter])
    verified = TRUST.verify(env, signing.PAYLOAD_TYPES["vote"])
    return commit(record, quorum.count(record, Act(verified.digest, next(_SEQ)), verified, v,
                                       env.signatures[0].sig, TRIAGER))


def test_three_votes_approve_and_the_l4_goes_to_its_lkg_check_first():
    r, _, step = settle(registered(QUORUM_POLICY, **_l4_fields()), policy=QUORUM_POLICY)
    assert r.decision.cause == "awaiting_quorum" and step == planner.DONE
    r = vote(vote(r, "agent-a", "s1"), "agent-b", "s2")
    assert step_of(r, policy=QUORUM_POLICY) == planner.DONE  # two do not add up
    r, rules, step = settle(vote(r, "agent-c", "s3"), policy=QUORUM_POLICY)
    assert rules == ["quorum"] and r.status == "approved"
    assert step == planner.CheckLkg()


def test_one_dissent_hands_the_l4_to_an_operator():
    r, _, _ = settle(registered(QUORUM_POLICY, **_l4_fields()), policy=QUORUM_POLICY)
    r, rules, step = settle(vote(r, "agent-a", "s1", "dissent"), policy=QUORUM_POLICY)
    assert rules == ["quorum"] and r.decision.cause == "quorum_dissent"
    assert step == planner.DONE


def test_an_unhealthy_lkg_fails_the_apply_with_nothing_sent():
    record = approved(registered(**_l4_fields()))
    c = planner.after_lkg(record, said(report(rc_b=1)), POLICY, TRIAGER, 1 << 20, NOW)
    after = commit(record, c.draft)
    assert c.why == "lkg_refused" and after.outcome.ok is False
    assert step_of(after) == planner.DONE


def test_a_healthy_lkg_records_the_reversal_before_the_order():
    record = approved(registered(**_l4_fields()))
    c = planner.after_lkg(record, said(report()), POLICY, TRIAGER, 1 << 20, NOW)
    after = commit(record, c.draft)
    assert c.why == "lkg_verified" and after.revert_id is not None
    _, rules, step = settle(after)
    assert rules == ["dispatched"]
    assert isinstance(step, planner.SendApply) and step.authority == "operator:alice"


def test_a_reversal_too_large_to_propose_refuses_the_apply():
    record = approved(registered(**_l4_fields()))
    c = planner.after_lkg(record, said(report()), POLICY, TRIAGER, 100, NOW)
    assert c.why == "lkg_refused" and "not a valid proposal" in c.draft.reason


def test_a_reversal_reads_its_original_and_inherits_an_applied_originals_approval():
    original = approved(registered(**_l4_fields()))
    c = planner.after_lkg(original, said(report()), POLICY, TRIAGER, 1 << 20, NOW)
    original = commit(original, c.draft).replace(status="applied")
    reversal = registered_proposal(original.revert)
    assert step_of(reversal) == planner.ReadOriginal(original.proposal_id)
    v = planner.with_read(view(), planner.ReadOriginal(original.proposal_id), original)
    step = step_of(reversal, v)
    assert isinstance(step, planner.Commit) and step.why == "inherit"
    assert commit(reversal, step.draft).approved_by == "operator:alice"
    # not found (or not applied): an ordinary triage
    v = planner.with_read(view(), planner.ReadOriginal(original.proposal_id), None)
    assert step_of(reversal, v).why == "triage"


# -- after the apply: rollback, measurement, finishing a rollback -------------------------------


def test_an_operators_rollback_goes_before_anything_else_and_is_halted_by_a_crisis():
    record, _, step = settle(registered(**L0))
    record = applied(record, step, inverse={"set": {"key": "x", "value": 0}}, rollbackable=True)
    asked = signed_review(record, "rollback")
    assert isinstance(step_of(asked, view(CRISIS)), planner.Halt)
    assert step_of(asked, view(dispatch=False)) == planner.DONE
    intent = step_of(asked)
    assert isinstance(intent, planner.Commit) and intent.why == "dispatched"
    assert "dispatch:rollback" in intent.draft.refs
    assert "authority:operator:alice" in intent.draft.refs
    sent, rules, step = settle(asked)
    assert rules == ["dispatched"] and sent.rollback_dispatched_at == NOW
    assert isinstance(step, planner.SendRollback) and step.order.authority == "operator:alice"
    assert f"order:{step.inverse_id}" in intent.draft.refs


def rebuilt_alike(before: ProposalRecord, step: planner.Commit, done: ProposalRecord) -> bool:
    """The chain says what the step said: its trailer replayed on `before` gives the record
    the commit made (one fold for both, so alike by construction)."""
    trailer = audit.seal(step.draft, before, NOW)
    return same_state(replay(before, [trailer], [7]), done)


def under_review(rollbackable: bool = True, query: str | None = "metrics.ctr"):
    snap = MetricSnapshot(metric="ctr", baseline=0.2, review_after=NOW + 100, query=query)
    record, _, step = settle(registered(metric_snapshot=snap, **L0))
    return applied(record, step, inverse={"set": {"key": "x", "value": 0}},
                   rollbackable=rollbackable)


def test_at_review_after_the_owning_service_is_asked_the_snapshots_query():
    record = under_review()
    assert step_of(record, view(now=NOW + 99)) == planner.DONE  # before review_after
    assert step_of(record, view(now=NOW + 200, dispatch=False)) == planner.DONE
    step = step_of(record, view(now=NOW + 200))
    assert step == planner.AskMeasure(MeasureRequest(
        proposal_id=record.proposal_id, metric="ctr", query="metrics.ctr"))


def test_a_regression_at_review_after_proposes_the_recorded_rollback_then_commits():
    record = under_review()
    # a reading arriving as a signal decides nothing: the service is asked
    reading = Signal(kind="metric", actor="mcp:meter:1", service="metrics", positive=False,
                     at=NOW + 150, name="ctr", value=0.1)
    draft, _ = learnback.observe_signal(record, reading, POLICY, NOW + 150, "check:meter")
    record = commit(record, draft)
    assert isinstance(step_of(record, view(now=NOW + 200)), planner.AskMeasure)
    step = planner.after_measure(record, said(learnback.Reading(value=0.1)), POLICY, TRIAGER)
    assert step.rollback is not None and step.commit.draft.verdict == "regressed"
    rollback_id, _ = propose.identify(step.rollback)
    refs = step.commit.draft.refs
    assert f"rollback_proposal:{rollback_id}" in refs and "value:0.1" in refs
    assert "measured_by:asked svc" in refs and "query:metrics.ctr" in refs
    done = commit(record, step.commit.draft)
    assert done.measured == "regressed" and done.measured_value == 0.1
    assert step_of(done, view(now=NOW + 200)) == planner.DONE  # never measured twice
    assert rebuilt_alike(record, step.commit, done)


@pytest.mark.parametrize("reading", [learnback.Reading(cause="no service answers x"),
                                     learnback.Reading(value=float("nan")),
                                     learnback.Reading(value=float("inf"))])
def test_no_answer_is_recorded_unmeasured_never_held(reading):
    record = under_review()
    step = planner.after_measure(record, said(reading), POLICY, TRIAGER)
    draft = step.commit.draft
    assert step.rollback is None and draft.verdict == "unmeasured"
    assert not any(r.startswith("value:") for r in draft.refs)
    assert any(r.startswith("cause:") for r in draft.refs) and "unknown" in draft.reason
    done = commit(record, draft)
    assert done.measured == "unmeasured" and done.measured_value is None
    assert learnback.summary(done, NOW).measured == "unmeasured"
    assert step_of(done, view(now=NOW + 300)) == planner.DONE
    assert rebuilt_alike(record, step.commit, done)


@pytest.mark.parametrize("answer", [
    Unattested(learnback.Reading(value=0.1), "unsigned, and the bus binds no service to its "
                                             "subjects"),
    Conflict((said(learnback.Reading(value=0.1)), said(learnback.Reading(value=0.5)))),
])
def test_a_regressing_value_nobody_can_attest_is_unmeasured_and_rolls_nothing_back(answer):
    """On an open bus anyone may answer the measurement first: what is not the service's own
    (or what its own answers contradict) is recorded, and decides nothing."""
    record = under_review()
    step = planner.after_measure(record, answer, POLICY, TRIAGER)
    draft = step.commit.draft
    assert step.rollback is None and draft.verdict == "unmeasured"
    assert not any(r.startswith(("value:", "rollback_proposal:")) for r in draft.refs)
    cause = next(r for r in draft.refs if r.startswith("cause:"))
    assert "0.1" in cause, cause
    who = "conflict" if isinstance(answer, Conflict) else "unattested"
    assert f"answered_by:{who}" in draft.refs
    done = commit(record, draft)
    assert done.measured == "unmeasured" and rebuilt_alike(record, step.commit, done)


def test_a_regression_with_nothing_recorded_to_undo_proposes_nothing():
    record = under_review(rollbackable=False)
    step = planner.after_measure(record, said(learnback.Reading(value=0.0)), POLICY, TRIAGER)
    assert step.rollback is None and step.commit.draft.verdict == "regressed"
    assert "nothing recorded to roll back" in step.commit.draft.reason


def test_an_applied_rollback_finishes_its_original():
    record, _, step = settle(registered(**L0))
    record = applied(record, step, inverse={"set": {"key": "x", "value": 0}}, rollbackable=True)
    inverse = registered_proposal(apply.rollback_proposal(record))
    inverse, _, step = settle(inverse)
    inverse = applied(inverse, step)
    assert step_of(inverse) == planner.FinishRollback(record.proposal_id)


# -- properties ----------------------------------------------------------------------------------


def registered_proposal(proposal) -> ProposalRecord:
    pid, dedup = propose.identify(proposal)
    record, draft = propose.register(proposal, pid, dedup, POLICY, NOW - 1)
    return commit(record, draft)


def _l4_fields() -> dict:
    p = l4()
    return dict(service=p.service, target_ref=p.target_ref, change_class="L4",
                scope=p.scope, origin=p.origin, analyzer=p.analyzer, summary=p.summary,
                proposal_data=p.proposal_data, lkg=p.lkg)


CASES = [
    dict(L0), {}, dict(change_class="L3"), dict(change_class="L1"),
    dict(target_ref="rank:x", change_class="L2", proposal_data={"set": {"key": "x"}}),
    dict(target_ref="code:x", change_class="L0"),  # below its minimum: rejected
]


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(CASES), autonomy=st.sampled_from([OPEN, BREAKER, SWITCHED_OFF,
                                                               CRISIS]),
       dispatch=st.booleans(), grant=st.booleans(), at_intent=st.booleans(),
       later=st.integers(0, 10**9), approve=st.booleans(), ok=st.booleans())
def test_the_planner_always_settles_and_never_sends_what_its_gate_forbids(
        case, autonomy, dispatch, grant, at_intent, later, approve, ok):
    """Whatever the autonomy state, clock and grant (now, and as of the intent): the commits
    end within a few steps, the only sends are to an accepted proposal that is not held back,
    never in a crisis, never without dispatch, never for an L3 whose grant was not active as
    of its intent, and an order always carries the approver's or the policy's authority."""
    record, rules, step = settle(registered(**case), view(autonomy, NOW + later,
                                                           dispatch=dispatch), grant=grant,
                                 at_intent=at_intent)
    assert len(rules) <= 3
    if approve and record.status == "pending" and record.decision.verdict == "defer" \
            and record.decision.cause in ("awaiting_operator", "no_grant"):
        record, _, step = settle(approved(record), view(autonomy, NOW + later,
                                                         dispatch=dispatch))
    if isinstance(step, planner.SendApply):
        assert dispatch and not autonomy.crisis
        assert record.decision.verdict == "accept" and record.in_flight
        assert step.authority == (record.approved_by or PRINCIPAL)
        assert record.approved_by is not None or view(autonomy, NOW + later).held(record) is None
        assert not apply.grant_bound(record) or (grant and at_intent)
        record = applied(record, step, ok=ok)
        assert step_of(record, view(autonomy, NOW + later, dispatch=dispatch)) == planner.DONE
    else:
        assert isinstance(step, planner.Done | planner.Halt)
        assert not isinstance(step, planner.Halt) or (autonomy.crisis and dispatch)
    assert not lkg.needs_check(record)
    # what the commits made is what the chain says: one fold for a commit and a rebuild
    assert rebuilt(record) == record
