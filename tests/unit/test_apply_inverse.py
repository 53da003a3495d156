"""What the daemon records as an apply's inverse: only what a rollback can replay is marked
rollbackable (DESIGN §4; OMS §3.6). A plan that names no grain to supersede cannot be replayed."""

from __future__ import annotations

import pytest

from improved.core import apply, propose
from improved.core.policy import Policy
from improved.protocol.model import ApplyResult
from tests.builders import NOW, make_proposal

# The OMS Recommendation grain's own example batch (oms-recommendation-grain.txt).
SEED_BATCH = ('SUPERSEDE facts WHERE subject = "user:john-smith" AND relation = '
              '"preferred_activity" SET object = "morning_run_5k" REASON "merge 7 duplicate '
              'extractions"')
ADDRESS = "sha256:" + "ab" * 32


def record(**over):
    fields = dict(target_ref="entity:fitness/user:john-smith", proposal_data=None,
                  proposal_cal=SEED_BATCH, namespace="agent:recommendations")
    fields.update(over)
    p = make_proposal(**fields)
    pid, dedup = propose.identify(p)
    rec, _ = propose.register(p, pid, dedup, Policy(), NOW)
    return rec


def test_the_fallback_cal_inverse_of_the_seed_batch_is_recorded_but_not_rollbackable():
    """The daemon cannot know which grain the batch wrote: its plan says `target: null`, so a
    rollback could not run it. It is kept for the record, and never offered as a rollback."""
    inverse, rollbackable = apply.derived_inverse(record(), ApplyResult(ok=True, applied_id="x"))
    [step] = inverse["cal_inverse"]
    assert step["op"] == "supersede" and step["target"] is None
    assert rollbackable is False


def test_the_appliers_own_inverse_is_recorded_as_the_applier_says():
    plan = {"cal_inverse": [{"op": "retract", "target": ADDRESS,
                             "invalidation_type": "retraction"}], "namespace": "ns"}
    result = ApplyResult(ok=True, applied_id="x", inverse=plan, rollbackable=True)
    assert apply.derived_inverse(record(), result) == (plan, True)


@pytest.mark.parametrize("inverse", [None, {"cal_inverse": [{"op": "retract", "target": None}]}])
def test_rollbackable_with_nothing_replayable_is_recorded_not_rollbackable(inverse):
    """An applier that says rollbackable but hands back no inverse, or a CAL plan with a
    null target, gives a rollback nothing to send: recorded not rollbackable."""
    result = ApplyResult(ok=True, applied_id="x", inverse=inverse, rollbackable=True)
    _, rollbackable = apply.derived_inverse(record(), result)
    assert rollbackable is False


def test_a_proposal_data_inverse_is_as_the_service_says():
    rec = record(proposal_cal=None, proposal_data={"set": {"key": "k", "value": 1}},
                 target_ref="rank:k")
    result = ApplyResult(ok=True, applied_id="x", inverse={"delete": "k"}, rollbackable=True)
    assert apply.derived_inverse(rec, result) == ({"delete": "k"}, True)
    refused = ApplyResult(ok=False, error="no", rollbackable=True)
    assert apply.derived_inverse(rec, refused) == (None, False)
