"""Learn-back's verdict at review_after (improved/core/learnback.py): what asking the owning
service found — held, regressed, or unmeasured — decided without a broker."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from improved.core import apply, audit, learnback, propose
from improved.core.policy import Policy
from improved.core.record import ProposalRecord, replay
from improved.protocol.model import ApplyResult, MetricSnapshot
from tests.builders import NOW, TRIAGER, committed, make_proposal, said

POLICY = Policy(metric_direction={"latency_ms": "lower"})
finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e9, max_value=1e9)
tolerance = st.floats(min_value=0.0, max_value=1.0)
readings = st.one_of(
    st.builds(learnback.Reading, value=finite),
    st.builds(learnback.Reading, value=st.sampled_from([math.nan, math.inf, -math.inf])),
    st.builds(learnback.Reading, cause=st.text(min_size=1, max_size=600)),
    st.just(learnback.Reading()),
)


def applied(metric: str = "ctr", baseline: float = 0.5, review_after: int | None = NOW + 100,
            query: str | None = "metrics.ctr") -> ProposalRecord:
    """An L0 rank change, registered, dispatched and applied at NOW, under review."""
    snap = MetricSnapshot(metric=metric, baseline=baseline, review_after=review_after,
                          query=query)
    proposal = make_proposal(target_ref="rank:x", change_class="L0", proposal_data={"set": {
        "key": "x", "value": 1}}, metric_snapshot=snap)
    pid, dedup = propose.identify(proposal)
    record, draft = propose.register(proposal, pid, dedup, POLICY, NOW - 1)
    record = committed(record, draft, NOW - 1, 1)
    result = ApplyResult(ok=True, applied_id="a-1", inverse={"delete": "x"}, rollbackable=True)
    return committed(record, apply.transition(record, said(result), "policy:x"), NOW, 2)


@given(baseline=finite, value=finite, lower=st.booleans(), tol=tolerance)
def test_the_comparison_is_the_same_read_in_either_direction(baseline, value, lower, tol):
    """Lower-is-better on (b, v) is higher-is-better on (-b, -v)."""
    assert learnback.compare(baseline, value, lower, tol) \
        == learnback.compare(-baseline, -value, not lower, tol)


@given(baseline=finite, value=finite, worse=finite, lower=st.booleans(), tol=tolerance)
def test_a_value_no_worse_than_the_baseline_holds_and_worse_stays_regressed(
        baseline, value, worse, lower, tol):
    better_or_equal = value <= baseline if lower else value >= baseline
    if better_or_equal:
        assert learnback.compare(baseline, value, lower, tol) == "held"
    further = value + abs(worse) if lower else value - abs(worse)
    if learnback.compare(baseline, value, lower, tol) == "regressed":
        assert learnback.compare(baseline, further, lower, tol) == "regressed"


@given(reading=readings, tol=tolerance)
def test_without_a_finite_value_the_verdict_is_unmeasured_never_held(reading, tol):
    record = applied()
    verdict = learnback.judge(record, reading, Policy(regression_tolerance=tol))
    has_value = reading.value is not None and math.isfinite(reading.value)
    assert (verdict == "unmeasured") == (not has_value)
    draft = learnback.measured(record, verdict, reading, None, TRIAGER)
    after = committed(record, draft, NOW + 200)
    assert draft.verdict == verdict and after.measured == verdict
    assert len(draft.reason) <= 500 and "measured_by:asked svc" in draft.refs
    assert any(r.startswith("value:") for r in draft.refs) == has_value
    assert any(r.startswith("cause:") for r in draft.refs) == (not has_value)
    trailer = audit.seal(draft, record, NOW + 200)
    rebuilt = replay(record, [trailer], [3])
    assert (rebuilt.measured, rebuilt.measured_value) == (verdict, after.measured_value)
    summary = learnback.summary(rebuilt, NOW + 200)
    assert summary.measured == verdict and summary.value == after.measured_value


@pytest.mark.parametrize(("metric", "value", "verdict"), [
    ("ctr", 0.49, "held"),  # within 5 % of 0.5
    ("ctr", 0.47, "regressed"),
    ("ctr", 0.9, "held"),
    ("latency_ms", 0.52, "held"),  # lower is better for this one
    ("latency_ms", 0.6, "regressed"),
    ("latency_ms", 0.1, "held"),
])
def test_the_policy_direction_and_tolerance_decide(metric, value, verdict):
    record = applied(metric=metric)
    assert learnback.judge(record, learnback.Reading(value=value), POLICY) == verdict


def test_the_request_is_due_once_at_review_after_and_never_after_the_verdict():
    record = applied()
    assert learnback.awaiting(record) == NOW + 100
    assert learnback.due(record, NOW + 99) is None
    request = learnback.due(record, NOW + 100)
    assert request is not None and (request.metric, request.query) == ("ctr", "metrics.ctr")
    after = committed(record, learnback.measured(record, "unmeasured",
                                                 learnback.Reading(cause="x"), None, TRIAGER))
    assert learnback.due(after, NOW + 100) is None and learnback.awaiting(after) is None
    assert learnback.awaiting(applied(review_after=None)) is None
    no_query = learnback.due(applied(query=None), NOW + 100)
    assert no_query is not None and no_query.query is None


@pytest.mark.parametrize(("reply", "value", "cause"), [
    (b'{"value": 3}', 3.0, None),
    (b'{"value": -0.25}', -0.25, None),
    (b'{"value": 1e400}', None, "malformed reply: Number out of range"),
    (b'{"value": true}', None, "malformed reply: Expected `float`, got `bool`"),
    (b'{"value": 1, "unit": "ms"}', None, "malformed reply: Object contains unknown field"),
    (b"[]", None, "malformed reply"),
    (b"\xff", None, "malformed reply: JSON is malformed"),
    (b'{"error": {"code": "unmeasurable", "message": "no such key"}}', None,
     "could not measure: no such key"),
    (b'{"error": "plain"}', None, "malformed reply"),
])
def test_a_reply_is_a_value_or_a_one_line_cause(reply, value, cause):
    from improved.core.replies import parse_measure_reply

    reading = parse_measure_reply(reply)
    assert reading.value == value
    if cause is None:
        assert reading.cause is None
    else:
        assert reading.cause is not None and cause in reading.cause
        assert "\n" not in reading.cause and len(reading.cause) <= 300


@given(data=st.binary(max_size=64))
def test_no_reply_bytes_make_the_parser_raise(data):
    from improved.core.replies import parse_measure_reply

    reading = parse_measure_reply(data)
    assert (reading.value is None) != (reading.cause is None)


async def test_the_sdk_answers_a_bad_request_or_a_failing_handler_with_an_error_reply():
    from improved.client.sdk import MeshClient
    from improved.protocol.model import ErrorReply, MeasureReply

    class Offline:  # no request leaves: `measure` only turns bytes into a reply
        def jetstream(self, **_):
            return None

    client = MeshClient(Offline(), "svc")  # type: ignore[arg-type]

    async def ok(request) -> float:
        return 2

    async def cannot(request) -> float:
        raise LookupError("no metric ctr here")

    async def junk(request):
        return float("nan")

    good = b'{"proposal_id": "' + b"a" * 64 + b'", "metric": "ctr", "query": "k"}'
    assert await client.measure(good, ok) == MeasureReply(value=2.0)
    refused = await client.measure(b'{"metric": "ctr"}', ok)
    assert isinstance(refused, ErrorReply) and refused.error.code == "missing_field"
    failed = await client.measure(good, cannot)
    assert isinstance(failed, ErrorReply) and failed.error.message == "no metric ctr here"
    nan = await client.measure(good, junk)
    assert isinstance(nan, ErrorReply) and "not a finite number" in nan.error.message


def test_the_measurement_index_gets_the_entry_at_the_apply_and_a_tombstone_at_the_verdict():
    record = applied()
    registered = record.replace(status="pending", outcome=None)
    write = learnback.due_change(registered, record, republish=False)
    assert write is not None and write.entry is not None
    assert (write.entry.proposal_id, write.entry.review_after) == (record.proposal_id, NOW + 100)
    assert learnback.due_change(record, record, republish=False) is None  # nothing moved
    assert learnback.due_change(record, record, republish=True) == write  # a lost write mended
    after = committed(record, learnback.measured(record, "held", learnback.Reading(value=0.6),
                                                 None, TRIAGER))
    gone = learnback.due_change(record, after, republish=False)
    assert gone is not None and gone.entry is None
    assert learnback.due_change(after, after, republish=True) == gone  # the tombstone again


def test_a_proposal_without_review_after_never_costs_a_write():
    record = applied(review_after=None)
    for before in (None, record.replace(status="pending", outcome=None), record):
        for republish in (False, True):
            assert learnback.due_change(before, record, republish) is None


def test_a_proposal_is_closed_once_nothing_more_is_awaited_of_it():
    """What lets a proposal's retained records leave the bus (records_ttl_days)."""
    from improved.core.record import closed

    watched = applied()
    assert not closed(watched)  # its measurement is still to make
    measured = committed(watched, learnback.measured(watched, "held",
                                                     learnback.Reading(value=0.6), None, TRIAGER))
    assert closed(measured)
    assert closed(applied(review_after=None))
    pending = watched.replace(status="pending", outcome=None)
    assert not closed(pending) and not closed(pending.replace(status="approved"))
    assert closed(pending.replace(superseded_by="f" * 64))
    for status in ("rejected", "expired", "rolled_back"):
        assert closed(watched.replace(status=status))


def test_a_dedup_head_may_expire_once_it_names_a_closed_proposal():
    """What lets a dedup key leave the bucket: its head names this very proposal, closed."""
    from improved.protocol.model import DedupHead

    watched = applied()
    mine = DedupHead(proposal_id=watched.proposal_id, created_at=watched.proposal.created_at)
    newer = DedupHead(proposal_id="f" * 64, created_at=watched.proposal.created_at + 1)
    assert not propose.head_may_expire(watched, mine)  # its measurement is still to make
    done = applied(review_after=None)
    done_head = DedupHead(proposal_id=done.proposal_id, created_at=done.proposal.created_at)
    assert propose.head_may_expire(done, done_head)
    assert not propose.head_may_expire(done, newer)  # a newer head is never this one's
    assert not propose.head_may_expire(done, None)  # nothing to give a TTL
    for status in ("rejected", "expired", "rolled_back"):
        assert propose.head_may_expire(watched.replace(status=status), mine)
    pending = watched.replace(status="pending", outcome=None)
    assert not propose.head_may_expire(pending, mine)
    assert not propose.head_may_expire(pending.replace(status="approved"), mine)
