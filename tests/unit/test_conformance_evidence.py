"""The conformance kit's judgements of what a service emits and what its swaps did, pure: the
sample proposal read with the daemon's decoder (naming the field that is wrong), the
all-or-none window over a key's revisions, and an applied L4's revert_proposal_id on its
chain."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.client.conformance_evidence import (
    Revision,
    emitted_problem,
    sample_problem,
    window_problem,
)
from improved.core import apply, audit, propose
from improved.core.boundary import Attested
from improved.core.policy import Policy
from improved.protocol.model import ApplyResult, to_json
from tests.builders import NOW, committed, l4

SVC = "deploy"


def test_a_valid_sample_has_its_id_and_a_bad_one_names_the_field():
    good = l4()
    problem, pid = sample_problem(to_json(good), SVC)
    assert problem is None and pid == propose.identify(good)[0]
    wrong = msgspec.to_builtins(good) | {"change_class": "L9"}
    problem, pid = sample_problem(to_json(wrong), SVC)
    assert pid is None and problem.startswith("its sample proposal is invalid at change_class")
    problem, _ = sample_problem(to_json(msgspec.to_builtins(good) | {"service": "other"}), SVC)
    assert "subject_mismatch" in problem
    problem, _ = sample_problem(to_json(msgspec.to_builtins(l4(lkg=None))), SVC)
    assert "would be rejected invalid" in problem and "lkg" in problem


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=300),
                 st.dictionaries(st.sampled_from(["service", "change_class", "lkg", "x"]),
                                 st.one_of(st.none(), st.integers(), st.text(max_size=5)))
                 .map(lambda d: to_json(msgspec.to_builtins(l4()) | d))))
def test_any_bytes_are_either_a_proposal_or_one_named_problem(data):
    problem, pid = sample_problem(data, SVC)
    assert (problem is None) != (pid is None)


def rev(seq, pid, **value):
    return Revision(seq, pid, value)


def test_a_proposal_swapping_its_artefacts_in_one_write_is_all_or_none():
    history = [rev(1, None, a="1", b="1"), rev(2, "p" * 64, a="2", b="2"),
               rev(3, "p" * 64, a="1", b="1"),  # its health window failed: back, whole
               rev(4, "q" * 64, a="3", b="1")]
    assert window_problem(history) == (3, None)
    assert window_problem(history[:1]) == (0, None)  # nothing applied: nothing judged


def test_a_proposal_writing_one_artefact_at_a_time_lets_a_reader_see_a_mix():
    judged, problem = window_problem([rev(1, None, a="1", b="1"), rev(2, "p" * 64, a="2", b="1"),
                                      rev(3, "p" * 64, a="2", b="2")])
    assert judged == 2 and "changed ['a'] in revision 2 and ['b'] in revision 3" in problem
    _, problem = window_problem([rev(1, None, a="1"), Revision(2, "p" * 64, "a=2")])
    assert problem.startswith("revision 2 is")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from("abcd"), st.sampled_from("0123"), min_size=1),
                min_size=1, max_size=8))
def test_whole_swaps_are_never_a_mix_and_a_split_one_always_is(swaps):
    state, history = {"a": "0"}, [rev(1, None, a="0")]
    for i, swap in enumerate(swaps):
        state = {**state, **swap}
        history.append(Revision(i + 2, f"{i:064x}", dict(state)))
    assert window_problem(history)[1] is None
    last = history[-1]
    changed = [k for k in last.value if history[-2].value.get(k) != last.value[k]]
    if len(changed) >= 2:  # the same change written in two steps under one id
        half = {**history[-2].value, changed[0]: last.value[changed[0]]}
        split = [*history[:-1], Revision(90, last.proposal_id, half),
                 Revision(91, last.proposal_id, last.value)]
        assert "saw a mix" in window_problem(split)[1]


def chain_of(result: ApplyResult, revert_id: str | None) -> list[dict]:
    p = l4(service=SVC)
    pid, dedup = propose.identify(p)
    record, draft = propose.register(p, pid, dedup, Policy(), NOW)
    bodies = [msgspec.to_builtins(audit.seal(draft, record, NOW))]
    record = committed(record, draft).replace(status="approved", revert_id=revert_id)
    applied = apply.transition(record, Attested(result, f"service:{SVC}", "signature"),
                               "operator:alice")
    bodies.append(msgspec.to_builtins(audit.seal(applied, record, NOW)))
    return bodies


def test_an_applied_l4_must_name_its_reversal():
    assert emitted_problem(chain_of(ApplyResult(ok=True, applied_id="m@2"), "r" * 64)) == (
        True, None)
    is_l4, problem = emitted_problem(chain_of(ApplyResult(ok=True, applied_id="m@2"), None))
    assert is_l4 and problem.endswith("emitted no revert_proposal_id")
    # a failed apply emits none, and is not an applied L4
    assert emitted_problem(chain_of(ApplyResult(ok=False, error="no"), None)) == (False, None)
    assert emitted_problem([None, {"junk": 1}]) == (False, None)
