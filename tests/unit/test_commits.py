"""A commit: the trailers one pass decides, appended in one message (docs/protocol.md, "Audit
trailers"). What a reader takes for the trailers of a message, and that a record folded while
its commit was pending settles to the record a rebuild makes."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.client.chain_writer import trailers_of
from improved.core import audit, planner, propose
from improved.core.audit import trailers_in
from improved.core.policy import Policy
from improved.core.record import PENDING_SEQ, fold, settle
from improved.protocol.model import TrailerCommit, to_json
from tests.builders import NOW, make_proposal
from tests.unit.test_planner import CASES, OPEN, view

POLICY = Policy()


def _trailer(n: int) -> dict:
    return {"proposal_id": "p", "seq": n, "hash": f"h{n}"}


@pytest.mark.parametrize("body,expected", [
    ({"trailers": [_trailer(0), _trailer(1)]}, [_trailer(0), _trailer(1)]),
    (_trailer(0), [_trailer(0)]),
    # what is no commit stays one body, which no verifier takes for a trailer
    ({"trailers": [_trailer(0)]}, [{"trailers": [_trailer(0)]}]),
    ({"trailers": []}, [{"trailers": []}]),
    ({"trailers": "x"}, [{"trailers": "x"}]),
    ({"trailers": [_trailer(0), _trailer(1)], "hash": "h"},
     [{"trailers": [_trailer(0), _trailer(1)], "hash": "h"}]),
    ([_trailer(0), _trailer(1)], [[_trailer(0), _trailer(1)]]),
    (None, [None]),
])
def test_a_message_carries_one_trailer_or_a_commit_of_several(body, expected):
    assert trailers_in(body) == expected


def test_no_commit_is_a_trailer_and_no_trailer_verifies_as_a_commit():
    """A commit of one trailer, or one inside another, is no trailer a chain can hold."""
    t = _trailer(0)
    for body in ({"trailers": [t]}, {"trailers": [{"trailers": [t, t]}, t]}):
        brk = audit.verify_links("p", trailers_in(body))
        assert brk is not None and brk.seq == 0


def _pass(record, dispatch: bool):
    """The trailers one pass decides in a row from `record`, as the engine's commits do:
    (the record folded at PENDING_SEQ, the trailers)."""
    trailers = []
    for _ in range(planner_steps := 6):
        step = planner.next_step(record, view(OPEN, NOW, dispatch=dispatch, grant=True),
                                 POLICY, "improved:test")
        if not isinstance(step, planner.Commit):
            break
        trailer = audit.seal(step.draft, record, NOW)
        trailers.append(trailer)
        record = fold(record, trailer, PENDING_SEQ)
    assert len(trailers) < planner_steps
    return record, trailers


@settings(max_examples=100, deadline=None)
@given(case=st.sampled_from(CASES), seq=st.integers(1, 10**9), dispatch=st.booleans())
def test_a_record_folded_while_its_commit_was_pending_settles_to_the_rebuilt_one(
        case, seq, dispatch):
    p = make_proposal(**case)
    pid, dedup = propose.identify(p)
    start, draft = propose.register(p, pid, dedup, POLICY, NOW - 1)
    first = audit.seal(draft, start, NOW - 1)
    record, trailers = _pass(fold(start, first, PENDING_SEQ), dispatch)
    commit = [first, *trailers]
    rebuilt = propose.rebuild_record(commit, [seq] * len(commit), POLICY)
    assert settle(record, seq) == rebuilt
    assert settle(rebuilt, seq + 1) == rebuilt  # a settled record is left alone
    # the message a commit is, read back: the same trailers, in order
    body = to_json(commit[0] if len(commit) == 1 else TrailerCommit(trailers=commit))
    assert trailers_of(body) == commit
    assert [msgspec.convert(b, type=type(commit[0]))
            for b in trailers_in(msgspec.json.decode(body))] == commit
