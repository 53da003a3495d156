"""The class a schema store says it found: recorded from its ApplyResult on the `applied`
trailer and in the ApplyOutcome, read back by a replay, never decided on; a value outside the
set makes the reply invalid, as any bad field does; and a classify reply read without
crashing, whatever a service answers."""

from __future__ import annotations

import msgspec
import pytest

from improved.cli.queries import classified
from improved.core import apply, audit, propose
from improved.core.policy import Policy
from improved.core.record import replay
from improved.core.replies import parse_apply_reply
from improved.core.trailers import refs_of
from improved.protocol.model import ApplyReport, ApplyResult, ClassifyReply, to_json
from tests.builders import NOW, committed, make_proposal, said


def record():
    p = make_proposal(target_ref="schema:svc", proposal_cal=None,
                      proposal_data={"artefacts": {"orders": "{}"}})
    pid, dedup = propose.identify(p)
    rec, _ = propose.register(p, pid, dedup, Policy(), NOW)
    return rec


@pytest.mark.parametrize("kind", ["forward", "breaking", "reversal"])
def test_the_class_goes_on_the_applied_trailer_and_in_the_outcome_and_replays(kind):
    rec = record()
    result = ApplyResult(ok=True, applied_id="manifest@3", schema_class=kind)
    draft = apply.transition(rec, said(result), "operator:alice")
    after = committed(rec, draft, NOW + 1)
    assert after.outcome is not None and after.outcome.schema_class == kind
    assert f"schema_class:{kind}" in draft.refs
    trailer = audit.seal(draft, rec, NOW + 1)
    rebuilt = replay(rec, [trailer], [9])
    assert rebuilt.outcome == after.outcome


def test_without_a_class_nothing_is_added_and_a_refusal_carries_none():
    rec = record()
    draft = apply.transition(rec, said(ApplyResult(ok=True, applied_id="x")), "p")
    assert "schema_class" not in refs_of(draft)
    draft = apply.transition(rec, said(ApplyResult(ok=False, error="no",
                                                   schema_class="breaking")), "p")
    after = committed(rec, draft)
    assert after.outcome.schema_class is None and "schema_class" not in refs_of(draft)


def test_older_services_and_chains_stay_valid():
    assert parse_apply_reply(b'{"ok": true, "applied_id": "a"}') == ApplyResult(
        ok=True, applied_id="a")
    assert msgspec.json.decode(b'{"ok": true, "schema_class": null}',
                               type=ApplyResult).schema_class is None


def test_a_class_outside_the_set_makes_the_reply_invalid_in_one_line():
    """As for any bad field of an ApplyResult: a failed result, recorded once, naming why."""
    result = parse_apply_reply(b'{"ok": true, "applied_id": "a", "schema_class": "backward"}')
    assert result is not None and result.ok is False
    assert result.error.startswith("the service answered with something that is not an "
                                   "ApplyResult: ")
    assert "$.schema_class" in result.error and "\n" not in result.error
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"proposal_id": "' + b"a" * 64 + b'", "service": "svc", '
                            b'"ok": true, "schema_class": "sideways"}', type=ApplyReport)


def test_a_classify_reply_is_read_whatever_the_service_answers():
    good = to_json(ClassifyReply(class_="breaking", reason="orders at /x: retyped"))
    assert msgspec.json.decode(good) == {"class": "breaking", "reason": "orders at /x: retyped"}
    assert classified(good) == {"class": "breaking", "reason": "orders at /x: retyped"}
    refused = classified(b'{"error": {"code": "invalid_value", "message": "not a schema"}}')
    assert refused == {"class": "unknown",
                       "reason": "the service could not classify it: not a schema"}
    for bad in (b"", b"\xff", b"[]", b"null", b'{"class": "sideways", "reason": "x"}',
                b'{"class": "forward"}', b'{"class": "forward", "reason": 3}',
                b'{"error": "flat"}', b'{"class": "forward", "reason": "' + b"r" * 600 + b'"}'):
        found = classified(bad)
        assert found["class"] == "unknown", bad
        assert found["reason"].startswith("the service's answer is not a classification (")
        assert "\n" not in found["reason"]
