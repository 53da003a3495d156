"""The proposal wire contract (DESIGN §3.1–3.2): every bad message ends as a WireError naming the
problem, never as another exception; identity (proposal_id, dedup_key) follows the content."""

from __future__ import annotations

import copy
import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from improved.core import propose
from improved.protocol import wire
from improved.protocol.model import Proposal

LIMIT = 256 * 1024
WIRE_CODES = frozenset(v for k, v in vars(wire).items() if k.isupper() and isinstance(v, str))

BASE: dict = {
    "service": "svc",
    "target_ref": "skill:greet",
    "change_class": "L2",
    "scope": "knowledge",
    "origin": {"actor": "mcp:aaa:1", "service": "svc"},
    "analyzer": {"id": "pub.analyzer/1"},
    "summary": {"template_id": "new_skill", "args": {"name": "greet"}},
    "created_at": 1_700_000_000_000,
    "proposal_data": {"skill": {"name": "greet", "description": "say hello"}},
}


def body(**changes) -> dict:
    """BASE with top-level changes; a value of `...` deletes the field."""
    out = copy.deepcopy(BASE)
    for k, v in changes.items():
        if v is ...:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def enc(obj) -> bytes:
    return json.dumps(obj).encode()


def validate(data: bytes, svc: str | None = "svc", limit: int = LIMIT) -> Proposal:
    return propose.validate(data, svc, limit)


def refused(data: bytes, svc: str | None = "svc", limit: int = LIMIT) -> wire.WireError:
    with pytest.raises(wire.WireError) as info:
        validate(data, svc, limit)
    err = info.value
    assert err.code in WIRE_CODES
    reply = msgspec.json.decode(err.reply())
    assert reply["error"]["code"] == err.code and reply["error"]["message"]
    return err


def test_base_is_valid():
    p = validate(enc(BASE))
    assert p.service == "svc" and p.action_kind == "data"


def test_malformed_json():
    assert refused(b'{"service": "svc",').code == wire.INVALID_JSON
    assert refused(b"").code == wire.INVALID_JSON


def test_not_an_object():
    err = refused(b"[1, 2]")
    assert err.code == wire.INVALID_TYPE and err.field is None


def test_wrong_type():
    err = refused(enc(body(service=1)))
    assert (err.code, err.field) == (wire.INVALID_TYPE, "service")


def test_nested_wrong_type():
    err = refused(enc(body(origin={"actor": 5, "service": "svc"})))
    assert (err.code, err.field) == (wire.INVALID_TYPE, "origin.actor")


def test_list_item_wrong_type_is_located():
    err = refused(enc(body(signals=[{"kind": "nope", "actor": "a", "service": "svc",
                                     "positive": True, "at": 1}])))
    assert err.code == wire.INVALID_VALUE and err.field == "signals[0].kind"


@pytest.mark.parametrize("name", ["service", "target_ref", "scope", "created_at", "origin"])
def test_missing_field(name):
    err = refused(enc(body(**{name: ...})))
    assert (err.code, err.field) == (wire.MISSING_FIELD, name)
    assert name in err.message


def test_missing_nested_field():
    err = refused(enc(body(origin={"service": "svc"})))
    assert (err.code, err.field) == (wire.MISSING_FIELD, "origin.actor")


def test_two_bodies():
    err = refused(enc(body(proposal_cal="ADD grain:x")))
    assert err.code == wire.BODY_COUNT
    assert err.field in ("proposal_cal", "proposal_data")


def test_no_body():
    err = refused(enc(body(proposal_data=...)))
    assert err.code == wire.BODY_COUNT


def test_over_the_limit():
    data = enc(BASE)
    err = refused(data, limit=len(data) - 1)
    assert err.code == wire.TOO_LARGE
    assert validate(data, limit=len(data)).service == "svc"


def test_subject_mismatch():
    err = refused(enc(BASE), svc="other")
    assert (err.code, err.field) == (wire.SUBJECT_MISMATCH, "service")
    # with no subject to compare against, there is nothing to mismatch
    assert validate(enc(BASE), svc=None).service == "svc"


@pytest.mark.parametrize("name", ["status", "rec_status"])
def test_status_forbidden(name):
    err = refused(enc(body(**{name: "applied"})))
    assert (err.code, err.field) == (wire.STATUS_FORBIDDEN, name)


def test_unknown_field():
    err = refused(enc(body(colour="blue")))
    assert (err.code, err.field) == (wire.UNKNOWN_FIELD, "colour")
    err = refused(enc(body(origin={"actor": "a", "service": "svc", "extra": 1})))
    assert (err.code, err.field) == (wire.UNKNOWN_FIELD, "origin.extra")


def test_invalid_utf8():
    data = enc(BASE).replace(b'"mcp:aaa:1"', b'"mcp:\xff\xfe:1"')
    assert refused(data).code == wire.INVALID_JSON


def test_nan_is_not_json():
    data = enc(BASE).replace(b'"created_at"', b'"confidence": NaN, "created_at"')
    assert refused(data).code == wire.INVALID_JSON


@pytest.mark.parametrize("where", ["confidence", "proposal_data"])
def test_overflowing_number_is_an_error(where):
    if where == "confidence":
        data = enc(BASE).replace(b'"created_at"', b'"confidence": 1e999, "created_at"')
    else:
        data = enc(BASE).replace(b'"skill"', b'"x": 1e999, "skill"')
    err = refused(data)
    assert err.code in (wire.INVALID_VALUE, wire.INVALID_JSON)


def test_confidence_out_of_range():
    err = refused(enc(body(confidence=1.5)))
    assert (err.code, err.field) == (wire.INVALID_VALUE, "confidence")


def _validate_and_identify(data: bytes, limit: int = LIMIT):
    return propose.identify(validate(data, limit=limit))


@pytest.mark.parametrize("depth", [200, 5_000, 100_000])
@pytest.mark.parametrize("brackets", [(b"[", b"]"), (b'{"k":', b"}")])
def test_deep_nesting_is_a_wire_error(depth, brackets):
    deep = brackets[0] * depth + b"1" + brackets[1] * depth
    data = enc(BASE).replace(b'"skill"', b'"x": ' + deep + b', "skill"')
    with pytest.raises(wire.WireError) as info:
        _validate_and_identify(data, limit=len(data))  # the size limit is not what stops it
    assert info.value.code in (wire.TOO_DEEP, wire.INVALID_VALUE)


def test_huge_target_files_array():
    err = refused(enc(body(target_files=["a.md"] * 10_000)))
    assert (err.code, err.field) == (wire.INVALID_VALUE, "target_files")


VALID_CAL = 'ADD fact SET subject = "x" SET relation = "r" SET object = "{}" REASON "why"'


def cal_of(size: int, pad: str = "A") -> str:
    """A valid CAL batch of exactly `size` bytes (pad characters of equal UTF-8 width)."""
    room = size - len(VALID_CAL.format("").encode())
    return VALID_CAL.format(pad * (room // len(pad.encode())))


def test_proposal_cal_over_8192_bytes():
    err = refused(enc(body(proposal_data=..., change_class="L2", proposal_cal=cal_of(8193))))
    assert (err.code, err.field) == (wire.TOO_LARGE, "proposal_cal")
    # multi-byte characters count as bytes, not characters
    err = refused(enc(body(proposal_data=..., proposal_cal=cal_of(8194, "é"))))
    assert err.code == wire.TOO_LARGE
    assert validate(enc(body(proposal_data=..., proposal_cal=cal_of(8192)))).proposal_cal


def test_proposal_cal_refuses_destructive_verbs_and_status():
    err = refused(enc(body(proposal_data=..., proposal_cal='DELETE facts REASON "x"')))
    assert err.field == "proposal_cal" and "DELETE" in err.message
    err = refused(enc(body(proposal_data=..., proposal_cal=(
        'SUPERSEDE sha256:0123456789abcdef SET rec_status = "approved" REASON "x"'))))
    assert (err.code, err.field) == (wire.STATUS_FORBIDDEN, "proposal_cal")


def test_l3_without_skill_definition():
    err = refused(enc(body(change_class="L3", proposal_data={"other": 1})))
    assert (err.code, err.field) == (wire.INVALID_VALUE, "proposal_data.skill")
    err = refused(enc(body(change_class="L3", proposal_data=..., proposal_cal=cal_of(100))))
    assert (err.code, err.field) == (wire.INVALID_VALUE, "proposal_data.skill")
    assert validate(enc(body(change_class="L3"))).change_class == "L3"


def test_skill_name_must_be_a_subject_token():
    err = refused(enc(body(proposal_data={"skill": {"name": "Bad Name"}})))
    assert (err.code, err.field) == (wire.INVALID_VALUE, "proposal_data.skill.name")


@pytest.mark.parametrize("target_ref", ["Skill:x", "skill:", "noscheme", "1x:y"])
def test_bad_target_ref(target_ref):
    err = refused(enc(body(target_ref=target_ref)))
    assert (err.code, err.field) == (wire.INVALID_VALUE, "target_ref")


def test_error_reply_shape():
    err = refused(enc(body(service=1)))
    reply = msgspec.json.decode(err.reply())
    assert reply == {"error": {"code": "invalid_type", "message": err.message,
                               "field": "service"}}


def test_identify_error_names_the_wire_field():
    data = enc(BASE).replace(b'"skill"', b'"x": ' + b"1" * 30 + b', "skill"')
    with pytest.raises(wire.WireError) as info:
        _validate_and_identify(data)
    assert info.value.code == wire.INVALID_VALUE
    assert info.value.field == "proposal_data.x"


# -- identify ----------------------------------------------------------------------------------


def test_key_order_does_not_change_the_id():
    a = enc(BASE)
    reordered = {k: BASE[k] for k in reversed(list(BASE))}
    reordered["origin"] = {"service": "svc", "actor": "mcp:aaa:1"}
    b = json.dumps(reordered, indent=2).encode()
    assert a != b
    assert _validate_and_identify(a) == _validate_and_identify(b)


def test_content_change_new_id_same_dedup_key():
    pid, dedup = _validate_and_identify(enc(BASE))
    changed = body(summary={"template_id": "new_skill", "args": {"name": "greeT"}})
    pid2, dedup2 = _validate_and_identify(enc(changed))
    assert pid2 != pid
    assert dedup2 == dedup


def test_analyzer_major_and_case_keep_the_dedup_key():
    _, dedup = _validate_and_identify(enc(BASE))
    _, bumped = _validate_and_identify(enc(body(analyzer={"id": "Pub.Analyzer/2"})))
    assert bumped == dedup


def test_target_or_action_kind_change_the_dedup_key():
    pid, dedup = _validate_and_identify(enc(BASE))
    pid2, dedup2 = _validate_and_identify(enc(body(target_ref="skill:greet2")))
    assert pid2 != pid and dedup2 != dedup
    _, dedup3 = _validate_and_identify(enc(body(proposal_data=..., proposal_cal=cal_of(100))))
    assert dedup3 != dedup


def test_ids_are_lowercase_hex():
    pid, dedup = _validate_and_identify(enc(BASE))
    for h in (pid, dedup):
        assert len(h) == 64 and h == h.lower() and int(h, 16) >= 0


# -- fuzz --------------------------------------------------------------------------------------


def _never_crashes(data: bytes) -> None:
    try:
        p = validate(data)
    except wire.WireError as err:
        assert err.code in WIRE_CODES, err
        return
    try:
        pid, dedup = propose.identify(p)
    except wire.WireError as err:
        assert err.code in WIRE_CODES, err
        return
    assert len(pid) == 64 and len(dedup) == 64


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)
FIELDS = sorted({*BASE, *Proposal.__struct_fields__, "status", "rec_status", "zz"})


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(data):
    _never_crashes(data)


@settings(max_examples=300, deadline=None)
@given(value=json_values, ascii_only=st.booleans())
def test_fuzz_arbitrary_json(value, ascii_only):
    _never_crashes(json.dumps(value, ensure_ascii=ascii_only).encode())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    changes=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=3),
    data_extra=st.dictionaries(st.text(max_size=8), json_values, max_size=3),
    args=st.dictionaries(st.text(max_size=8), json_values, max_size=3),
)
def test_fuzz_mutated_proposal(changes, data_extra, args):
    """A valid proposal with some fields replaced by arbitrary JSON, and arbitrary content in
    the opaque parts (`proposal_data`, `summary.args`) that reach the canonical encoder."""
    obj = body(**changes)
    if isinstance(obj.get("proposal_data"), dict):
        obj["proposal_data"].update(data_extra)
    if isinstance(obj.get("summary"), dict):
        obj["summary"]["args"] = args
    _never_crashes(json.dumps(obj).encode())


@pytest.mark.parametrize(("field", "value"), [
    ("service", "svc\n"),
    ("target_ref", "skill:greet\n"),
    ("origin", {"actor": "mcp:aaa:1\n", "service": "svc"}),
])
def test_a_trailing_newline_never_passes_a_pattern(field, value):
    """`$` matches before a final newline in Python's re: every wire pattern ends in `\\Z`."""
    err = refused(enc(body(**{field: value})), svc=None)
    assert err.field is not None and err.field.startswith(field)
