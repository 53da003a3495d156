"""A commit: the trailers one pass decides, appended in one message (docs/protocol.md, "Audit
trailers"). What a reader takes for the trailers of a message, and that a record folded while
its commit was pending settles to the record a rebuild makes."""

from __future__ import annotations

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.client.chain_writer import trailers_of
from improved.core import audit, evidence, planner, propose, signing
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


def _signed_commit(n: int, key) -> list[dict]:
    """The bodies of a chain's first `n` trailers written as one commit, as the chain writer
    writes it: only the last signed."""
    p = make_proposal(**CASES[0])
    pid, dedup = propose.identify(p)
    record, draft = propose.register(p, pid, dedup, POLICY, NOW)
    trailers = [audit.seal(draft, record, NOW)]
    record = fold(record, trailers[0], PENDING_SEQ)
    while len(trailers) < n:
        step = planner.next_step(record, view(OPEN, NOW, dispatch=True, grant=True), POLICY,
                                 "improved:test")
        assert isinstance(step, planner.Commit), step
        trailers.append(audit.seal(step.draft, record, NOW))
        record = fold(record, trailers[-1], PENDING_SEQ)
    trailers[-1] = evidence.sign(trailers[-1], key)
    return [msgspec.to_builtins(t) for t in trailers]


def test_one_signature_on_a_commits_last_trailer_vouches_for_the_commit_and_no_more():
    key = Ed25519PrivateKey.generate()
    trust = evidence.DaemonWriters(frozenset({signing.keyid_of(signing.raw_public(
        key.public_key()))}))
    bodies = _signed_commit(3, key)
    pid = bodies[0]["proposal_id"]
    assert audit.verify_links(pid, bodies) is None
    assert audit.covering([7, 7, 7]) == [True, True, False]
    assert audit.covering([]) == [] and audit.covering([0, 0]) == [False, False]
    assert audit.verify_writers(pid, bodies, trust, [7, 7, 7]) is None
    # the same trailers read as messages of their own: the unsigned ones are nobody's
    assert audit.verify_writers(pid, bodies, trust, [7, 8, 8]).seq == 0
    assert audit.verify_writers(pid, bodies, trust, [7, 7, 8]).seq == 1
    assert audit.verify_writers(pid, bodies, trust, None).seq == 0  # no sequences: no commits
    # a commit whose last trailer is unsigned vouches for nothing
    unsigned = [*bodies[:2]]
    assert audit.verify_writers(pid, unsigned, trust, [7, 7]).seq == 1
    # streaming, one trailer at a time, as a verifier of the whole log reads it
    run = audit.ChainRun.start(pid, trust)
    for body, covered in zip(bodies, audit.covering([7, 7, 7]), strict=True):
        assert audit.verify_next(run, body, trust, 7, covered) is None
    run = audit.ChainRun.start(pid, trust)
    assert audit.verify_next(run, bodies[0], trust, 7, False).seq == 0
