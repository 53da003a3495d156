"""Independence from verified identities only (SPEC 09 §5, core/identity.py): a string a
sender writes itself — an actor, a session, a service name in the body — never makes a signal
independent; only who verifiably sent it does (a trusted key, or a subject the deployment binds
to its service)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from improved.core import identity
from improved.core.identity import Proposer, independent, measures, same_party

WINDOW = 3_600_000
APPLIED = 10_000


def indep(emitter: str, kind: str = "check", proposer: str | None = None,
          at: int = APPLIED + 5, applied: int | None = APPLIED) -> bool:
    return independent(kind, emitter, Proposer("ranking", "ranking", proposer), at, applied,
                       WINDOW)


def test_an_unverified_emitter_is_never_independent():
    """Every disguise the proposer may write — its uuid upper-cased, another uuid, a session
    suffix, a bare service name, `operator:alice` — arrives unverified (or as its own
    service's subject), whatever the body says."""
    for kind in ("refine", "check", "world", "metric"):
        assert not indep(identity.UNVERIFIED, kind)


def test_the_proposing_service_and_its_agents_are_the_proposer_of_an_unsigned_proposal():
    assert not indep("service:ranking")  # a world signal claiming `billing`, sent on its subject
    assert not indep("agent:ranking:a")
    assert not indep("agent:ranking:b")  # another agent: unprovable for an unsigned proposal


def test_a_signed_proposal_makes_another_agent_of_the_same_service_independent():
    assert indep("agent:ranking:b", proposer="agent:ranking:a")
    assert not indep("agent:ranking:a", proposer="agent:ranking:a")
    assert not indep("service:ranking", proposer="agent:ranking:a")


@pytest.mark.parametrize("emitter", ["check:ci", "operator:alice", "agent:billing:x",
                                     "service:billing"])
def test_verified_identities_other_than_the_proposer_are_independent(emitter):
    assert indep(emitter)


def test_a_world_signal_needs_another_service_and_the_effect_window():
    assert indep("service:billing", "world")
    assert indep("agent:billing:x", "world")
    assert not indep("check:ci", "world")  # a check is no downstream service
    assert not indep("service:billing", "world", applied=None)
    assert not indep("service:billing", "world", at=APPLIED - 1)
    assert not indep("service:billing", "world", at=APPLIED + WINDOW + 1)
    for at in (APPLIED, APPLIED + WINDOW):
        assert indep("service:billing", "world", at=at)


def test_only_the_owner_or_a_signed_check_measures():
    assert measures("service:ranking", "ranking")
    assert measures("check:latency-probe", "ranking")
    assert not measures(identity.UNVERIFIED, "ranking")
    assert not measures("service:billing", "ranking")
    assert not measures("agent:ranking:a", "ranking")  # an agent's reading is evidence only


@given(st.text(max_size=40))
def test_no_identity_string_outside_the_forms_is_the_proposer_or_counts(text):
    """Whatever an emitter is called, it is the proposer exactly when it belongs to the
    proposing service (or is the signing principal), never by accident of spelling."""
    belongs = text == "service:ranking" or identity.service_of(text) == "ranking"
    assert same_party(text, Proposer("ranking")) == belongs


def test_the_service_an_origin_declares_is_the_proposer_too():
    """A declared string can only make evidence less independent, never more."""
    proposer = Proposer("ranking", "agentd")
    assert same_party("agent:agentd:x", proposer) and same_party("service:agentd", proposer)
    assert not independent("check", "service:agentd", proposer, 5, None, WINDOW)


def test_an_origin_claiming_an_operator_is_recorded_as_what_it_verifiably_is():
    """An unsigned proposal whose origin says `operator:alice` is a service's proposal: its
    registration is `rec:agent`, never `human`."""
    from improved.core import propose
    from improved.core.policy import Policy
    from improved.protocol.model import Origin
    from tests.builders import make_proposal

    p = make_proposal(origin=Origin(actor="operator:alice", service="ranking"))
    pid, dedup = propose.identify(p)
    _, draft = propose.register(p, pid, dedup, Policy(), 1_000)
    assert draft.observer_type == "rec:agent" and draft.actor == "operator:alice"
