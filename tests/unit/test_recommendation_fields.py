"""The Recommendation grain's last points (issue 34): an analyzer id is versioned,
`publisher.name/major`, or the proposal is refused in one line naming the form; `derived_from`
holds at most 64 entries, a bound the refusal says is this project's (OMS only recommends it)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.core import propose
from improved.protocol import canonical, wire

LIMIT = 256 * 1024
ADDRESS = "mg:sha256:" + "ab" * 32


def proposal(**changes: object) -> bytes:
    body = {"service": "recs", "target_ref": "rank:search.boost", "change_class": "L0",
            "scope": "operation", "origin": {"actor": "recs:1", "service": "recs"},
            "analyzer": {"id": "acme.tuner/1"},
            "summary": {"template_id": "set_config", "args": {"key": "k", "value": 1}},
            "created_at": 1_700_000_000_000, "proposal_data": {"value": 1}}
    return json.dumps({**body, **changes}).encode()


def refused(data: bytes) -> wire.WireError:
    with pytest.raises(wire.WireError) as info:
        propose.validate(data, None, LIMIT)
    return info.value


# -- versioned analyzer ids ---------------------------------------------------------------------

segments = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)
majors = st.integers(0, 999_999_999)


@settings(max_examples=300, deadline=None)
@given(publisher=segments, names=st.lists(segments, min_size=1, max_size=3), major=majors)
def test_every_publisher_name_major_is_accepted_and_its_family_drops_the_major(
        publisher, names, major):
    analyzer_id = ".".join([publisher, *names]) + f"/{major}"
    assert canonical.analyzer_id_problem(analyzer_id) is None
    assert canonical.analyzer_family(analyzer_id) == ".".join([publisher, *names])
    if len(analyzer_id) <= 128:
        assert propose.validate(proposal(analyzer={"id": analyzer_id}), None, LIMIT)


@settings(max_examples=300, deadline=None)
@given(publisher=segments, name=segments, major=majors,
       spoil=st.sampled_from(["no major", "no publisher", "empty segment", "leading zero",
                              "newline", "slash only", "sign", "space", "two majors"]))
def test_an_id_spoiled_any_way_is_refused_in_one_line_naming_the_form(publisher, name, major,
                                                                         spoil):
    spoiled = {
        "no major": f"{publisher}.{name}",
        "no publisher": f"{name}/{major}",
        "empty segment": f"{publisher}..{name}/{major}",
        "leading zero": f"{publisher}.{name}/0{major}",
        "newline": f"{publisher}.{name}/{major}\n",
        "slash only": f"{publisher}.{name}/",
        "sign": f"{publisher}.{name}/+{major}",
        "space": f"{publisher} .{name}/{major}",
        "two majors": f"{publisher}.{name}/{major}/{major}",
    }[spoil]
    why = canonical.analyzer_id_problem(spoiled)
    assert why is not None and "publisher.name/major" in why and "\n" not in why
    err = refused(proposal(analyzer={"id": spoiled}))
    assert (err.code, err.field) == (wire.INVALID_VALUE, "analyzer.id")
    assert "publisher.name/major" in err.message and "\n" not in err.message


@pytest.mark.parametrize("unversioned", ["acme.tuner", "tuner/1", "tuner", ".tuner/1",
                                         "acme.tuner/01", "acme.tuner/v1"])
def test_the_ids_the_grain_does_not_define_are_refused(unversioned):
    """Before, each was a proposal like any other: `acme.tuner` even had the same dedup_key
    as `acme.tuner/1`."""
    err = refused(proposal(analyzer={"id": unversioned}))
    assert err.field == "analyzer.id"
    assert err.message.startswith(f"analyzer.id {unversioned!r} is not a versioned analyzer id: "
                                  "the form is publisher.name/major (e.g. acme.tuner/1")


def test_the_error_reply_names_the_form():
    reply = json.loads(refused(proposal(analyzer={"id": "tuner"})).reply())
    assert reply["error"]["code"] == "invalid_value"
    assert reply["error"]["field"] == "analyzer.id"
    assert "publisher.name/major" in reply["error"]["message"]


# -- the derived_from bound ---------------------------------------------------------------------


def test_derived_from_holds_64_entries_and_not_65():
    at_bound = propose.validate(proposal(derived_from=[ADDRESS] * 64), None, LIMIT)
    assert at_bound.derived_from is not None and len(at_bound.derived_from) == 64
    propose.identify(at_bound)
    err = refused(proposal(derived_from=[ADDRESS] * 65))
    assert (err.code, err.field) == (wire.INVALID_VALUE, "derived_from")
    assert err.message.startswith("derived_from holds 65 entries; improved bounds it at 64 "
                                  "(this project's rule; OMS recommends at most 64)")
    assert "\n" not in err.message
