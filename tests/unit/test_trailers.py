"""What a trailer says, typed (improved/core/trailers.py): every kind is written byte for byte
as before the typed data, what was written then reads back, and decoding then encoding any
kind's data gives back its refs, so no hash changes. And the fold is the only place a record
changes (improved/core/record.py)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.core import audit, trailers
from improved.core.audit import draft_of
from improved.core.record import ChainHead
from improved.core.trailers import KINDS, Data, Unknown, decode, encode
from tests.builders import NOW, l4, make_proposal
from tests.unit import trailer_cases

ROOT = Path(__file__).resolve().parents[2]
WRITTEN_BEFORE = json.loads((Path(__file__).parent / "trailer_refs.json").read_text())
EVERY_KIND = {*KINDS.values(), trailers.Rejected, trailers.LkgRefused, trailers.EpochSealed}


class Shape(msgspec.Struct):
    to_stage: str
    verdict: str | None
    cause: str | None
    refs: list[str]


def test_every_kind_is_written_as_before():
    """The refs, verdict, cause (and a proposal chain's gate class) each stage writes from
    fixed inputs are those the code before the typed data wrote from the same inputs."""
    assert trailer_cases.NEW
    written = trailer_cases.cases()
    assert written.keys() == WRITTEN_BEFORE.keys()
    for name, before in WRITTEN_BEFORE.items():
        assert written[name] == before, name


def test_what_was_written_before_reads_back_as_its_kind_and_encodes_to_the_same_refs():
    kinds = set()
    for name, before in WRITTEN_BEFORE.items():
        data = decode(msgspec.convert(before, Shape))
        assert not isinstance(data, Unknown), name
        assert list(encode(data)) == before["refs"], name
        kinds.add(type(data))
    assert kinds == EVERY_KIND  # every kind there is, written by the code itself


def test_an_older_chains_refs_still_read():
    """Chains written before a ref was recorded (answered_by, emitter, schema_class, the
    dispatch kind, a signal's own time) read as their kind, without it."""
    signal = decode(Shape("learn-back", "signal", None, ["signal:" + "a" * 64, "kind:check",
                                                         "positive:true"]))
    assert isinstance(signal, trailers.SignalCounted)
    assert (signal.positive, signal.independent, signal.at, signal.emitter) == (
        True, False, None, "")
    applied = decode(Shape("apply", "applied", None, ["applied:x", "rollbackable:true",
                                                      'inverse:{"op":"undo"}']))
    assert isinstance(applied, trailers.Applied) and applied.answered_by is None
    assert applied.inverse == {"op": "undo"} and applied.schema_class is None
    dispatched = decode(Shape("apply", "dispatched", None, ["authority:operator:a"]))
    assert isinstance(dispatched, trailers.Dispatched) and dispatched.dispatch == "apply"
    refused = decode(Shape("apply", "failed", None, ["applied:", "rollbackable:false",
                                                     "error:lkg: rc 1"]))
    assert isinstance(refused, trailers.Applied) and refused.error == "lkg: rc 1"


def test_refs_a_kind_cannot_hold_are_named():
    with pytest.raises(trailers.TrailerDataError, match="superseded_by"):
        decode(Shape("triage", "superseded", None, []))
    with pytest.raises(trailers.TrailerDataError, match="act_seq"):
        decode(Shape("triage", "vote", None, ["act:x", "act_seq:seven"]))
    assert isinstance(decode(Shape("observe", "held", None, ["x:y"])), Unknown)


# -- the property: decoding then encoding any kind's data gives back its refs ---------------

PROPOSALS = (make_proposal(), l4(), make_proposal(valid_to=NOW, signals=None, confidence=0.5))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=6)
names = st.from_regex(r"\A[a-z][a-z_]{0,10}\Z")


def values_of(t: Any) -> st.SearchStrategy[Any]:
    """Values of a field's type (msgspec.inspect), as a writer could hold them."""
    i = msgspec.inspect
    if isinstance(t, i.StrType):
        return st.text(max_size=12)
    if isinstance(t, i.BoolType):
        return st.booleans()
    if isinstance(t, i.IntType):
        return st.integers(0, 2**53)
    if isinstance(t, i.FloatType):
        return st.floats(allow_nan=False, allow_infinity=False)
    if isinstance(t, i.NoneType):
        return st.none()
    if isinstance(t, i.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, i.UnionType):
        return st.one_of(*(values_of(x) for x in t.types))
    if isinstance(t, i.VarTupleType):
        return st.lists(values_of(t.item_type), max_size=3).map(tuple)
    if isinstance(t, i.DictType):
        return st.dictionaries(st.text(max_size=6), values_of(t.value_type), max_size=3)
    if isinstance(t, i.StructType):
        return st.sampled_from(PROPOSALS)
    if isinstance(t, i.AnyType):
        return json_values
    raise AssertionError(f"no strategy for {t}")


@st.composite
def data_of_every_kind(draw: st.DrawFn) -> Data:
    cls = draw(st.sampled_from(sorted(EVERY_KIND, key=lambda c: c.__name__)))
    info = msgspec.inspect.type_info(cls)
    fields: dict[str, Any] = {}
    for f in info.fields:
        if f.name == cls.REST:
            taken = frozenset({g.encode_name for g in info.fields} | {"index"})
            fields[f.name] = draw(st.dictionaries(names.filter(lambda n, taken=taken: n not in taken),
                                                  json_values, max_size=3))
        elif f.name == "index":
            fields[f.name] = draw(st.lists(st.sampled_from(["+review", "-review", "+due",
                                                             "-due"]), max_size=2).map(tuple))
        else:
            fields[f.name] = draw(values_of(f.type))
    if issubclass(cls, trailers.Signed):  # every daemon writes the act with its sequence
        fields["act"] = draw(st.text(min_size=1, max_size=12))
        fields["act_seq"] = draw(st.integers(0, 2**53))
    if cls is trailers.LkgRefused:  # what tells it from a service's refusal
        fields["answered_by"] = draw(st.text(max_size=12))
    return cls(**fields)


@settings(max_examples=400, deadline=None)
@given(data=data_of_every_kind())
def test_decoding_then_encoding_any_kind_gives_back_its_refs(data):
    draft = draft_of(data, "observe", "improved:test", "rec:system", "why")
    trailer = audit.seal_next(draft, "c" * 64, ChainHead(), "L2", "knowledge", NOW)
    read = decode(trailer)
    assert read == data
    assert encode(read) == tuple(trailer.refs) == draft.refs
    body = json.loads(msgspec.json.encode(trailer))  # as a reader gets it from the broker
    assert trailers.decode_body(body) == data
    assert audit.trailer_hash(body) == trailer.hash


# -- the fold is the only place a record changes --------------------------------------------


def test_only_the_fold_changes_a_record():
    """A record is changed (`record.replace(...)`, keywords only) in core/record.py alone:
    every stage returns the draft it decided, and the record after it is the fold."""
    found = []
    for path in sorted((ROOT / "improved").rglob("*.py")):
        if path == ROOT / "improved" / "core" / "record.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "replace" and not node.args and node.keywords
                    and not (isinstance(node.func.value, ast.Name)
                             and node.func.value.id in ("dataclasses", "os"))
                    and not (isinstance(node.func.value, ast.Attribute)
                             and node.func.value.attr == "structs")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
