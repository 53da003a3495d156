"""A strict parser for the CAL Tier-1 batch a proposal may carry (`proposal_cal`).

A proposal_cal is CAL written by an analyzer and executed later under someone else's authority,
so this module accepts only the non-destructive, invertible subset (OMS §3.4, §7; DESIGN §3.2,
§4) and refuses everything else with a :class:`CalError` naming the offending word or field.

Grammar as implemented (keywords case-insensitive; identifiers are ASCII and compared lowercased)::

    batch      = sep* statement (sep+ statement)* sep*
    sep        = ";" | a newline that follows a complete statement
    statement  = add | supersede | revert
    add        = "ADD" type set{1,6} reason            type: fact observation goal workflow skill
    supersede  = "SUPERSEDE" (hash | plural "WHERE" cond {"AND" cond}) set{1,4} reason
    revert     = "REVERT" hash reason
    set        = "SET" field "=" literal
    cond       = field "=" literal
    reason     = ("REASON" | "BECAUSE") string        1..500 characters after NFC
    literal    = string | number | hash | "[" [item {"," item}] "]"   item: string|number|hash
    hash       = "sha256:" lowercase-hex{8,64}          (OMS: uppercase addresses are refused)
    string     = '"' … '"'   escapes \\" \\\\ \\n \\r \\t \\uXXXX; raw control characters refused
    number     = JSON-style int (int64) or finite float

Statement separator: every statement ends with its REASON literal, so the end is never
ambiguous. Inside a statement a newline is plain whitespace (long statements may wrap); after
the REASON the next token must be ``;``, a newline, or the end of the text. ``ADD … REASON "a"
ADD …`` on one line is therefore refused. Blank lines and repeated/trailing ``;`` are allowed.
Workflow graph syntax (``->``, ``WHEN``, ``BIND``) and ``$parameters`` are refused: a stored
proposal has nothing to bind them to.

Field rules: SUPERSEDE may SET only the evolve fields (object, confidence, importance, tags);
ADD may SET CAL's add_field/grain_add_field list, plus description for goal/skill and the skill
definition fields for skill. ``confidence``/``importance`` are numbers in [0, 1]; ``tags`` is a
list of strings. Quotas (MAX_ADD_PER_MINUTE …) belong to the applier, not the parser.

Error codes (``CalError.code``): CAL's own where it has one — E001 over 8192 bytes, E015 bad
hash, E016 REASON over 500 characters, E017 unknown evolve field, E018 missing REASON, E019
SUPERSEDE without SET, E042 type not evolvable, E045 namespace/user_id SET, E050 missing
required field, E051 type not addable, E070 invalid UTF-8 (or lone surrogate), E071 bidi
control character — and descriptive ones otherwise: ``destructive`` (a forbidden token outside a
string literal; checked before any other syntax error), ``status_forbidden`` (SET of an
index-layer field such as rec_status), ``unknown_verb``, ``unknown_field``, ``duplicate_field``,
``too_many_sets``, ``bad_value``, ``empty``, ``syntax``. ``position`` is a character offset into
the text (a byte offset for E001/E070 on ``bytes`` input).

Inverse plan (``inverse``): a list of JSON-able dicts, one per statement, last statement first,
so applying them in order undoes the batch (OMS §3.6)::

    ADD       {"op": "retract", "statement": i, "added": i, "target": addr | None,
               "invalidation_type": "retraction"}
    SUPERSEDE {"op": "supersede", "statement": i, "target": new_head | None,
               "restore_from": "sha256:…" | ["sha256:…", …]
                               | {"grain_type": "facts", "where": {field: value}}}
    REVERT    {"op": "supersede", "statement": i, "target": head_after_revert | None,
               "restore_from": "sha256:<the reverted head>"}

``target`` is the grain the inverse supersedes. It exists only after apply, so it is None unless
the applier passes ``prior``: a mapping keyed by the statement index as a decimal string, whose
value is either the address the statement produced, or ``{"new": addr, "old": addr | [addr]}``
where ``old`` is what the statement actually superseded. A WHERE selector in ``restore_from`` is
only a fallback; an applier should record the resolved ``old`` addresses, because after apply the
selector matches the new head.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ADDABLE",
    "ADD_FIELDS",
    "EVOLVE_FIELDS",
    "FORBIDDEN",
    "MAX_BYTES",
    "MAX_REASON",
    "REQUIRED",
    "SCOPE_FIELDS",
    "STATUS_FIELDS",
    "Add",
    "Batch",
    "CalError",
    "Hash",
    "Revert",
    "Selector",
    "Statement",
    "Supersede",
    "inverse",
    "parse",
    "render",
    "rollbackable",
    "touches_namespace",
]

MAX_BYTES = 8192  # CAL MAX_QUERY_LENGTH, OMS rule 9
MAX_REASON = 500
MAX_ADD_SETS = 6
MAX_SUPERSEDE_SETS = 4

# CAL 1.1 forbidden tokens plus TOKEN from 1.3: parse errors wherever they appear as a word.
FORBIDDEN = frozenset(
    "DELETE DROP FORGET ERASE DESTROY PURGE TRUNCATE INSERT CREATE WRITE STORE KEY ENCRYPT "
    "DECRYPT ROTATE MASTER DEK SECRET POLICY SEAL UNSEAL GRANT REVOKE CONSENT RESTRICT SCHEMA "
    "PARTITION INDEX MIGRATION TOKEN".split()
)
# Index-layer fields (OMS §1.2, §6.1; canonical.INDEX_LAYER_FIELDS) and their compact keys:
# rebuilt from the audit chain, so a write that sets one would forge state.
STATUS_FIELDS = frozenset({
    "rec_status", "status", "verification_status", "superseded_by", "system_valid_to",
    "access_count", "last_accessed_at", "rstat", "vstatus", "sb", "svt", "ac", "laa",
})
# Bound by the capability token at execution time, never by the batch (E045).
SCOPE_FIELDS = frozenset({"namespace", "user_id", "ns", "user"})
EVOLVE_FIELDS = frozenset({"object", "confidence", "importance", "tags"})
ADDABLE = ("fact", "observation", "goal", "workflow", "skill")
_PLURALS = {t + "s": t for t in ADDABLE}
_COMMON = frozenset({"subject", "relation", "object", "confidence", "importance", "tags",
                     "goal_state", "assigned_agent", "deadline", "depends_on", "observer_id",
                     "observer_type"})
_SKILL = frozenset({"name", "description", "instructions", "when_to_use", "version",
                    "allowed_tools", "resources", "dependencies", "input_modalities",
                    "output_modalities", "domain"})
ADD_FIELDS: dict[str, frozenset[str]] = {
    "fact": _COMMON, "observation": _COMMON, "workflow": _COMMON,
    "goal": _COMMON | {"description"}, "skill": _COMMON | _SKILL,
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "fact": ("subject", "relation", "object"), "skill": ("name", "description"),
}
_VERBS = ("ADD", "SUPERSEDE", "REVERT")
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_HEX_RUN = re.compile(r"[0-9A-Za-z]*")
_HEX = re.compile(r"[0-9a-f]{8,64}")
_INT64 = (-(2**63), 2**63 - 1)


class CalError(ValueError):
    """A refused batch: ``code`` is stable for callers, ``message`` is for people."""

    def __init__(self, code: str, message: str, position: int | None = None) -> None:
        super().__init__(f"{code} at {position}: {message}")
        self.code = code
        self.message = message
        self.position = position


@dataclass(frozen=True)
class Hash:
    """A ``sha256:`` literal: a grain address or a unique prefix of one (8–64 hex)."""

    hex: str

    def __str__(self) -> str:
        return f"sha256:{self.hex}"


Scalar = str | int | float | Hash
Value = Scalar | tuple[Scalar, ...]
Pairs = tuple[tuple[str, Value], ...]


@dataclass(frozen=True)
class Selector:
    """``<plural> WHERE f = v AND …``: the OMS example's way to name the grains to evolve."""

    grain_type: str  # plural, as written: "facts"
    where: Pairs


@dataclass(frozen=True)
class Add:
    grain_type: str
    sets: Pairs
    reason: str


@dataclass(frozen=True)
class Supersede:
    target: Hash | Selector
    sets: Pairs
    reason: str


@dataclass(frozen=True)
class Revert:
    target: Hash
    reason: str


Statement = Add | Supersede | Revert
Batch = tuple[Statement, ...]


# ---------------------------------------------------------------------------------- lexing

@dataclass(frozen=True)
class _Tok:
    kind: str  # word string number hash = ; [ ] , eof
    value: object
    pos: int
    nl_before: bool


def _decode(text: str | bytes) -> str:
    """Size first (the limit is in bytes), then encoding: a str may still hold lone surrogates."""
    if isinstance(text, bytes | bytearray):
        raw = bytes(text)
        if len(raw) > MAX_BYTES:
            raise CalError("E001", f"proposal_cal is {len(raw)} bytes; the limit is {MAX_BYTES}",
                           MAX_BYTES)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CalError("E070", f"invalid UTF-8: {exc.reason}", exc.start) from None
    if not isinstance(text, str):
        raise CalError("syntax", f"proposal_cal must be text, not {type(text).__name__}", 0)
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_BYTES:
        at = len(raw[:MAX_BYTES].decode("utf-8", "ignore"))
        raise CalError("E001", f"proposal_cal is {len(raw)} bytes; the limit is {MAX_BYTES}", at)
    if m := _SURROGATE.search(text):
        raise CalError("E070", f"invalid UTF-8: lone surrogate U+{ord(m.group()):04X}", m.start())
    return text


def _check_text(s: str, pos: int) -> None:
    """Bidi controls can make a reviewer read a different batch than the applier runs."""
    if m := _BIDI.search(s):
        raise CalError("E071", f"bidi control character U+{ord(m.group()):04X} is not allowed",
                       pos + m.start())


def _string_end(src: str, start: int) -> int:
    """Index just past the closing quote, found before decoding so an escape error inside a
    literal never lets its words be scanned as keywords."""
    i, n = start + 1, len(src)
    while i < n:
        if src[i] == '"':
            return i + 1
        i += 2 if src[i] == "\\" else 1
    raise CalError("syntax", "unterminated string literal", start)


_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "r": "\r", "t": "\t"}


def _string(src: str, start: int, end: int) -> str:
    """Decode the literal src[start:end] (quotes included) and NFC it."""
    out: list[str] = []
    i = start + 1
    while i < end - 1:
        c = src[i]
        if c == "\\":
            e = src[i + 1]
            if e in _SIMPLE_ESCAPES:
                out.append(_SIMPLE_ESCAPES[e])
                i += 2
                continue
            if e == "u" and re.fullmatch(r"[0-9A-Fa-f]{4}", src[i + 2:i + 6]):
                ch = chr(int(src[i + 2:i + 6], 16))
                if _SURROGATE.match(ch):
                    raise CalError("E070", f"\\u{ord(ch):04X} is a lone surrogate", i)
                _check_text(ch, i)
                out.append(ch)
                i += 6
                continue
            raise CalError("syntax", f"unknown escape \\{e} in string literal "
                           '(use \\" \\\\ \\n \\r \\t or \\uXXXX)', i)
        if unicodedata.category(c) == "Cc":
            raise CalError("syntax", f"raw control character U+{ord(c):04X} in string literal; "
                           "escape it", i)
        out.append(c)
        i += 1
    return unicodedata.normalize("NFC", "".join(out))


def _lex(src: str) -> list[_Tok]:
    """Tokens, with destructive words taking precedence over every other syntax error."""
    toks: list[_Tok] = []
    error: CalError | None = None
    i, n, nl = 0, len(src), False

    def fail(err: CalError) -> None:
        nonlocal error
        error = error or err

    while i < n:
        c = src[i]
        if c in " \t\r\n":
            nl = nl or c == "\n"
            i += 1
            continue
        if c == '"':
            try:
                end = _string_end(src, i)
            except CalError as exc:
                fail(exc)
                break
            try:
                toks.append(_Tok("string", _string(src, i, end), i, nl))
            except CalError as exc:
                fail(exc)
            i, nl = end, False
            continue
        if m := _WORD.match(src, i):
            word = m.group()
            end = m.end()
            if word.lower() == "sha256" and src.startswith(":", end):
                h = _HEX_RUN.match(src, end + 1)
                assert h is not None
                digits = h.group()
                if word != "sha256" or not _HEX.fullmatch(digits):
                    fail(CalError("E015", _bad_hash(word, digits), i))
                toks.append(_Tok("hash", Hash(digits), i, nl))
                i, nl = h.end(), False
                continue
            if word.upper() in FORBIDDEN:
                raise CalError("destructive", f"{word!r} is a forbidden CAL token: a proposal_cal "
                               "carries only non-destructive ADD, SUPERSEDE and REVERT", i)
            toks.append(_Tok("word", word, i, nl))
            i, nl = end, False
            continue
        if m := _NUMBER.match(src, i):
            end = m.end()
            if end < n and (src[end].isalnum() or src[end] in "_."):
                fail(CalError("syntax", f"malformed number near {src[i:end + 1]!r}", i))
            toks.append(_Tok("number", m.group(), i, nl))
            i, nl = end, False
            continue
        if c in "=;[],":
            toks.append(_Tok(c, c, i, nl))
            i, nl = i + 1, False
            continue
        if c == "$":
            fail(CalError("syntax", "parameters ($name) cannot appear in a stored proposal_cal: "
                          "there is nothing to bind them to", i))
        elif src.startswith("->", i):
            fail(CalError("syntax", "workflow graph syntax (->) is not accepted in a "
                          "proposal_cal; use ADD workflow SET …", i))
        else:
            fail(CalError("syntax", f"unexpected character {c!r} (U+{ord(c):04X})", i))
        i += 1
    if error is not None:
        raise error
    toks.append(_Tok("eof", None, n, nl))
    return toks


def _bad_hash(prefix: str, digits: str) -> str:
    if prefix != "sha256":
        return f"hash literal prefix must be lowercase 'sha256:', got {prefix!r}"
    if digits != digits.lower():
        return f"hash literal sha256:{digits} is uppercase; OMS addresses are lowercase hex"
    if re.fullmatch(r"[0-9a-fA-F]*", digits) is None:
        return f"hash literal sha256:{digits} is not hex"
    return f"hash literal needs 8-64 hex digits after 'sha256:', got {len(digits)}"


# --------------------------------------------------------------------------------- parsing

class _Parser:
    def __init__(self, toks: list[_Tok]) -> None:
        self.toks = toks
        self.i = 0

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def next(self) -> _Tok:
        tok = self.toks[self.i]
        if tok.kind != "eof":
            self.i += 1
        return tok

    def is_kw(self, *words: str) -> bool:
        tok = self.peek()
        return tok.kind == "word" and str(tok.value).upper() in words

    def batch(self) -> Batch:
        out: list[Statement] = []
        while True:
            while self.peek().kind == ";":
                self.next()
            if self.peek().kind == "eof":
                break
            out.append(self.statement())
            tok = self.peek()
            if tok.kind not in (";", "eof") and not tok.nl_before:
                raise CalError("syntax", f"expected ';' or a newline after REASON, got "
                               f"{_show(tok)}", tok.pos)
        if not out:
            raise CalError("empty", "proposal_cal holds no statement", 0)
        return tuple(out)

    def statement(self) -> Statement:
        tok = self.next()
        if tok.kind != "word":
            raise CalError("syntax", f"expected a verb (ADD, SUPERSEDE, REVERT), got {_show(tok)}",
                           tok.pos)
        verb = str(tok.value).upper()
        if verb == "ADD":
            return self.add()
        if verb == "SUPERSEDE":
            return self.supersede(tok)
        if verb == "REVERT":
            return Revert(self.hash("REVERT"), self.reason("REVERT", tok))
        raise CalError("unknown_verb", f"unknown verb {tok.value!r}: a proposal_cal may only "
                       "ADD, SUPERSEDE or REVERT", tok.pos)

    def add(self) -> Add:
        tok = self.next()
        if tok.kind != "word":
            raise CalError("syntax", f"expected a grain type after ADD, got {_show(tok)}", tok.pos)
        gtype = str(tok.value).lower()
        if gtype not in ADD_FIELDS:
            why = " (recommendations are query-only)" if gtype.startswith("recommendation") else ""
            raise CalError("E051", f"{tok.value!r} is not an addable grain type{why}; addable: "
                           + ", ".join(ADDABLE), tok.pos)
        sets = self.sets(ADD_FIELDS[gtype], MAX_ADD_SETS, f"ADD {gtype}")
        reason = self.reason("ADD", tok)
        missing = [f for f in REQUIRED.get(gtype, ()) if f not in dict(sets)]
        if missing:
            raise CalError("E050", f"ADD {gtype} is missing required field(s): "
                           + ", ".join(missing), tok.pos)
        if not sets:
            raise CalError("E050", f"ADD {gtype} needs at least one SET", tok.pos)
        return Add(gtype, sets, reason)

    def supersede(self, verb: _Tok) -> Supersede:
        tok = self.peek()
        target: Hash | Selector
        if tok.kind == "word":
            self.next()
            plural = str(tok.value).lower()
            if plural not in _PLURALS:
                hint = f" (write the plural {plural + 's'!r})" if plural in ADD_FIELDS else ""
                raise CalError("E042", f"{tok.value!r} cannot be superseded by a proposal{hint}; "
                               "use a sha256: address or one of " + ", ".join(_PLURALS), tok.pos)
            if not self.is_kw("WHERE"):
                raise CalError("syntax", f"expected WHERE after {tok.value!r}, got "
                               f"{_show(self.peek())}", self.peek().pos)
            self.next()
            target = Selector(plural, self.where())
        else:
            target = self.hash("SUPERSEDE")
        if not self.is_kw("SET"):
            nxt = self.peek()
            if self.is_kw("REASON", "BECAUSE", *_VERBS) or nxt.kind in (";", "eof"):
                raise CalError("E019", "SUPERSEDE needs at least one SET clause", verb.pos)
            want = "AND or SET" if isinstance(target, Selector) else "SET"
            raise CalError("syntax", f"expected {want}, got {_show(nxt)}", nxt.pos)
        sets = self.sets(EVOLVE_FIELDS, MAX_SUPERSEDE_SETS, "SUPERSEDE")
        return Supersede(target, sets, self.reason("SUPERSEDE", verb))

    def hash(self, verb: str) -> Hash:
        tok = self.next()
        if tok.kind != "hash":
            raise CalError("E015", f"{verb} needs a hash literal sha256:<8-64 lowercase hex> "
                           f"(unquoted), got {_show(tok)}", tok.pos)
        assert isinstance(tok.value, Hash)
        return tok.value

    def where(self) -> Pairs:
        conds: list[tuple[str, Value]] = []
        while True:
            tok = self.next()
            if tok.kind != "word":
                raise CalError("syntax", f"expected a field name in WHERE, got {_show(tok)}",
                               tok.pos)
            name = str(tok.value).lower()
            if name in dict(conds):
                raise CalError("duplicate_field", f"WHERE names {name!r} twice", tok.pos)
            self.expect_eq(name)
            value = self.literal()
            if name in ("namespace", "ns") and not isinstance(value, str):
                raise CalError("bad_value", "WHERE namespace must be a string", tok.pos)
            conds.append((name, value))
            if not self.is_kw("AND"):
                return tuple(conds)
            self.next()

    def sets(self, allowed: frozenset[str], limit: int, what: str) -> Pairs:
        out: list[tuple[str, Value]] = []
        while self.is_kw("SET"):
            kw = self.next()
            if len(out) == limit:
                raise CalError("too_many_sets", f"{what} allows at most {limit} SET clauses",
                               kw.pos)
            tok = self.next()
            if tok.kind != "word":
                raise CalError("syntax", f"expected a field name after SET, got {_show(tok)}",
                               tok.pos)
            name = str(tok.value).lower()
            if name in STATUS_FIELDS:
                raise CalError("status_forbidden", f"SET {name} is refused: status and other "
                               "index-layer fields are derived from the audit chain, never "
                               "written", tok.pos)
            if name in SCOPE_FIELDS:
                raise CalError("E045", f"SET {name} is refused: namespace and user_id come from "
                               "the executing capability, never from the batch", tok.pos)
            if name not in allowed:
                if allowed is EVOLVE_FIELDS:
                    raise CalError("E017", f"{name!r} is not an evolve field; SUPERSEDE may SET "
                                   "only " + ", ".join(sorted(EVOLVE_FIELDS)), tok.pos)
                raise CalError("unknown_field", f"{what} cannot SET {name!r}", tok.pos)
            if name in dict(out):
                raise CalError("duplicate_field", f"{what} sets {name!r} twice", tok.pos)
            self.expect_eq(name)
            vtok = self.peek()
            value = self.literal()
            _check_value(name, value, vtok.pos)
            out.append((name, value))
        return tuple(out)

    def expect_eq(self, name: str) -> None:
        tok = self.next()
        if tok.kind != "=":
            raise CalError("syntax", f"expected '=' after {name}, got {_show(tok)}", tok.pos)

    def literal(self) -> Value:
        tok = self.next()
        if tok.kind == "[":
            items: list[Scalar] = []
            if self.peek().kind == "]":
                self.next()
                return ()
            while True:
                items.append(self.scalar(self.next()))
                sep = self.next()
                if sep.kind == "]":
                    return tuple(items)
                if sep.kind != ",":
                    raise CalError("syntax", f"expected ',' or ']' in list, got {_show(sep)}",
                                   sep.pos)
        return self.scalar(tok)

    def scalar(self, tok: _Tok) -> Scalar:
        if tok.kind == "string":
            return str(tok.value)
        if isinstance(tok.value, Hash):
            return tok.value
        if tok.kind == "number":
            return _number(str(tok.value), tok.pos)
        hint = " (string literals are double-quoted)" if tok.kind == "word" else ""
        raise CalError("syntax", f"expected a literal, got {_show(tok)}{hint}", tok.pos)

    def reason(self, verb: str, at: _Tok) -> str:
        if not self.is_kw("REASON", "BECAUSE"):
            tok = self.peek()
            if tok.kind in (";", "eof") or self.is_kw(*_VERBS):
                raise CalError("E018", f"{verb} has no REASON: every write must say why", at.pos)
            want = "REASON" if verb == "REVERT" else "SET or REASON"
            raise CalError("syntax", f"expected {want} in {verb}, got {_show(tok)}", tok.pos)
        kw = self.next()
        tok = self.next()
        if tok.kind != "string":
            raise CalError("syntax", f"{str(kw.value).upper()} needs a double-quoted string, got "
                           f"{_show(tok)}", tok.pos)
        text = str(tok.value)
        if not text.strip():
            raise CalError("E018", f"{verb} has an empty REASON", tok.pos)
        if len(text) > MAX_REASON:
            raise CalError("E016", f"REASON is {len(text)} characters; the limit is {MAX_REASON}",
                           tok.pos)
        return text


def _number(text: str, pos: int) -> int | float:
    if re.fullmatch(r"-?[0-9]+", text):
        if len(text.lstrip("-")) > 19 or not _INT64[0] <= int(text) <= _INT64[1]:
            raise CalError("bad_value", f"integer {text} does not fit in int64", pos)
        return int(text)
    value = float(text)
    if not math.isfinite(value):
        raise CalError("bad_value", f"number {text} is not finite", pos)
    return value


def _check_value(name: str, value: Value, pos: int) -> None:
    if name in ("confidence", "importance"):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise CalError("bad_value", f"{name} must be a number in [0, 1]", pos)
    elif name == "tags":
        if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
            raise CalError("bad_value", "tags must be a list of strings", pos)


def _show(tok: _Tok) -> str:
    if tok.kind == "eof":
        return "end of text"
    if tok.kind == "string":
        return "a string literal"
    return repr(str(tok.value))


def parse(text: str | bytes) -> Batch:
    """Parse a proposal_cal, or raise CalError: never any other exception, whatever the input."""
    src = _decode(text)
    _check_text(src, 0)
    return _Parser(_lex(src)).batch()


# ------------------------------------------------------------------------------- rendering

_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _render_scalar(v: Scalar) -> str:
    if isinstance(v, str):
        return '"' + "".join(
            _ESCAPES.get(c) or (f"\\u{ord(c):04x}" if unicodedata.category(c) == "Cc" else c)
            for c in v
        ) + '"'
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _render_value(v: Value) -> str:
    if isinstance(v, tuple):
        return "[" + ", ".join(_render_scalar(x) for x in v) + "]"
    return _render_scalar(v)


def _render_sets(sets: Pairs) -> str:
    return "".join(f" SET {k} = {_render_value(v)}" for k, v in sets)


def render(batch: Batch) -> str:
    """Canonical text of a batch: one statement per line, so an applier can log what it ran."""
    lines = []
    for s in batch:
        if isinstance(s, Add):
            head = f"ADD {s.grain_type}{_render_sets(s.sets)}"
        elif isinstance(s, Supersede):
            if isinstance(s.target, Selector):
                conds = " AND ".join(f"{k} = {_render_value(v)}" for k, v in s.target.where)
                tgt = f"{s.target.grain_type} WHERE {conds}"
            else:
                tgt = str(s.target)
            head = f"SUPERSEDE {tgt}{_render_sets(s.sets)}"
        else:
            head = f"REVERT {s.target}"
        lines.append(f"{head} REASON {_render_scalar(s.reason)}")
    return "\n".join(lines)


# --------------------------------------------------------------------- inverse and scoping

def _json(v: Value) -> object:
    if isinstance(v, tuple):
        return [_json(x) for x in v]
    return str(v) if isinstance(v, Hash) else v


def _prior(prior: Mapping[str, object] | None, i: int) -> tuple[object, object]:
    entry = (prior or {}).get(str(i))
    if entry is None or isinstance(entry, str):
        return entry, None
    if isinstance(entry, Mapping):
        return entry.get("new"), entry.get("old")
    raise ValueError(f"prior[{str(i)!r}] must be an address or a {{'new', 'old'}} mapping")


def inverse(batch: Batch, prior: Mapping[str, object] | None = None) -> list[dict[str, object]]:
    """The store-operation plan that undoes ``batch`` (OMS §3.6), last statement first.

    Derived from the batch itself, so it can be recorded at apply time and replayed later
    without reconstructing anything; see the module docstring for the shape and ``prior``.
    """
    plan: list[dict[str, object]] = []
    for i in reversed(range(len(batch))):
        s = batch[i]
        new, old = _prior(prior, i)
        if isinstance(s, Add):
            plan.append({"op": "retract", "statement": i, "added": i, "target": new,
                         "invalidation_type": "retraction"})
            continue
        restore: object
        if old is not None:
            restore = old
        elif isinstance(s.target, Selector):
            restore = {"grain_type": s.target.grain_type,
                       "where": {k: _json(v) for k, v in s.target.where}}
        else:
            restore = str(s.target)
        plan.append({"op": "supersede", "statement": i, "target": new, "restore_from": restore})
    return plan


def rollbackable(batch: Batch) -> bool:
    """True: every statement parse accepts is Tier-1, and Tier-1 always has an inverse."""
    return all(isinstance(s, Add | Supersede | Revert) for s in batch)


def touches_namespace(batch: Batch) -> set[str]:
    """Namespaces the batch names explicitly, so an applier can refuse writes outside its own."""
    out: set[str] = set()
    for s in batch:
        if isinstance(s, Supersede) and isinstance(s.target, Selector):
            out.update(str(v) for k, v in s.target.where if k in ("namespace", "ns"))
    return out
