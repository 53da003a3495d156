"""OMS interop (issue 19, item 9): a Recommendation JSON as OMS writes it — with its `type` and
its computed `dedup_key` — is a proposal like any other, with the same id as without them; a
`dedup_key` that is not the computed one is refused naming the computed one."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.core import propose
from improved.protocol import canonical, wire

LIMIT = 256 * 1024

# The example of the seed (../shared/seeds/oms-recommendation-grain.txt, "A Complete
# Recommendation Grain"), as it is, plus the four fields the mesh's contract requires of every
# proposal (DESIGN §3.2) and that OMS does not know.
SEED = {
    "type": "recommendation",
    "target_ref": "entity:fitness:preferences/user:john-smith",
    "analyzer": {"id": "curator.duplicate_sweep/1",
                 "params": {"window": "90d", "min_cluster": 2}},
    "summary": {"template_id": "merge_duplicate_facts",
                "args": {"count": 7, "subject": "user:john-smith"}},
    "dedup_key": "4f8c1ba97d2e5c3016a8b4f9e0d7c25184be3a6f90c1d7e2b5a84f3c0e6d219e",
    "proposal_cal": "SUPERSEDE facts WHERE subject = \"user:john-smith\" AND relation = "
                    "\"preferred_activity\" SET object = \"morning_run_5k\" REASON \"merge 7 "
                    "duplicate extractions\"",
    "severity": "low",
    "metric_snapshot": {"metric": "duplicate_fact_ratio", "baseline": 0.14, "n": 51,
                        "window": "90d",
                        "query": "COUNT facts WHERE namespace = \"fitness:preferences\"",
                        "review_after": 1742601600000},
    "derived_from": ["mg:sha256:a1b2c3...", "mg:sha256:d4e5f6...", "mg:sha256:7890ab..."],
    "evidence_query": "RECALL facts WHERE subject = \"user:john-smith\" AND relation = "
                      "\"preferred_activity\"",
    "confidence": 0.83,
    "importance": 0.4,
    "valid_to": 1745193600000,
    "namespace": "agent:recommendations",
    "created_at": 1740034800000,
    # the mesh's own
    "service": "curator", "change_class": "L2", "scope": "knowledge",
    "origin": {"actor": "curator:run-1", "service": "curator"},
}
COMPUTED = canonical.dedup_key("curator.duplicate_sweep/1",
                               "entity:fitness:preferences/user:john-smith", "cal")


def ident(obj: dict) -> tuple[str, str]:
    return propose.identify(propose.validate(json.dumps(obj).encode(), None, LIMIT))


def without(obj: dict, *names: str) -> dict:
    return {k: v for k, v in obj.items() if k not in names}


def test_the_seeds_own_dedup_key_is_refused_naming_the_computed_one():
    """The seed's example key is not what rule 5 computes for its own fields: refused, and
    the reply names the key to send."""
    assert SEED["dedup_key"] != COMPUTED
    with pytest.raises(wire.WireError) as info:
        ident(SEED)
    err = info.value
    assert (err.code, err.field) == (wire.INVALID_VALUE, "dedup_key")
    assert COMPUTED in err.message and "\n" not in err.message


def test_the_seed_example_with_its_computed_key_is_accepted_and_keeps_its_id():
    pid, dedup = ident({**SEED, "dedup_key": COMPUTED})
    assert dedup == COMPUTED
    assert ident(without(SEED, "dedup_key", "type")) == (pid, dedup)
    assert ident(without(SEED, "dedup_key")) == (pid, dedup)
    assert ident({**without(SEED, "type"), "dedup_key": COMPUTED}) == (pid, dedup)


def test_the_grain_fields_are_dropped_from_the_proposal():
    """What is stored, sent in an ApplyOrder and carried on the chain is one form whatever
    the publisher wrote."""
    p = propose.validate(json.dumps({**SEED, "dedup_key": COMPUTED}).encode(), None, LIMIT)
    assert p.type is None and p.dedup_key is None
    assert p == propose.validate(json.dumps(without(SEED, "dedup_key", "type")).encode(),
                                 None, LIMIT)


@pytest.mark.parametrize(("value", "code"), [("fact", wire.INVALID_VALUE),
                                             (12, wire.INVALID_TYPE)])
def test_a_type_other_than_recommendation_is_refused(value, code):
    with pytest.raises(wire.WireError) as info:
        ident({**without(SEED, "dedup_key"), "type": value})
    assert (info.value.code, info.value.field) == (code, "type")


def test_a_dedup_key_of_the_wrong_type_is_refused():
    with pytest.raises(wire.WireError) as info:
        ident({**SEED, "dedup_key": 7})
    assert (info.value.code, info.value.field) == (wire.INVALID_TYPE, "dedup_key")


families = st.from_regex(r"[A-Za-z0-9_-]{1,10}(\.[A-Za-z0-9_-]{1,10}){1,2}", fullmatch=True)
targets = st.from_regex(r"(skill|doc|config|entity):[a-z0-9/._-]{1,30}", fullmatch=True)
bodies = st.sampled_from([
    ("proposal_data", {"skill": {"name": "greet", "description": "hi"}}),
    ("proposal_cal", 'ADD fact SET subject = "a" SET relation = "b" SET object = "c" '
                     'REASON "r"'),
    ("proposal_edit", {"format": "unified", "base_digest": "sha256:00", "diff": "--- a\n"}),
])


def proposal(family: str, major: int, target: str, body: tuple[str, object]) -> dict:
    return {"service": "svc", "target_ref": target, "change_class": "L1",
            "scope": "knowledge", "origin": {"actor": "mcp:aaa:1", "service": "svc"},
            "analyzer": {"id": f"{family}/{major}"},
            "summary": {"template_id": "t", "args": {}}, "created_at": 1_700_000_000_000,
            body[0]: body[1]}


@settings(max_examples=200, deadline=None)
@given(family=families, major=st.integers(0, 99), target=targets, body=bodies)
def test_the_computed_key_is_accepted_and_changes_nothing(family, major, target, body):
    obj = proposal(family, major, target, body)
    pid, dedup = ident(obj)
    assert ident({**obj, "dedup_key": dedup}) == (pid, dedup)
    assert ident({**obj, "dedup_key": dedup, "type": "recommendation"}) == (pid, dedup)


@settings(max_examples=200, deadline=None)
@given(family=families, major=st.integers(0, 99), target=targets, body=bodies,
       other=st.text(max_size=80))
def test_any_other_key_is_refused_naming_the_computed_one(family, major, target, body, other):
    obj = proposal(family, major, target, body)
    _, dedup = ident(obj)
    if other == dedup:
        return
    with pytest.raises(wire.WireError) as info:
        ident({**obj, "dedup_key": other})
    assert (info.value.code, info.value.field) == (wire.INVALID_VALUE, "dedup_key")
    assert dedup in info.value.message
