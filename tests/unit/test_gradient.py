"""The L0–L4 trust gradient (DESIGN §2): scheme minimum classes, L1/L3 special cases, scope."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.core import gradient
from improved.core.gradient import CLASSES, class_fits, implied_scope, min_class, scope_fits

L0_SCHEMES = ("cache", "rank", "score")
L2_SCHEMES = ("skill", "doc", "config", "host")
L4_SCHEMES = ("code", "binary", "schema", "secret", "topic", "lkg")
OTHER_SCHEMES = ("grain", "entity", "query", "template", "widget")
ALL_SCHEMES = L0_SCHEMES + L2_SCHEMES + L4_SCHEMES + OTHER_SCHEMES

KNOWLEDGE = ("cache", "rank", "score", "skill", "doc", "grain", "entity", "query", "template")
OPERATION = ("config", "host", "binary", "schema", "secret", "topic", "lkg")
SCOPES = ("knowledge", "code", "operation", "charter")


# -- minimum classes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schemes", "least"),
    [(L0_SCHEMES, "L0"), (L2_SCHEMES, "L2"), (L4_SCHEMES, "L4"), (OTHER_SCHEMES, "L2")],
)
def test_scheme_minimum_class(schemes, least):
    for scheme in schemes:
        assert min_class(scheme) == least, scheme


def test_minimum_classes_can_be_raised_never_lowered():
    assert min_class("grain", overrides={"grain": "L4"}) == "L4"
    assert min_class("grain", fallback="L4") == "L4"
    # the floors: SPEC 09's table, and the built-in fallback for schemes it does not list
    assert min_class("grain", overrides={"grain": "L0"}) == "L2"
    assert min_class("code", overrides={"code": "L2"}, fallback="L0") == "L4"
    assert min_class("query", fallback="L0") == "L2"
    # an override raises above the table; the fallback only applies to schemes nobody listed
    assert min_class("rank", overrides={"rank": "L2"}) == "L2"
    assert min_class("cache", fallback="L4") == "L0"
    assert min_class("grain", overrides={"query": "L4"}) == "L2"
    assert gradient.floor("binary") == "L4" and gradient.floor("grain") == "L2"


def test_overrides_and_fallback_change_what_fits_only_upwards():
    assert not class_fits("L0", "grain")
    assert not class_fits("L0", "grain", overrides={"grain": "L0"})
    assert not class_fits("L2", "grain", fallback="L4")
    assert class_fits("L4", "grain", fallback="L4")
    assert not class_fits("L2", "code", overrides={"code": "L2"})
    assert not class_fits("L0", "binary", overrides={"binary": "L0"})
    assert not class_fits("L0", "rank", overrides={"rank": "L2"})


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_l1_fits_any_target(scheme):
    assert class_fits("L1", scheme)
    assert class_fits("L1", scheme, overrides={scheme: "L4"}, fallback="L4")


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_l3_fits_only_skill_targets(scheme):
    assert class_fits("L3", scheme) == (scheme == "skill")
    # even when an override lowers the minimum below L3, L3 stays skill-only
    assert class_fits("L3", scheme, overrides={scheme: "L0"}) == (scheme == "skill")


@pytest.mark.parametrize(
    ("cls", "scheme"),
    [("L0", s) for s in L2_SCHEMES + L4_SCHEMES + OTHER_SCHEMES]
    + [("L2", s) for s in L4_SCHEMES],
)
def test_class_below_minimum_does_not_fit(cls, scheme):
    assert not class_fits(cls, scheme)


@pytest.mark.parametrize(
    ("cls", "scheme"),
    [("L0", s) for s in L0_SCHEMES]
    + [("L2", s) for s in L0_SCHEMES + L2_SCHEMES + OTHER_SCHEMES]
    + [("L4", s) for s in ALL_SCHEMES],
)
def test_class_at_or_above_minimum_fits(cls, scheme):
    assert class_fits(cls, scheme)


# -- scope -------------------------------------------------------------------------------------


def test_scope_implied_by_scheme():
    for scheme in KNOWLEDGE:
        assert implied_scope(scheme) == "knowledge", scheme
    for scheme in OPERATION:
        assert implied_scope(scheme) == "operation", scheme
    assert implied_scope("code") == "code"
    # constitution IV.1: unclassified schemes are knowledge
    assert implied_scope("widget") == "knowledge"


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_only_the_implied_scope_fits(scheme):
    fitting = {s for s in SCOPES if s != "charter" and scope_fits(s, scheme)}
    assert fitting == {implied_scope(scheme)}


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_charter_only_for_doc(scheme):
    assert scope_fits("charter", scheme) == (scheme == "doc")


def test_scheme_and_rest_of_target_ref():
    assert gradient.scheme_of("doc:_doc/a.md") == "doc"
    assert gradient.rest_of("doc:_doc/a.md") == "_doc/a.md"
    assert gradient.rest_of("config:a:b") == "a:b"
    assert gradient.rest_of("nocolon") == ""


# -- monotonicity ------------------------------------------------------------------------------

ORDERED = ("L0", "L2", "L4")  # the classes that are compared against a minimum (not L1, L3)
schemes = st.one_of(st.sampled_from(ALL_SCHEMES),
                    st.from_regex(r"\A[a-z][a-z0-9+.-]{0,8}\Z"))
classes = st.sampled_from(CLASSES)


@settings(max_examples=300)
@given(scheme=schemes,
       overrides=st.dictionaries(schemes, classes, max_size=4),
       fallback=classes)
def test_class_fits_is_monotone(scheme, overrides, fallback):
    fits = [class_fits(c, scheme, overrides, fallback) for c in ORDERED]
    for low in range(len(ORDERED)):
        if fits[low]:
            assert all(fits[low:]), (scheme, overrides, fallback, fits)
    # the top of the ordering always fits: nothing is unreachable except by L3's own rule
    assert fits[-1]
    # no policy lets in what the built-in minimums keep out
    for c in ORDERED:
        if class_fits(c, scheme, overrides, fallback):
            assert class_fits(c, scheme)
    # L1 fits whatever the policy, L3 only on skill: targets
    assert class_fits("L1", scheme, overrides, fallback)
    assert class_fits("L3", scheme, overrides, fallback) == (scheme == "skill")
