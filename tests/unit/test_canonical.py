"""OMS canonical encoding: published vectors, msgspec-vs-reference and property tests."""

from __future__ import annotations

import math
import random
import unicodedata

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.protocol import canonical
from improved.protocol.canonical import (
    FACT,
    INDEX_LAYER_FIELDS,
    OBSERVATION,
    RECOMMENDATION,
    SKILL,
    SKILL_DEFINITION_FIELDS,
    CanonicalError,
    _reference_encode,
    analyzer_family,
    compact,
    content_address,
    dedup_key,
    digest,
    encode,
    grain_blob,
    normalize,
    sha256_hex,
    skill_hash,
    skill_identity,
)

DID = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
V1 = {
    "type": "fact", "subject": "user", "relation": "prefers", "object": "dark mode",
    "confidence": 0.9, "source_type": "user_explicit", "created_at": 1768471200000,
    "namespace": "shared", "author_did": DID,
}
V1_BLOB_HEX = (
    "01 00 01 a4 d2 69 68 ba a0 89 a4 61 64 69 64 d9 38 64 69 64 3a 6b 65 79 3a 7a 36 4d 6b 68 "
    "61 58 67 42 5a 44 76 6f 74 44 6b 4c 35 32 35 37 66 61 69 7a 74 69 47 69 43 32 51 74 4b 4c "
    "47 70 62 6e 6e 45 47 74 61 32 64 6f 4b a1 63 cb 3f ec cc cc cc cc cc cd a2 63 61 cf 00 00 "
    "01 9b c1 19 01 00 a2 6e 73 a6 73 68 61 72 65 64 a1 6f a9 64 61 72 6b 20 6d 6f 64 65 a1 72 "
    "a7 70 72 65 66 65 72 73 a1 73 a4 75 73 65 72 a2 73 74 ad 75 73 65 72 5f 65 78 70 6c 69 63 "
    "69 74 a1 74 a4 66 61 63 74"
)
V6 = {
    "type": "fact", "subject": "agent-007", "relation": "constraint",
    "object": "never delete user files without confirmation", "confidence": 1.0,
    "source_type": "user_explicit", "created_at": 1768471200000, "namespace": "safety",
    "invalidation_policy": {"mode": "locked", "authorized": [DID]},
}


# ---------------------------------------------------------------- OMS test vectors


def test_v1_fact_vector():
    blob = grain_blob(V1, FACT)
    assert len(blob) == 159
    assert blob[:10] == bytes.fromhex("01 00 01 a4 d2 69 68 ba a0 89")
    assert blob == bytes.fromhex(V1_BLOB_HEX)
    assert content_address(V1, FACT) == (
        "3288d0d41cf49a1d428e404f0b6a6fe60388be9536937557f6139b813d53a520")
    assert blob[9:] == _reference_encode(normalize(compact(V1)))


def test_v6_fact_with_invalidation_policy():
    blob = grain_blob(V6, FACT)
    assert blob[:9] == bytes.fromhex("01 00 01 85 6e 69 68 ba a0")
    assert content_address(V6, FACT) == (
        "df928038769506fb66671aced0eb97d45871e169e505ed55a382c744e620550e")
    assert blob[9:] == _reference_encode(normalize(compact(V6)))
    # nested map keys are sorted too: "authorized" before "mode"
    assert blob.index(b"authorized") < blob.index(b"mode")


def test_v6_int_confidence_changes_address():
    as_int = {**V6, "confidence": 1}
    assert content_address(as_int, FACT) != content_address(V6, FACT)
    assert encode(1.0) == bytes.fromhex("cb 3f f0 00 00 00 00 00 00")
    assert encode(1) == b"\x01"


def test_input_key_order_and_address_format():
    reordered = dict(reversed(list(V1.items())))
    addr = content_address(reordered, FACT)
    assert addr == content_address(V1, FACT)
    assert len(addr) == 64 and addr == addr.lower()
    assert sha256_hex(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert digest({"a": 1}) == sha256_hex(encode({"a": 1}))


def test_type_bytes():
    assert (FACT, OBSERVATION, SKILL, RECOMMENDATION) == (0x01, 0x06, 0x0B, 0x0C)


# ---------------------------------------------------------------- hypothesis strategies

INT_BOUNDARIES = [
    0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1,
    -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63),
]


def _no_bom(s: str) -> bool:
    return not unicodedata.normalize("NFC", s).startswith("\ufeff")


texts = st.text().filter(_no_bom)
keys = st.text().map(lambda s: unicodedata.normalize("NFC", s)).filter(_no_bom)
ints = st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.sampled_from(INT_BOUNDARIES)
floats = st.floats(allow_nan=False, allow_infinity=False)
scalars = st.none() | st.booleans() | ints | floats | texts | st.binary(max_size=300)
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=20)
    | st.dictionaries(keys, children, max_size=20),
    max_leaves=40,
)
maps = st.dictionaries(keys, values, max_size=20)


def _shuffled(obj, rnd: random.Random):
    if isinstance(obj, dict):
        items = list(obj.items())
        rnd.shuffle(items)
        return {k: _shuffled(v, rnd) for k, v in items}
    if isinstance(obj, list):
        return [_shuffled(v, rnd) for v in obj]
    return obj


# ---------------------------------------------------------------- properties


@given(values)
@settings(max_examples=300)
def test_msgspec_hot_path_matches_reference(x):
    assert encode(x) == _reference_encode(normalize(x))


@given(st.lists(st.text(max_size=3), max_size=40).map(lambda ks: {k: 0 for k in ks}))
def test_key_sort_is_utf8_byte_order(d):
    d = {k: v for k, v in d.items() if _no_bom(k)}
    d = {unicodedata.normalize("NFC", k): v for k, v in d.items()}
    assert encode(d) == _reference_encode(d)


@given(values)
def test_round_trip_reencodes_identically(x):
    b = encode(x)
    assert encode(msgspec.msgpack.decode(b)) == b


@given(values, st.randoms(use_true_random=False))
def test_key_order_independence(x, rnd):
    assert encode(_shuffled(x, rnd)) == encode(x)


@given(texts, texts)
def test_nfc_and_nfd_spellings_encode_identically(k, v):
    nfd = {unicodedata.normalize("NFD", k): [unicodedata.normalize("NFD", v)]}
    nfc = {unicodedata.normalize("NFC", k): [unicodedata.normalize("NFC", v)]}
    assert encode(nfd) == encode(nfc)
    assert encode(unicodedata.normalize("NFD", v)) == encode(unicodedata.normalize("NFC", v))


def test_nfc_example_from_spec():
    assert encode("e\u0301") == encode("\u00e9") == b"\xa2\xc3\xa9"


@given(floats)
def test_every_float_is_float64(f):
    b = encode(f)
    assert len(b) == 9 and b[0] == 0xCB
    assert msgspec.msgpack.decode(b) == f
    assert math.copysign(1.0, msgspec.msgpack.decode(b)) == math.copysign(1.0, f)


@pytest.mark.parametrize("f", [0.0, -0.0, 1.0, 0.5, 1e-310, 1.7976931348623157e308])
def test_float_boundaries_are_float64(f):
    b = encode([f])
    assert b[1] == 0xCB and len(b) == 10


@pytest.mark.parametrize(
    "n,first,size",
    [(0, 0x00, 1), (127, 0x7F, 1), (128, 0xCC, 2), (255, 0xCC, 2), (256, 0xCD, 3),
     (65535, 0xCD, 3), (65536, 0xCE, 5), (2**32 - 1, 0xCE, 5), (2**32, 0xCF, 9),
     (2**64 - 1, 0xCF, 9), (-1, 0xFF, 1), (-32, 0xE0, 1), (-33, 0xD0, 2), (-128, 0xD0, 2),
     (-129, 0xD1, 3), (-32768, 0xD1, 3), (-32769, 0xD2, 5), (-(2**31), 0xD2, 5),
     (-(2**31) - 1, 0xD3, 9), (-(2**63), 0xD3, 9)],
)
def test_int_smallest_form_at_boundaries(n, first, size):
    b = encode(n)
    assert (b[0], len(b)) == (first, size)
    assert msgspec.msgpack.decode(b) == n
    assert b == _reference_encode(n)


@given(ints)
def test_ints_decode_back_equal(n):
    assert msgspec.msgpack.decode(encode(n)) == n
    assert encode(n) == _reference_encode(n)


@given(maps, keys)
def test_none_values_in_maps_are_omitted(x, extra):
    if extra in x:
        return
    assert encode({**x, extra: None}) == encode(x)
    assert encode({"nested": {**x, extra: None}}) == encode({"nested": x})


def test_none_kept_in_lists_and_bool_is_not_int():
    assert encode([None, True, False, 1]) == bytes.fromhex("94 c0 c3 c2 01")
    assert normalize({"a": None, "b": (1, None)}) == {"b": [1, None]}


def test_bytes_and_long_strings():
    assert encode(b"ab") == bytes.fromhex("c4 02 61 62")
    for n in (31, 32, 255, 256, 65535, 65536):
        s = "x" * n
        assert encode(s) == _reference_encode(s)
        assert encode(b"\x00" * n) == _reference_encode(b"\x00" * n)
        assert encode(list(range(n % 40))) == _reference_encode(list(range(n % 40)))


# ---------------------------------------------------------------- error cases


def _code(obj, **kw):
    with pytest.raises(CanonicalError) as info:
        normalize(obj, **kw)
    return info.value


def _nested(depth: int):
    x: object = 1
    for _ in range(depth):
        x = [x]
    return x


@pytest.mark.parametrize(
    "obj,code,path",
    [
        ({"proposal_data": {"x": [0, 1, float("nan")]}}, "ERR_FLOAT_INVALID",
         "$.proposal_data.x[2]"),
        ([float("inf")], "ERR_FLOAT_INVALID", "$[0]"),
        (-float("inf"), "ERR_FLOAT_INVALID", "$"),
        ({"n": 2**64}, "ERR_RANGE", "$.n"),
        (-(2**63) - 1, "ERR_RANGE", "$"),
        ({1: "a"}, "ERR_TYPE", "$"),
        ({"a": "\ufeffhello"}, "ERR_CORRUPT", "$.a"),
        ({"\ufeffk": 1}, "ERR_CORRUPT", None),
        ({"\u00e9": 1, "e\u0301": 2}, "ERR_CORRUPT", None),
        ({"\u00e9": None, "e\u0301": 2}, "ERR_CORRUPT", None),
        ({"a": {1, 2}}, "ERR_TYPE", "$.a"),
        ({"a": "\ud800"}, "ERR_CORRUPT", "$.a"),
        (msgspec.Struct, "ERR_TYPE", "$"),
    ],
)
def test_error_codes(obj, code, path):
    err = _code(obj)
    assert err.code == code
    assert isinstance(err, ValueError)
    if path is not None:
        assert err.path == path and path in str(err)


def test_depth_limit():
    normalize(_nested(32))
    assert _code(_nested(33)).code == "ERR_DEPTH"
    assert _code(_nested(9), max_depth=8).code == "ERR_DEPTH"


def test_struct_rejected_until_converted():
    class S(msgspec.Struct):
        a: int = 1

    assert _code({"s": S()}).code == "ERR_TYPE"
    assert encode({"s": msgspec.to_builtins(S())}) == encode({"s": {"a": 1}})


@pytest.mark.parametrize("field", sorted(INDEX_LAYER_FIELDS))
def test_index_layer_field_rejected_in_blob(field):
    with pytest.raises(CanonicalError) as info:
        grain_blob({**V1, field: "x"}, FACT)
    assert info.value.code == "ERR_CORRUPT" and field in str(info.value)
    # None means absent: it is dropped before encoding and does not change the address
    assert grain_blob({**V1, field: None}, FACT) == grain_blob(V1, FACT)


def test_grain_blob_header_errors():
    with pytest.raises(CanonicalError) as info:
        grain_blob({**V1, "created_at": 2**32 * 1000}, FACT)
    assert info.value.code == "ERR_RANGE"
    with pytest.raises(CanonicalError) as info:
        grain_blob({**V1, "created_at": -1}, FACT)
    assert info.value.code == "ERR_RANGE"
    with pytest.raises(CanonicalError) as info:
        grain_blob({k: v for k, v in V1.items() if k != "created_at"}, FACT)
    assert info.value.code == "ERR_TYPE"
    with pytest.raises(CanonicalError) as info:
        grain_blob(V1, SKILL)
    assert info.value.code == "ERR_CORRUPT"


def test_grain_blob_without_namespace_uses_zero_hash():
    g = {k: v for k, v in V1.items() if k != "namespace"}
    assert grain_blob(g, FACT)[3:5] == b"\x00\x00"


# ---------------------------------------------------------------- compaction


def test_compact_top_level_and_nested_only_where_specified():
    g = {
        "type": "recommendation", "target_ref": "doc:claude.md", "unknown_field": 1,
        "content_refs": [{"uri": "s3://x", "mime_type": "text/plain", "extra": 1}],
        "embedding_refs": [{"vector_id": "v", "chunk_text": "t"}],
        "related_to": [{"hash": "h", "relation_type": "supports", "weight": 0.5}],
        "provenance_chain": [{"uri": "kept"}],
        "proposal_data": {"type": "kept"},
    }
    assert compact(g) == {
        "t": "recommendation", "tref": "doc:claude.md", "unknown_field": 1,
        "cr": [{"u": "s3://x", "mt": "text/plain", "extra": 1}],
        "er": [{"vi": "v", "ct": "t"}],
        "rt": [{"h": "h", "rl": "supports", "w": 0.5}],
        "pc": [{"uri": "kept"}],
        "pdata": {"type": "kept"},
    }
    assert compact({"observer_id": "user:alice", "observer_type": "human"}) == {
        "oid": "user:alice", "otype": "human"}


def test_compact_collision_is_corrupt():
    with pytest.raises(CanonicalError) as info:
        compact({"type": "fact", "t": "fact"})
    assert info.value.code == "ERR_CORRUPT"


# ---------------------------------------------------------------- dedup_key

KNOWN_DDK = "ed6ef0f6f0905ff1186c5d8bf3b6a53ae78ab404ff5d114417983ea9c36a6804"


def test_dedup_key_known_answer():
    assert dedup_key("waiser.duplicate_sweep/1", "entity:eng/alice", "cal") == KNOWN_DDK
    assert dedup_key("WAISER.Duplicate_Sweep/1", "entity:eng/alice", "cal") == KNOWN_DDK
    assert dedup_key("waiser.duplicate_sweep/2", "entity:eng/alice", "cal") == KNOWN_DDK
    assert dedup_key("waiser.duplicate_sweep", "entity:eng/alice", "cal") == KNOWN_DDK


def test_analyzer_family():
    assert analyzer_family("waiser.duplicate_sweep/1") == "waiser.duplicate_sweep"
    assert analyzer_family("waiser.duplicate_sweep/12") == "waiser.duplicate_sweep"
    assert analyzer_family("no_slash") == "no_slash"


def test_dedup_key_properties():
    base = dedup_key("a.b/1", "entity:eng/Alice", "cal")
    assert dedup_key("a.b/1", "entity:eng/alice", "cal") != base  # target case preserved
    assert dedup_key("a.b/1", "entity:eng/Alice", "edit") != base
    assert dedup_key("a.b/1", "entity:eng/Alice", "data") != base
    assert dedup_key("Stra\u00dfe.x/1", "t", "cal") == dedup_key("STRASSE.X/3", "t", "cal")
    assert (dedup_key("a/1", "doc:caf\u00e9", "cal")
            == dedup_key("a/1", "doc:cafe\u0301", "cal"))
    for bad in ("CAL", "apply", ""):
        with pytest.raises(ValueError):
            dedup_key("a/1", "t", bad)


@given(st.text(max_size=20), st.text(max_size=20))
def test_dedup_key_is_family_casefold_invariant(family, target):
    family = family.replace("/", "")
    a = dedup_key(family + "/1", target, "data")
    assert a == dedup_key(family.upper() + "/7", target, "data")
    assert len(a) == 64


# ---------------------------------------------------------------- skill hash

SKILL_DEF = {
    "type": "skill", "name": "code_review", "description": "Review a diff",
    "instructions": "1. Read the diff.\n2. Comment.", "when_to_use": "on PR",
    "version": "1", "allowed_tools": ["git"], "domain": "code",
    "created_at": 1768471200000, "namespace": "agent:skills",
}


def test_skill_hash_stable_under_key_order_and_competence():
    h = skill_hash(SKILL_DEF)
    assert skill_hash(dict(reversed(list(SKILL_DEF.items())))) == h
    practiced = {**SKILL_DEF, "proficiency": 0.8, "practice_count": 12,
                 "holder_did": DID, "created_at": 1768471299000, "last_practiced_at": 5,
                 "namespace": "other"}
    assert skill_hash(practiced) == h
    assert skill_identity(practiced) == f"code_review:{h}"


def test_skill_hash_changes_with_definition():
    h = skill_hash(SKILL_DEF)
    assert skill_hash({**SKILL_DEF, "instructions": "1. Read the diff.\n2. Comment!"}) != h
    assert skill_hash({**SKILL_DEF, "version": "2"}) != h
    no_domain = {k: v for k, v in SKILL_DEF.items() if k != "domain"}
    assert skill_hash(no_domain) != h
    assert set(SKILL_DEFINITION_FIELDS) >= {"name", "instructions", "domain"}


# -- a Skill's dependencies are Skill grain addresses (OMS Skill grain) -------------------------

_HEX64 = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)


@given(_HEX64, st.booleans())
def test_a_content_address_is_a_dependency_bare_or_prefixed(hexdigest, prefixed):
    dep = ("mg:sha256:" if prefixed else "") + hexdigest
    assert canonical.dependencies_problem({"dependencies": [dep]}) is None


@given(st.text(max_size=80))
def test_anything_else_is_refused_naming_the_entry(text):
    if canonical.GRAIN_ADDRESS_RE.match(text):
        return
    field, why = canonical.dependencies_problem(
        {"dependencies": ["a" * 64, text]})  # type: ignore[misc]
    assert field == "dependencies[1]" and "content address" in why


def test_uppercase_and_names_are_not_addresses():
    for dep in ("A" * 64, "mg:sha256:" + "AB" * 32, "threat_modeling", "sha256:" + "a" * 64):
        assert canonical.dependencies_problem({"dependencies": [dep]}) is not None
    assert canonical.dependencies_problem({"dependencies": "x"})[0] == "dependencies"
