"""Schema discipline's classifier (SPEC 09 §7.4): the classes on the usual changes, one-line
reasons with a JSON pointer, conservatism on what it does not understand, and — by property —
that `forward` never loses an instance the current schema admits."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.core import schemas
from improved.core.schemas import classify, subset, valid

ORDER = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "order",
    "type": "object",
    "properties": {
        "sku": {"type": "string", "maxLength": 16},
        "qty": {"type": "integer", "minimum": 1, "maximum": 100},
        "state": {"enum": ["new", "paid"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["sku", "qty"],
    "additionalProperties": False,
}


def changed(edit) -> dict[str, Any]:
    new = copy.deepcopy(ORDER)
    edit(new)
    return new


FORWARD = {
    "an optional property on a closed object": lambda s: s["properties"].update(
        note={"type": "string"}),
    "a widened enum": lambda s: s["properties"]["state"]["enum"].append("shipped"),
    "a relaxed maximum": lambda s: s["properties"]["qty"].update(maximum=1000),
    "a dropped minimum": lambda s: s["properties"]["qty"].pop("minimum"),
    "a widened type": lambda s: s["properties"]["sku"].update(type=["string", "null"]),
    "a required property made optional": lambda s: s["required"].remove("qty"),
    "an object opened": lambda s: s.pop("additionalProperties"),
    "a longer maxLength": lambda s: s["properties"]["sku"].update(maxLength=64),
    "integer widened to number": lambda s: s["properties"]["qty"].update(type="number"),
    "only annotations": lambda s: s.update(description="an order", title="Order"),
}
BACKWARD = {
    "a new required property": (lambda s: s["required"].append("state"), "/required",
                                "state became required"),
    "a narrowed enum": (lambda s: s["properties"]["state"]["enum"].remove("paid"),
                        "/properties/state", 'no longer admits "paid"'),
    "a lowered maximum": (lambda s: s["properties"]["qty"].update(maximum=10),
                          "/properties/qty/maximum", "lowered to 10 (was maximum 100)"),
    "a shorter array": (lambda s: s["properties"]["tags"].update(maxItems=2),
                        "/properties/tags/maxItems", "lowered to 2 (was 4)"),
    "a property removed from a closed object": (
        lambda s: s["properties"].pop("tags"), "/properties/tags",
        "removed (additionalProperties: false)"),
}
BREAKING = {
    "a retyped property": (lambda s: s["properties"]["qty"].update(type="string"),
                           "/properties/qty/type", "no longer admits integer"),
    "a keyword it does not understand": (
        lambda s: s["properties"]["sku"].update(pattern="^[A-Z]+$"), "/properties/sku",
        "uses pattern, which the classifier does not understand"),
    "a $ref": (lambda s: s["properties"].update(sku={"$ref": "#/$defs/sku"}),
               "/properties/sku", "uses $ref, which the classifier does not understand"),
}


@pytest.mark.parametrize("name", FORWARD)
def test_widening_changes_are_forward_compatible(name):
    assert classify(ORDER, changed(FORWARD[name])) == schemas.Change("forward")


@pytest.mark.parametrize("name", BACKWARD)
def test_changes_that_only_take_away_are_backward_and_name_the_first_difference(name):
    edit, pointer, what = BACKWARD[name]
    change = classify(ORDER, changed(edit))
    assert (change.kind, change.pointer, change.what) == ("backward", pointer, what)
    assert change.line() == f"{pointer}: {what}"


@pytest.mark.parametrize("name", BREAKING)
def test_changes_of_shape_or_not_understood_are_breaking(name):
    edit, pointer, what = BREAKING[name]
    change = classify(ORDER, changed(edit))
    assert (change.kind, change.pointer, change.what) == ("breaking", pointer, what)


def test_the_same_schema_is_forward_compatible_and_so_is_anything_to_true():
    assert classify(ORDER, ORDER).kind == "forward"
    assert classify(ORDER, True).kind == "forward"
    assert classify(True, ORDER).kind == "backward"


def test_a_new_property_on_an_open_object_narrows_what_that_name_may_hold():
    """Strict reading: data under the open schema may carry `note` with any value."""
    old = {"type": "object", "properties": {"a": {"type": "string"}}}
    new = {"type": "object", "properties": {"a": {"type": "string"},
                                            "note": {"type": "string"}}}
    change = classify(old, new)
    assert change.kind == "backward"
    assert change.line() == "/properties/note: constrains a value that was unconstrained"
    assert classify(old, {**new, "properties": {**new["properties"], "note": {}}}).kind \
        == "forward"


def test_a_malformed_keyword_is_breaking_not_a_crash():
    change = classify({"type": "object"}, {"type": "object", "required": "a"})
    assert change.kind == "breaking" and change.pointer == "/required"
    assert classify({"type": "integer"}, {"type": "integr"}).pointer == "/type"


def test_parse_refuses_what_is_not_a_schema_in_one_line():
    assert schemas.parse('{"type": "string"}') == {"type": "string"}
    for text, why in (("{", "not JSON"), ("[1]", "an object or a boolean")):
        with pytest.raises(ValueError, match=why):
            schemas.parse(text)


def test_the_revert_must_restore_exactly_the_swapped_artefacts():
    d = "sha256:" + "a" * 64
    assert schemas.revert_problem(["order"], {"restore": {"order": d}}) is None
    assert "carries its backward-compatible revert" in schemas.revert_problem(["order"], None)
    assert "restores the prior schema" in schemas.revert_problem(
        ["order"], {"artefacts": {"order": "{}"}})
    assert "not the artefacts the change swaps" in schemas.revert_problem(
        ["order"], {"restore": {"other": d}})
    assert "64 lowercase hex" in schemas.revert_problem(["order"], {"restore": {"order": "x"}})
    assert schemas.base_problem({"restore": {"order": d}}, {"order": d}) is None
    assert "re-propose against the current schema" in schemas.base_problem(
        {"restore": {"order": d}}, {"order": "sha256:" + "b" * 64})


def test_json_equality_tells_true_from_one():
    assert not valid({"enum": [1]}, True) and valid({"enum": [1]}, 1.0)
    assert not valid({"const": {"a": [1]}}, {"a": [True]})


# -- properties ---------------------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "c"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3),
                    st.sampled_from([-1.5, 0.5, 2.5]), st.sampled_from(["", "x", "xy", "xyz"]))
INSTANCES = st.recursive(
    SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                     st.dictionaries(NAMES, inner, max_size=3)), max_leaves=6)


def _schema(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keyword = st.one_of(
        st.tuples(st.just("type"), st.one_of(st.sampled_from(schemas.TYPES),
                                             st.lists(st.sampled_from(schemas.TYPES),
                                                      min_size=1, max_size=3, unique=True))),
        st.tuples(st.just("enum"), st.lists(SCALARS, max_size=3)),
        st.tuples(st.just("const"), SCALARS),
        st.tuples(st.sampled_from(["minimum", "maximum", "exclusiveMinimum",
                                   "exclusiveMaximum"]), st.integers(-2, 2)),
        st.tuples(st.sampled_from(["minLength", "maxLength", "minItems", "maxItems"]),
                  st.integers(0, 3)),
        st.tuples(st.just("items"), inner),
        st.tuples(st.just("properties"), st.dictionaries(NAMES, inner, max_size=2)),
        st.tuples(st.just("required"), st.lists(NAMES, max_size=2, unique=True)),
        st.tuples(st.just("additionalProperties"), inner),
    )
    return st.one_of(st.booleans(), st.lists(keyword, max_size=4).map(dict))


SCHEMAS = st.recursive(st.one_of(st.booleans(), st.just({})), _schema, max_leaves=8)


@settings(max_examples=400, deadline=None)
@given(SCHEMAS, SCHEMAS, st.lists(INSTANCES, max_size=12))
def test_a_proven_subset_loses_no_instance(old, new, instances):
    """Forward-compatible: everything valid under the current schema stays valid; backward:
    the proposed schema admits nothing the current one did not."""
    kind = classify(old, new).kind
    for v in instances:
        if kind == "forward" and valid(old, v):
            assert valid(new, v), (old, new, v)
        if kind == "backward" and valid(new, v):
            assert valid(old, v), (old, new, v)


@settings(max_examples=200, deadline=None)
@given(SCHEMAS, INSTANCES)
def test_a_schema_is_its_own_subset_and_enum_of_its_instances_is_too(schema, v):
    assert subset(schema, schema) is None
    if valid(schema, v):
        assert subset({"enum": [v]}, schema) is None


KEYS = st.sampled_from(["type", "properties", "required", "additionalProperties", "enum",
                        "const", "items", "minimum", "maxLength", "maxItems", "pattern"])
ANY_JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(KEYS, NAMES), inner, max_size=4)),
    max_leaves=10)


@settings(max_examples=300, deadline=None)
@given(ANY_JSON, ANY_JSON)
def test_any_json_is_classified_without_raising(old, new):
    """Malformed keywords anywhere in either document: breaking, never a crash."""
    change = classify(old, new)
    assert change.kind in ("forward", "backward", "breaking")


def test_the_class_of_a_change_to_several_schemas_is_its_worst_named_by_artefact():
    fwd, brk = schemas.Change("forward"), schemas.Change("breaking", "/type", "retyped")
    back = schemas.Change("backward", "/maximum", "lowered to 1 (was maximum 2)")
    assert schemas.overall({"b": fwd, "a": fwd}) == (
        "forward", "a, b: every instance valid under the current schema stays valid")
    assert schemas.overall({"z": brk, "y": brk, "a": fwd}) == ("breaking", "y at /type: retyped")
    assert schemas.overall({"a": brk, "b": back}) == (
        "backward", "b at /maximum: lowered to 1 (was maximum 2)")
