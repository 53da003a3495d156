"""Schema discipline (SPEC 09 §7.4, SPEC 08 §7): is a change to a JSON Schema forward-compatible,
backward-incompatible or breaking, and does the proposal carry its way back?

The classes, read as sets of valid instances (`old` = the schema the owning service holds now):
- `forward`: every instance valid under `old` stays valid under the new schema (old ⊆ new:
  adding a property to a closed object, widening an enum, relaxing a bound). Existing data and
  writers still on `old` keep working; SPEC 08's "forward auto".
- `backward`: the change only takes away (new ⊊ old: a tighter bound, a narrower enum, a new
  required property, a property constrained where `old` allowed any value). It is the shape of
  going back from a widening; SPEC 08 refuses backward migrations — the way back is the recorded
  reversal, which restores the exact prior schema.
- `breaking`: neither (a type changed, a property retyped), or not understood. Needs the
  operator.

Conservative on purpose: the subset test proves, it never guesses. A keyword outside the subset
below (`$ref`, `allOf`, `pattern`, `format`, tuple `items`, …) makes nothing provable, so such a
change is `breaking` and goes to the operator. Understood: `type`, `properties`, `required`,
`additionalProperties`, `enum`, `const`, `items`, `minimum`, `maximum`, `exclusiveMinimum`,
`exclusiveMaximum`, `minLength`, `maxLength`, `minItems`, `maxItems`, boolean schemas, and the
annotations (`title`, `description`, `$schema`, `$id`, `$comment`, `default`, `examples`,
`$defs`/`definitions` when nothing refers to them). Pure; no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["forward", "backward", "breaking"]
Why = tuple[str, str] | None  # (JSON pointer, what changed) of the first difference; None: proven

ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment", "default",
                         "examples", "$defs", "definitions", "deprecated", "readOnly",
                         "writeOnly"})
KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "enum", "const",
                      "items", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                      "minLength", "maxLength", "minItems", "maxItems"})
TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")


@dataclass(frozen=True)
class Change:
    """The class of a change and, unless it is `forward`, the first difference that decided it."""

    kind: Kind
    pointer: str = ""
    what: str = ""

    def line(self) -> str:
        """One line an operator reads: `<pointer>: <what changed>`."""
        return f"{self.pointer or '/'}: {self.what}" if self.what else "no instance lost"


def classify(old: Any, new: Any) -> Change:
    """The class of the change from `old` to `new` (two parsed JSON Schema documents)."""
    odd = outside(old) or outside(new)
    if odd is not None:
        return Change("breaking", *odd)
    lost = subset(old, new)
    if lost is None:
        return Change("forward")
    gained = subset(new, old)
    if gained is None:
        return Change("backward", *lost)
    return Change("breaking", *lost)


def overall(found: Mapping[str, Change]) -> tuple[Kind, str]:
    """The class of one change to several schemas (artefact → its `Change`) and the line an
    operator reads: `backward` when any artefact only takes away (refused whoever approves),
    else `breaking` when any breaks, else `forward`; the line names the first artefact, by
    name, that decided it."""
    for kind in ("backward", "breaking"):
        first = next(((n, c) for n, c in sorted(found.items()) if c.kind == kind), None)
        if first is not None:
            return first[1].kind, f"{first[0]} at {first[1].line()}"
    names = ", ".join(sorted(found)) or "no artefact"
    return "forward", f"{names}: every instance valid under the current schema stays valid"


def parse(text: str) -> Any:
    """A JSON Schema document from its text; ValueError in one line when it is not one."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict | bool):
        raise ValueError("a JSON Schema is an object or a boolean")
    return doc


# -- the subset test: every instance valid under `a` is valid under `b` ------------------------


def outside(s: Any, at: str = "") -> Why:
    """The first place where the document leaves the understood subset, or None: checked
    whole before anything is compared, so the validator never meets a malformed keyword."""
    odd = _unknown(s, at)
    if odd is not None or isinstance(s, bool):
        return odd
    subschemas = [(f"{at}/properties/{_escape(n)}", x)
                  for n, x in s.get("properties", {}).items()]
    subschemas += [(f"{at}/{k}", s[k]) for k in ("items", "additionalProperties") if k in s]
    return next((w for p, x in subschemas if (w := outside(x, p)) is not None), None)


def subset(a: Any, b: Any, at: str = "") -> Why:
    """None when every instance valid under `a` is valid under `b` is proven, else where and
    what `b` loses of `a`. Both documents must be inside the subset (`outside`)."""
    odd = _unknown(a, at) or _unknown(b, at)
    if odd is not None:
        return odd
    if a is False or _empty_enum(a):
        return None
    if b is True or b == {} or _only_annotations(b):
        return None
    if b is False:
        return at, "admits nothing now"
    if a is True or _only_annotations(a):
        return at, "constrains a value that was unconstrained"
    if "enum" in a or "const" in a:
        values = a["enum"] if "enum" in a else [a["const"]]
        for v in values:
            if valid(a, v) and not valid(b, v):
                return at, f"no longer admits {_show(v)}"
        return None
    if "enum" in b or "const" in b:
        return at, "restricted to an enumeration"
    return _types(a, b, at) or _numbers(a, b, at) or _lengths(a, b, at) or \
        _arrays(a, b, at) or _objects(a, b, at)


def _unknown(s: Any, at: str) -> Why:
    if isinstance(s, bool):
        return None
    if not isinstance(s, dict):
        return at, "is not a schema (an object or a boolean)"
    for key in s:
        if key not in KEYWORDS and key not in ANNOTATIONS:
            return at, f"uses {key}, which the classifier does not understand"
    if "items" in s and not isinstance(s["items"], dict | bool):
        return f"{at}/items", "tuple items, which the classifier does not understand"
    if "type" in s and not _type_list(s["type"]):
        return f"{at}/type", "is not a type or a list of types"
    return _malformed(s, at)


def _malformed(s: dict[str, Any], at: str) -> Why:
    """Where a keyword the classifier understands has a value of the wrong shape."""
    shapes: dict[str, Callable[[Any], bool]] = {
        "required": lambda x: isinstance(x, list) and all(isinstance(n, str) for n in x),
        "properties": lambda x: isinstance(x, dict),
        "enum": lambda x: isinstance(x, list),
        **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
                        _number),
        **dict.fromkeys(("minLength", "maxLength", "minItems", "maxItems"),
                        lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0),
    }
    for key, ok in shapes.items():
        if key in s and not ok(s[key]):
            return f"{at}/{key}", "has a value of the wrong shape"
    return None


def _only_annotations(s: Any) -> bool:
    return isinstance(s, dict) and not (s.keys() & KEYWORDS)


def _empty_enum(s: Any) -> bool:
    return isinstance(s, dict) and s.get("enum") == []


def _type_list(t: Any) -> list[str] | None:
    ts = [t] if isinstance(t, str) else t
    if isinstance(ts, list) and ts and all(x in TYPES for x in ts):
        return ts
    return None


def types_of(s: dict[str, Any]) -> set[str]:
    """The JSON types `s` admits (`number` includes `integer`)."""
    ts = set(_type_list(s["type"]) or ()) if "type" in s else set(TYPES)
    if "number" in ts:
        ts.add("integer")
    return ts


def _types(a: dict[str, Any], b: dict[str, Any], at: str) -> Why:
    lost = types_of(a) - types_of(b)
    if lost:
        return f"{at}/type", f"no longer admits {', '.join(t for t in TYPES if t in lost)}"
    return None


Bound = tuple[int | float, bool] | None  # (value, exclusive); ints kept exact, never floated


def _bound(s: dict[str, Any], inclusive: str, exclusive: str) -> tuple[Bound, Bound]:
    inc: Any = s.get(inclusive)
    exc: Any = s.get(exclusive)
    return ((inc, False) if _number(inc) else None, (exc, True) if _number(exc) else None)


def _tighter(x: Bound, y: Bound, lower: bool) -> Bound:
    if x is None or y is None:
        return x or y
    if x[0] != y[0]:
        return x if (x[0] > y[0]) == lower else y
    return x if x[1] else y


def _implied(a: Bound, b: Bound, lower: bool) -> bool:
    """`a`'s bound is at least as tight as `b`'s (so `b` loses nothing `a` admits)."""
    if b is None:
        return True
    if a is None:
        return False
    if a[0] != b[0]:
        return (a[0] > b[0]) == lower
    return a[1] or not b[1]


def _numbers(a: dict[str, Any], b: dict[str, Any], at: str) -> Why:
    if not types_of(a) & {"number", "integer"}:
        return None
    for lower, inc, exc in ((True, "minimum", "exclusiveMinimum"),
                            (False, "maximum", "exclusiveMaximum")):
        ba, bb = _tighter(*_bound(a, inc, exc), lower), _tighter(*_bound(b, inc, exc), lower)
        if not _implied(ba, bb, lower):
            assert bb is not None  # nothing is implied only by a bound
            key = exc if bb[1] else inc
            return f"{at}/{key}", (f"{'raised' if lower else 'lowered'} to {_show(bb[0])} "
                                   f"(was {_describe(ba, inc, exc)})")
    return None


def _describe(bound: Bound, inclusive: str, exclusive: str) -> str:
    if bound is None:
        return "unbounded"
    return f"{exclusive if bound[1] else inclusive} {_show(bound[0])}"


def _count(s: dict[str, Any], low: str, high: str) -> tuple[int, float]:
    lo, hi = s.get(low, 0), s.get(high, math.inf)
    return (lo if _number(lo) else 0), (hi if _number(hi) else math.inf)


def _counted(a: dict[str, Any], b: dict[str, Any], at: str, kind: str, low: str,
             high: str) -> Why:
    if kind not in types_of(a):
        return None
    (alo, ahi), (blo, bhi) = _count(a, low, high), _count(b, low, high)
    if alo < blo:
        return f"{at}/{low}", f"raised to {_show(b[low])} (was {_show(a.get(low, 0))})"
    if ahi > bhi:
        return f"{at}/{high}", f"lowered to {_show(b[high])}" + (
            f" (was {_show(a[high])})" if high in a else " (was unbounded)")
    return None


def _lengths(a: dict[str, Any], b: dict[str, Any], at: str) -> Why:
    return _counted(a, b, at, "string", "minLength", "maxLength")


def _arrays(a: dict[str, Any], b: dict[str, Any], at: str) -> Why:
    counted = _counted(a, b, at, "array", "minItems", "maxItems")
    if counted is not None or "array" not in types_of(a):
        return counted
    return subset(a.get("items", True), b.get("items", True), f"{at}/items")


def _objects(a: dict[str, Any], b: dict[str, Any], at: str) -> Why:
    if "object" not in types_of(a):
        return None
    if not isinstance(a.get("additionalProperties", True), dict | bool) or \
            not isinstance(b.get("additionalProperties", True), dict | bool):
        return f"{at}/additionalProperties", "is not a schema"
    for name in b.get("required", []):
        if name not in a.get("required", []):
            return f"{at}/required", f"{name} became required"
    pa, pb = a.get("properties", {}), b.get("properties", {})
    extra_a, extra_b = a.get("additionalProperties", True), b.get("additionalProperties", True)
    for name in [*pa, *(n for n in pb if n not in pa)]:
        lost = subset(pa.get(name, extra_a), pb.get(name, extra_b),
                      f"{at}/properties/{_escape(name)}")
        if lost is not None:
            if name not in pb and pb.get(name, extra_b) is False:
                return f"{at}/properties/{_escape(name)}", "removed (additionalProperties: false)"
            return lost
    return subset(extra_a, extra_b, f"{at}/additionalProperties")


# -- a minimal validator for the same subset ----------------------------------------------------


def valid(s: Any, v: Any) -> bool:
    """Whether instance `v` (parsed JSON) is valid under schema `s` (the subset above; a keyword
    outside it is ignored, so use `subset`, not this, to decide)."""
    if isinstance(s, bool):
        return s
    if not isinstance(s, dict):
        return False
    if "type" in s and json_type(v) not in types_of(s):
        return False
    if "enum" in s and not any(same(v, e) for e in s["enum"]):
        return False
    if "const" in s and not same(v, s["const"]):
        return False
    checks: Mapping[str, Callable[[dict[str, Any], Any], bool]] = {
        "number": _valid_number, "integer": _valid_number, "string": _valid_string,
        "array": _valid_array, "object": _valid_object}
    check = checks.get(json_type(v))
    return check is None or check(s, v)


def _valid_number(s: dict[str, Any], v: Any) -> bool:
    return not (("minimum" in s and v < s["minimum"]) or ("maximum" in s and v > s["maximum"])
                or ("exclusiveMinimum" in s and v <= s["exclusiveMinimum"])
                or ("exclusiveMaximum" in s and v >= s["exclusiveMaximum"]))


def _valid_string(s: dict[str, Any], v: Any) -> bool:
    return bool(s.get("minLength", 0) <= len(v) <= s.get("maxLength", math.inf))


def _valid_array(s: dict[str, Any], v: Any) -> bool:
    if not s.get("minItems", 0) <= len(v) <= s.get("maxItems", math.inf):
        return False
    return all(valid(s.get("items", True), x) for x in v)


def _valid_object(s: dict[str, Any], v: Any) -> bool:
    if any(name not in v for name in s.get("required", [])):
        return False
    props = s.get("properties", {})
    extra = s.get("additionalProperties", True)
    return all(valid(props.get(k, extra), x) for k, x in v.items())


def json_type(v: Any) -> str:
    """The JSON type of a parsed value (`integer` for whole numbers, as JSON Schema counts)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def same(x: Any, y: Any) -> bool:
    """JSON equality: `true` is not `1`, `1` is `1.0`, objects compare by members."""
    tx, ty = json_type(x), json_type(y)
    if {tx, ty} <= {"integer", "number"}:
        return bool(x == y)
    if tx != ty:
        return False
    if tx == "array":
        return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y, strict=True))
    if tx == "object":
        return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    return bool(x == y)


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _show(v: Any) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
        v = int(v)
    return json.dumps(v, sort_keys=True)[:80]


# -- the way back a schema proposal must carry --------------------------------------------------

SCHEME = "schema:"


def is_schema(target_ref: str) -> bool:
    return target_ref.startswith(SCHEME)


def revert_problem(artefacts: list[str], revert: Any) -> str | None:
    """Why `revert` is not the backward-compatible revert of a schema change to `artefacts`
    (SPEC 09 §7.4), or None: `{"restore": {name: "sha256:<digest of the schema it replaces>"}}`
    for exactly those artefacts, so the reversal puts back the schema old readers know."""
    want = ('revert = {"restore": {<artefact>: "sha256:<digest of the schema it replaces>"}} '
            f"for {', '.join(sorted(artefacts)) or 'every artefact'}")
    if revert is None:
        return f"a schema change carries its backward-compatible revert (SPEC 09 §7.4): {want}"
    if not isinstance(revert, dict) or set(revert) != {"restore"} \
            or not isinstance(revert["restore"], dict):
        return f"the revert of a schema change restores the prior schema: {want}"
    restore = revert["restore"]
    if set(restore) != set(artefacts):
        return (f"the revert restores {sorted(restore)}, not the artefacts the change swaps "
                f"({sorted(artefacts)})")
    for name, digest in restore.items():
        if not (isinstance(digest, str) and digest.startswith("sha256:") and len(digest) == 71
                and all(c in "0123456789abcdef" for c in digest[7:])):
            return f"the revert's digest of {name} must be sha256:<64 lowercase hex>"
    return None


def base_problem(revert: Mapping[str, Any], head: Mapping[str, str | None]) -> str | None:
    """Why the revert does not go back to the schema the owner holds now (`head`: artefact →
    digest), or None. The proposer's claim of the base is checked, never believed."""
    for name, digest in sorted(revert["restore"].items()):
        if head.get(name) != digest:
            return (f"the revert restores {name} to {digest}, but the current schema is "
                    f"{head.get(name)}: re-propose against the current schema")
    return None
