"""Who wrote a trailer and what an authority trailer rests on (core/evidence.py), without a
broker: a trailer verifies beyond its hash only when a trusted daemon signed it, and an
approval, a grant, a vote or a crisis resolution only with the signed act itself, by a key
trusted when it was written."""

from __future__ import annotations

import base64
import dataclasses

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from improved.core import audit, evidence, signing
from improved.core.audit import Draft
from improved.core.record import ChainHead
from improved.core.trailers import ref
from tests.factories import grant, review, vote
from tests.keys import ALICE, MALLORY, VOTERS

DAEMON = Ed25519PrivateKey.generate()
ROGUE = Ed25519PrivateKey.generate()
PID = "ab" * 32


def b64(key: Ed25519PrivateKey) -> str:
    return base64.b64encode(signing.raw_public(key.public_key())).decode()


def keyid(key: Ed25519PrivateKey) -> str:
    return signing.keyid_of(signing.raw_public(key.public_key()))


KEYS = evidence.KeySet.from_config({ALICE[0]: b64(ALICE[1])},
                                   {name: b64(k) for name, k in VOTERS.items()})
TRUST = evidence.ChainTrust(frozenset({keyid(DAEMON)}), evidence.History(fallback=KEYS))


def chain(*drafts: Draft, key: Ed25519PrivateKey | None = DAEMON, chain_id: str = PID
          ) -> list[dict]:
    """The bodies of a chain made of `drafts`, each sealed and (with `key`) signed."""
    head, bodies = ChainHead(), []
    for d in drafts:
        t = audit.seal_next(d, chain_id, head, "L2", "knowledge", 1_000 + head.length)
        if key is not None:
            t = evidence.sign(t, key)
        bodies.append(msgspec.to_builtins(t))
        head = ChainHead(length=head.length + 1, last_hash=t.hash, stream_seq=head.length + 1)
    return bodies


REGISTER = Draft(from_stage="observe", to_stage="propose", actor="svc:agent",
                 observer_type="rec:agent", reason="proposed")


def approval(env, principal: str = ALICE[0], verdict: str = "approve") -> Draft:
    digest = signing.envelope_digest(env)
    return Draft(from_stage="triage", to_stage="triage", actor=principal, observer_type="human",
                 verdict=verdict, reason="approved", envelope=env,
                 refs=(ref("act", digest), ref("act_seq", 7)))


def test_a_chain_the_daemon_signed_with_a_signed_approval_verifies():
    assert audit.verify_chain(PID, chain(REGISTER, approval(review(PID))), TRUST) is None


def test_an_unsigned_trailer_is_named_though_its_hash_is_right():
    bodies = chain(REGISTER) + chain(REGISTER, approval(review(PID)), key=None)[1:]
    assert audit.verify_chain(PID, bodies) is None  # hashes and links hold
    brk = audit.verify_chain(PID, bodies, TRUST)
    assert brk is not None and brk.seq == 1 and "not signed by a daemon" in brk.problem


def test_a_trailer_signed_by_a_key_nobody_trusts_is_a_break():
    brk = audit.verify_chain(PID, chain(REGISTER, key=ROGUE), TRUST)
    assert brk is not None and "not a trusted daemon key" in brk.problem


def test_a_signature_moved_to_another_trailer_does_not_verify():
    bodies = chain(REGISTER, approval(review(PID)))
    bodies[1]["sig"] = bodies[0]["sig"]
    brk = audit.verify_chain(PID, bodies, TRUST)
    assert brk is not None and brk.seq == 1 and "does not match" in brk.problem


def test_an_approval_without_its_signed_act_is_a_break_even_from_a_daemon_key():
    """A compromised daemon key still cannot make an operator's approval up."""
    bare = msgspec.structs.replace(approval(review(PID)), envelope=None)
    brk = audit.verify_chain(PID, chain(REGISTER, bare), TRUST)
    assert brk is not None and brk.seq == 1 and "carries no signed act" in brk.problem


@pytest.mark.parametrize(("env", "draft_overrides", "named"), [
    (review(PID, who=MALLORY), {}, "unknown_key"),
    (review("cd" * 32), {}, "proposal"),
    (review(PID, verdict="reject"), {}, "verdict"),
    (review(PID), {"actor": "operator:bob"}, "principal"),
])
def test_an_approval_whose_act_says_otherwise_is_a_break(env, draft_overrides, named):
    draft = msgspec.structs.replace(approval(env), **draft_overrides)
    brk = audit.verify_chain(PID, chain(REGISTER, draft), TRUST)
    assert brk is not None and named in brk.problem


def test_an_act_that_is_not_the_one_the_trailer_names_is_a_break():
    draft = approval(review(PID))
    draft = msgspec.structs.replace(draft, refs=(ref("act", "00" * 32), ref("act_seq", 7)))
    brk = audit.verify_chain(PID, chain(REGISTER, draft), TRUST)
    assert brk is not None and "not the one the trailer names" in brk.problem


def test_a_grant_and_a_crisis_resolution_rest_on_their_acts():
    sha = "ef" * 32
    identity = f"skill-x:{sha}"
    env = grant(identity)
    ok = Draft(from_stage="triage", to_stage="triage", actor=ALICE[0], observer_type="human",
               verdict="grant", reason="g", envelope=env,
               refs=(ref("act", signing.envelope_digest(env)), ref("skill", identity)))
    assert audit.verify_chain(sha, chain(ok, chain_id=sha), TRUST) is None
    other = msgspec.structs.replace(ok, refs=(ok.refs[0], ref("skill", f"skill-y:{sha}")))
    brk = audit.verify_chain(sha, chain(other, chain_id=sha), TRUST)
    assert brk is not None and "skill" in brk.problem
    forged = Draft(from_stage="learn-back", to_stage="learn-back", actor=ALICE[0],
                   observer_type="human", verdict="crisis_resolved", reason="resolved",
                   refs=(ref("resolved", "crisis-1"),))
    brk = audit.verify_chain(PID, chain(forged), TRUST)
    assert brk is not None and "carries no signed act" in brk.problem


def test_a_signed_signal_proves_its_emitter_and_only_its_own_content():
    from improved.core import learnback, propose
    from improved.core.policy import Policy
    from improved.protocol.model import Signal
    from tests.builders import make_proposal
    from tests.keys import CHECK

    p = make_proposal()
    pid, dedup = propose.identify(p)
    record, reg = propose.register(p, pid, dedup, Policy(), 1_000)
    sig = Signal(kind="check", actor=CHECK[0], service="ci", positive=True, at=1_000,
                 proposal_id=pid)
    env = signing.sign(signing.PAYLOAD_TYPES["signal"], msgspec.json.encode(sig), CHECK[1])
    draft, _ = learnback.observe_signal(record, sig, Policy(), 1_001, CHECK[0], env)
    trust = dataclasses.replace(TRUST, history=evidence.History(
        fallback=evidence.KeySet.from_config({}, {}, {CHECK[0]: b64(CHECK[1])})))
    assert audit.verify_chain(pid, chain(reg, draft, chain_id=pid), trust) is None
    lying = msgspec.structs.replace(draft, refs=tuple(r.replace(f"emitter:{CHECK[0]}",
                                                           "emitter:check:other")
                                                  for r in draft.refs))
    brk = audit.verify_chain(pid, chain(reg, lying, chain_id=pid), trust)
    assert brk is not None and "signed signal" in brk.problem


def _vote_draft(voter: str, session: str) -> Draft:
    env = vote([f"proposal:{PID}"], voter, session)
    return Draft(from_stage="triage", to_stage="triage", actor=voter, observer_type="rec:agent",
                 verdict="vote", reason="v", envelope=env,
                 refs=(ref("act", signing.envelope_digest(env)), ref("keyid", keyid(VOTERS[voter])),
                       ref("vote", "approve")))


def _quorum(*voters: str) -> Draft:
    return Draft(from_stage="triage", to_stage="triage", actor=f"quorum:{PID[:16]}",
                 observer_type="rec:agent", verdict="quorum", reason="q",
                 refs=tuple(ref("keyid", keyid(VOTERS[v])) for v in voters))


def test_a_quorum_decision_needs_three_verified_approving_votes_before_it():
    votes = [_vote_draft(v, f"s-{v}") for v in ("agent-a", "agent-b", "agent-c")]
    good = chain(REGISTER, *votes, _quorum("agent-a", "agent-b", "agent-c"))
    assert audit.verify_chain(PID, good, TRUST) is None
    short = chain(REGISTER, *votes[:2], _quorum("agent-a", "agent-b", "agent-c"))
    brk = audit.verify_chain(PID, short, TRUST)
    assert brk is not None and "quorum decision is not backed" in brk.problem


def test_trailers_a_checkpoint_vouches_for_are_not_checked_again():
    bodies = chain(REGISTER, approval(review(PID)), key=None)
    covered = dataclasses.replace(TRUST, covered_to=2)
    assert audit.verify_chain(PID, bodies, covered, [1, 2]) is None
    assert audit.verify_chain(PID, bodies, covered, [1, 3]) is not None


# -- the trust history ----------------------------------------------------------------------------


def test_an_old_act_verifies_against_the_key_trusted_when_it_was_written():
    """Alice's key is removed at stream sequence 10: her approval at 5 still verifies, one
    written at 12 no longer does."""
    first = evidence.trust_draft(({ALICE[0]: b64(ALICE[1])}, {}, {}), None, "improved:a")
    assert first is not None
    before = msgspec.to_builtins(audit.seal_next(first, evidence.TRUST_ID, ChainHead(), "L0",
                                                 "operation", 1))
    second = evidence.trust_draft(({}, {}, {}), before, "improved:a")
    assert second is not None and any("operator operator:alice" in r for r in second.refs)
    after = msgspec.to_builtins(audit.seal_next(second, evidence.TRUST_ID, ChainHead(length=1),
                                                "L0", "operation", 2))
    history = evidence.history_of([(1, before), (10, after)], evidence.KeySet())
    trust = evidence.ChainTrust(frozenset({keyid(DAEMON)}), history)
    bodies = chain(REGISTER, approval(review(PID)))
    assert audit.verify_chain(PID, bodies, trust, [4, 5]) is None
    brk = audit.verify_chain(PID, bodies, trust, [11, 12])
    assert brk is not None and "unknown_key" in brk.problem


def test_the_same_trust_store_is_not_recorded_twice():
    first = evidence.trust_draft(({ALICE[0]: b64(ALICE[1])}, {}, {}), None, "improved:a")
    assert first is not None
    body = msgspec.to_builtins(audit.seal_next(first, evidence.TRUST_ID, ChainHead(), "L0",
                                               "operation", 1))
    assert evidence.trust_draft(({ALICE[0]: b64(ALICE[1])}, {}, {}), body, "improved:b") is None


@given(st.binary(min_size=1, max_size=64), st.integers(min_value=0, max_value=200))
def test_no_altered_signature_verifies(noise, position):
    body = chain(REGISTER)[0]
    public, _, sig = body["sig"].partition(".")
    raw = bytearray(base64.b64decode(sig))
    for i, byte in enumerate(noise):
        raw[(position + i) % len(raw)] ^= byte or 1
    body["sig"] = f"{public}.{base64.b64encode(bytes(raw)).decode()}"
    assert evidence.writer_problem(body, TRUST.daemons) is not None


def test_act_and_signature_are_kept_apart_from_the_hash():
    """The daemon signature is over the hash, so it is not part of it; the envelope is."""
    body = chain(REGISTER, approval(review(PID)))[1]
    assert audit.trailer_hash(body) == body["hash"]
    assert audit.trailer_hash({**body, "sig": "x"}) == body["hash"]
    changed = dict(body, envelope=dict(body["envelope"], payloadType="x"))
    assert audit.trailer_hash(changed) != body["hash"]


def test_a_trailer_this_process_wrote_needs_no_second_signature_check_and_no_other_does():
    """Until a checkpoint covers them, the daemon's own appends (known by hash) skip the
    Ed25519 check; a trailer with any other content is checked as ever."""
    mine = chain(REGISTER, approval(review(PID)), key=None)
    trust = dataclasses.replace(TRUST, written={body["hash"] for body in mine})
    assert audit.verify_chain(PID, mine, trust, [1, 2]) is None
    other = chain(REGISTER, msgspec.structs.replace(approval(review(PID)), reason="another"),
                  key=None)
    brk = audit.verify_chain(PID, other, trust, [1, 2])
    assert brk is not None and brk.seq == 1 and "not signed by a daemon" in brk.problem


def test_a_reload_names_what_changed_and_keeps_only_what_both_stores_trust():
    """What SIGHUP logs and what counts while the new store is recorded: a key replaced under
    the same principal is one added and one removed, and counts in neither meanwhile."""
    alice, bob, alice2 = b64(ALICE[1]), b64(MALLORY[1]), b64(Ed25519PrivateKey.generate())
    before = ({"operator:alice": alice}, {"agent-a": bob}, {})
    after = ({"operator:alice": alice2, "operator:bob": bob}, {"agent-a": bob}, {})
    changes = evidence.key_changes(before, after)
    assert [c.rsplit(" ", 1)[0] for c in changes["added"]] == ["operator operator:alice",
                                                               "operator operator:bob"]
    assert [c.rsplit(" ", 1)[0] for c in changes["removed"]] == ["operator operator:alice"]
    assert evidence.common_keys(before, after) == ({}, {"agent-a": bob}, {})
    assert evidence.key_changes(after, after) == {"added": [], "removed": []}
