"""Signed proposals in the core, without a broker: who may sign a proposal of a service, how
the registration trailer carries the envelope, that the chain alone (with the trust store)
proves who proposed — a swapped envelope or an edited `proposer:` ref is a break — and how
the verified proposer decides independence."""

from __future__ import annotations

import base64
import dataclasses

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.core import audit, evidence, identity, propose, signing
from improved.core.policy import Policy
from improved.core.trailers import ref
from improved.protocol import wire
from improved.protocol.model import Envelope, Origin, Trailer, to_json
from improved_reference.skill_competence import holder_of, practice_on_chain
from tests.builders import NOW, make_proposal
from tests.keys import AGENT_A, AGENT_B, EVALUATOR
from tests.unit.test_evidence import DAEMON, b64, chain, keyid

PROPOSAL_TYPE = "application/vnd.improved.proposal+json"
SVC = AGENT_A[0].split(":")[1]
SIGNERS = signing.TrustStore.from_config({n: b64(k) for n, k in (AGENT_A, AGENT_B, EVALUATOR)})
KEYS = evidence.KeySet(signers=SIGNERS)
TRUST = evidence.ChainTrust(frozenset({keyid(DAEMON)}), evidence.History(fallback=KEYS))


def proposal(**over):
    return make_proposal(service=SVC, **over)


def signed(p, key=AGENT_A[1]) -> Envelope:
    return signing.sign(PROPOSAL_TYPE, to_json(p), key)


def registration(p, env: Envelope | None, proposer: str | None):
    pid, dedup = propose.identify(p)
    _, draft = propose.register(p, pid, dedup, Policy(), NOW, proposer=proposer, envelope=env)
    return pid, draft


def test_the_envelope_and_the_verified_proposer_go_on_the_registration():
    p = proposal()
    env = signed(p)
    verified = propose.verify_signed(SIGNERS, env, p)
    assert verified.principal == AGENT_A[0]
    pid, draft = registration(p, env, verified.principal)
    assert draft.envelope == env and ref("proposer", AGENT_A[0]) in draft.refs
    assert pid == propose.identify(p)[0]  # the id is the content's, signed or not
    assert audit.verify_chain(pid, chain(draft, chain_id=pid), TRUST) is None
    record = propose.rebuild_record([msgspec.convert(b, type=Trailer)
                                     for b in chain(draft, chain_id=pid)], [1], Policy())
    assert record.proposer == AGENT_A[0]


def test_an_unsigned_registration_has_no_proposer():
    p = proposal()
    pid, draft = registration(p, None, None)
    assert draft.envelope is None and not any(r.startswith("proposer:") for r in draft.refs)
    record = propose.rebuild_record([msgspec.convert(b, type=Trailer)
                                     for b in chain(draft, chain_id=pid)], [1], Policy())
    assert record.proposer is None


@pytest.mark.parametrize(("key", "code"), [
    (Ed25519PrivateKey.generate(), "unknown_signer"),
    (EVALUATOR[1], "signer_mismatch"),  # trusted, but an agent of another service
])
def test_a_signer_that_is_not_the_services_is_refused(key, code):
    p = proposal()
    with pytest.raises(wire.WireError) as exc:
        propose.verify_signed(SIGNERS, signed(p, key), p)
    assert exc.value.code == code


def test_a_forged_signature_is_refused():
    p = proposal()
    other = signed(proposal(created_at=NOW - 1))
    forged = Envelope(payloadType=PROPOSAL_TYPE, payload=base64.b64encode(to_json(p)).decode(),
                      signatures=other.signatures)
    with pytest.raises(wire.WireError) as exc:
        propose.verify_signed(SIGNERS, forged, p)
    assert exc.value.code == "bad_signature"
    bare = Envelope(payloadType=PROPOSAL_TYPE, payload=forged.payload, signatures=[])
    with pytest.raises(wire.WireError) as exc:
        propose.verify_signed(SIGNERS, bare, p)
    assert exc.value.code == "bad_signature"


def test_only_an_agent_or_the_service_itself_may_sign_its_proposals():
    assert identity.proposer_problem(f"agent:{SVC}:a", SVC) is None
    assert identity.proposer_problem(f"service:{SVC}", SVC) is None
    for other in ("agent:other:a", "service:other", "check:ci", "operator:alice"):
        assert identity.proposer_problem(other, SVC) is not None, other


def _break(pid: str, draft) -> str:
    brk = audit.verify_chain(pid, chain(draft, chain_id=pid), TRUST)
    assert brk is not None and brk.seq == 0
    return brk.problem


def test_a_swapped_envelope_is_a_break_though_the_daemon_signed_the_trailer():
    """Only the chain and the trust store decide: even a trailer a daemon key signed (a
    compromised or buggy writer) cannot make a proposal look signed by someone else."""
    p = proposal()
    pid, draft = registration(p, signed(p), AGENT_A[0])
    # the same agent's valid envelope of other content
    swapped = msgspec.structs.replace(draft, envelope=signed(proposal(created_at=NOW - 5)))
    assert "not the one the trailer names" in _break(pid, swapped)
    # another agent's valid envelope of this very content, the ref left as it was
    assert "signer" in _break(pid, msgspec.structs.replace(draft, envelope=signed(p, AGENT_B[1])))
    # the ref edited to name the other agent, the envelope left as it was
    refs = tuple(r for r in draft.refs if not r.startswith("proposer:"))
    edited = msgspec.structs.replace(draft, refs=(*refs, ref("proposer", AGENT_B[0])))
    assert "signer" in _break(pid, edited)
    # a proposer with no envelope, and an envelope with no proposer
    assert "carries no signed act" in _break(pid, msgspec.structs.replace(draft, envelope=None))
    assert "signer" in _break(pid, msgspec.structs.replace(draft, refs=refs))


def test_a_registration_signed_by_a_key_not_trusted_then_is_a_break():
    p = proposal()
    pid, draft = registration(p, signed(p), AGENT_A[0])
    untrusting = dataclasses.replace(TRUST, history=evidence.History(
        fallback=evidence.KeySet(signers=signing.TrustStore.from_config(
            {AGENT_B[0]: b64(AGENT_B[1])}))))
    brk = audit.verify_chain(pid, chain(draft, chain_id=pid), untrusting)
    assert brk is not None and "unknown_key" in brk.problem


def test_a_foreign_agents_envelope_is_a_break():
    p = proposal()
    pid, draft = registration(p, signed(p, EVALUATOR[1]), EVALUATOR[0])
    assert "another service" in _break(pid, draft)


def test_a_signed_proposer_is_one_agent_an_unsigned_one_the_whole_service():
    p = proposal()
    mine = propose.proposer_of(p, AGENT_A[0])
    whole = propose.proposer_of(p)
    for kind in ("refine", "check", "metric"):
        assert identity.independent(kind, AGENT_B[0], mine, NOW, None, 1000)
        assert not identity.independent(kind, AGENT_A[0], mine, NOW, None, 1000)
        assert not identity.independent(kind, f"service:{SVC}", mine, NOW, None, 1000)
        assert not identity.independent(kind, AGENT_B[0], whole, NOW, None, 1000)
    # a world signal must still come from another service
    assert not identity.independent("world", AGENT_B[0], mine, NOW + 1, NOW, 1000)
    assert identity.independent("world", EVALUATOR[0], mine, NOW + 1, NOW, 1000)


def test_signed_by_the_service_itself_the_proposer_is_still_the_whole_service():
    p = proposal()
    whole = propose.proposer_of(p, f"service:{SVC}")
    assert not identity.independent("refine", AGENT_B[0], whole, NOW, None, 1000)
    assert identity.independent("refine", EVALUATOR[0], whole, NOW, None, 1000)


def test_a_declared_origin_service_keeps_its_agents_the_proposers_when_signed():
    p = proposal(origin=Origin(actor="mcp:x:1", service="evaluators"))
    mine = propose.proposer_of(p, AGENT_A[0])
    assert not identity.independent("refine", EVALUATOR[0], mine, NOW, None, 1000)
    assert identity.independent("refine", AGENT_B[0], mine, NOW, None, 1000)


def test_a_skills_holder_is_its_verified_proposer_when_signed():
    p = proposal()
    pid, draft = registration(p, signed(p), AGENT_A[0])
    practice = practice_on_chain(pid, chain(draft, chain_id=pid), SVC)
    assert practice.holder == AGENT_A[0]
    pid, draft = registration(p, None, None)
    practice = practice_on_chain(pid, chain(draft, chain_id=pid), SVC)
    assert practice.holder == holder_of(p) == f"service:{SVC}/{p.origin.actor}"
