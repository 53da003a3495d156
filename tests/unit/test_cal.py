"""The proposal_cal parser: the Tier-1 grammar, every refusal, the inverse plan, and properties
(arbitrary text only ever raises CalError; parse(render(batch)) == batch)."""

from __future__ import annotations

import json
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.protocol import cal, canonical
from improved.protocol.cal import Add, CalError, Hash, Revert, Selector, Supersede

H1 = "sha256:" + "a1" * 32
H2 = "sha256:0badc0de"
OMS_EXAMPLE = ('SUPERSEDE facts WHERE subject = "user:john-smith" AND relation = '
               '"preferred_activity" SET object = "morning_run_5k" REASON "merge 7 duplicate '
               'extractions"')
FACT = 'ADD fact SET subject = "alice" SET relation = "likes" SET object = "tea" REASON "said so"'


def refused(text: str | bytes, code: str, *words: str) -> CalError:
    with pytest.raises(CalError) as info:
        cal.parse(text)
    err = info.value
    assert err.code == code, err
    for w in words:
        assert w in err.message, (w, err.message)
    assert isinstance(err.position, int)
    return err


# ------------------------------------------------------------------------------ happy paths

def test_add_fact():
    (s,) = cal.parse(FACT)
    assert s == Add("fact", (("subject", "alice"), ("relation", "likes"), ("object", "tea")),
                    "said so")


def test_add_other_types():
    batch = cal.parse(
        'ADD skill SET name = "code_review" SET description = "review diffs" '
        'SET allowed_tools = ["git", "grep"] REASON "new skill"\n'
        'ADD goal SET description = "ship" SET goal_state = "active" SET deadline = 1742601600000 '
        'SET depends_on = [sha256:0badc0de] REASON "plan"\n'
        'ADD observation SET observer_id = "x" SET observer_type = "llm" SET object = "seen" '
        'SET confidence = 0.75 REASON "saw it"\n'
        'ADD workflow SET subject = "deploy" SET tags = [] REASON "flow"'
    )
    assert [s.grain_type for s in batch] == ["skill", "goal", "observation", "workflow"]
    assert dict(batch[0].sets)["allowed_tools"] == ("git", "grep")
    assert dict(batch[1].sets) == {"description": "ship", "goal_state": "active",
                                   "deadline": 1742601600000,
                                   "depends_on": (Hash("0badc0de"),)}
    assert dict(batch[2].sets)["confidence"] == 0.75


def test_supersede_by_hash():
    (s,) = cal.parse(f'SUPERSEDE {H1} SET object = "coffee" SET confidence = 1 '
                     'SET importance = 0.5 SET tags = ["a", "b"] REASON "corrected"')
    assert s == Supersede(Hash("a1" * 32), (("object", "coffee"), ("confidence", 1),
                                            ("importance", 0.5), ("tags", ("a", "b"))),
                          "corrected")


def test_oms_example_where_form():
    (s,) = cal.parse(OMS_EXAMPLE)
    assert s == Supersede(
        Selector("facts", (("subject", "user:john-smith"), ("relation", "preferred_activity"))),
        (("object", "morning_run_5k"),), "merge 7 duplicate extractions")
    assert cal.render((s,)) == OMS_EXAMPLE


def test_revert():
    assert cal.parse(f'REVERT {H2} REASON "regressed"') == (Revert(Hash("0badc0de"),
                                                                    "regressed"),)


def test_keywords_case_insensitive_and_because():
    lower = cal.parse('add Fact set Subject = "alice" Set RELATION = "likes" sEt object = "tea" '
                      'because "said so"')
    assert lower == cal.parse(FACT)
    assert cal.parse(f'revert {H2} Reason "x"') == (Revert(Hash("0badc0de"), "x"),)
    assert cal.parse(OMS_EXAMPLE.replace("WHERE", "where").replace("AND", "and")
                     .replace("facts", "FACTS")) == cal.parse(OMS_EXAMPLE)


def test_string_escapes():
    (s,) = cal.parse(r'ADD fact SET subject = "say \"hi\"" SET relation = "back\\slash" '
                     r'SET object = "a\nb\tc\u00e9" REASON "quote \" inside"')
    assert dict(s.sets) == {"subject": 'say "hi"', "relation": "back\\slash",
                            "object": "a\nb\tc\u00e9"}
    assert s.reason == 'quote " inside'


def test_literals_are_nfc():
    decomposed = "cafe\u0301"
    (s,) = cal.parse(f'ADD fact SET subject = "{decomposed}" SET relation = "r" '
                     f'SET object = "x\\u0065\\u0301" REASON "{decomposed}"')
    assert dict(s.sets)["subject"] == "caf\u00e9"
    assert dict(s.sets)["object"] == "x\u00e9"
    assert s.reason == "caf\u00e9"


def test_separators_semicolon_and_newline():
    rev = f'REVERT {H2} REASON "x"'
    expected = cal.parse(FACT) + cal.parse(rev)
    assert cal.parse(f"{FACT}; {rev}") == expected
    assert cal.parse(f"{FACT}\n{rev}") == expected
    assert cal.parse(f"\n;\n{FACT};;\n\n{rev};\n") == expected
    # inside a statement a newline is only whitespace
    wrapped = FACT.replace(" SET", "\n  SET").replace(" REASON", "\nREASON")
    assert cal.parse(wrapped) == cal.parse(FACT)


def test_statements_on_one_line_need_a_semicolon():
    refused(f'{FACT} REVERT {H2} REASON "x"', "syntax", "';' or a newline")


def test_forbidden_words_inside_strings_are_fine():
    (s,) = cal.parse('ADD fact SET subject = "DROP TABLE" SET relation = "delete" '
                     'SET object = "grant token key" REASON "do not delete anything"')
    assert s.reason == "do not delete anything"


def test_numbers():
    (s,) = cal.parse(f"SUPERSEDE {H1} SET confidence = 0 SET importance = 1e-3 REASON \"n\"")
    assert dict(s.sets) == {"confidence": 0, "importance": 0.001}


# ------------------------------------------------------------------------------- refusals

def test_too_long():
    stmt = FACT + "\n"
    pad = cal.MAX_BYTES - len(stmt.encode())
    ok = stmt + " " * pad
    assert len(ok.encode()) == 8192 and len(cal.parse(ok)) == 1
    err = refused(ok + " ", "E001", "8193 bytes", "8192")
    assert err.position == 8192
    # the limit counts bytes, not characters
    refused(FACT.replace("tea", "\u00e9" * 4096), "E001")
    refused((ok + " ").encode(), "E001")


@pytest.mark.parametrize("word", sorted(cal.FORBIDDEN))
def test_every_forbidden_word_is_destructive(word):
    err = refused(f'{word} facts WHERE subject = "x"', "destructive", word)
    assert err.position == 0
    refused(f'ADD fact SET subject = "a" SET relation = "b" SET object = "c" REASON "r"\n'
            f'{word.lower()} x', "destructive", word.lower())


def test_destructive_anywhere_outside_strings_and_before_other_errors():
    err = refused('ADD fact SET key = "x" REASON "y"', "destructive", "key")
    assert err.position == 13
    refused('ADD fact -> @@@ "unterminated FORGET', "syntax")  # the word is inside the string
    refused('ADD fact -> @@@ FORGET', "destructive", "FORGET")  # beats the earlier bad chars
    refused('ADD fact SET subject = "\\q" Purge', "destructive", "Purge")


@pytest.mark.parametrize("field", ["rec_status", "status", "verification_status",
                                   "superseded_by", "system_valid_to", "REC_STATUS", "rstat"])
def test_status_is_never_set(field):
    refused(f'SUPERSEDE {H1} SET {field} = "approved" REASON "approve myself"',
            "status_forbidden", field.lower())
    refused(f'ADD fact SET subject = "a" SET relation = "b" SET object = "c" '
            f'SET {field} = "applied" REASON "x"', "status_forbidden", field.lower())


def test_status_fields_cover_the_index_layer():
    assert canonical.INDEX_LAYER_FIELDS <= cal.STATUS_FIELDS


@pytest.mark.parametrize("field", ["namespace", "user_id"])
def test_namespace_and_user_id_never_set(field):
    refused(f'ADD fact SET {field} = "other" SET subject = "a" SET relation = "b" '
            'SET object = "c" REASON "x"', "E045", field)
    refused(f'SUPERSEDE {H1} SET {field} = "other" REASON "x"', "E045", field)


@pytest.mark.parametrize("text,code,words", [
    ('RECALL facts WHERE subject = "x"', "unknown_verb", ["RECALL"]),
    ('EXPLAIN ADD fact SET subject = "x"', "unknown_verb", ["EXPLAIN"]),
    ('ADD fact SET subject = "a" SET relation = "b" SET object = "c"', "E018", ["REASON"]),
    ('ADD fact SET subject = "a" SET relation = "b" SET object = "c";', "E018", ["REASON"]),
    (f'ADD fact SET subject = "a" SET relation = "b" SET object = "c"\nREVERT {H2} REASON "x"',
     "E018", ["ADD"]),
    (f'REVERT {H2}', "E018", ["REVERT"]),
    (f'REVERT {H2} REASON "   "', "E018", ["empty"]),
    (f'SUPERSEDE {H1} REASON "x"', "E019", ["SET"]),
    ('SUPERSEDE facts WHERE subject = "a" REASON "x"', "E019", ["SET"]),
    (f'SUPERSEDE {H1}', "E019", ["SET"]),
    ('ADD fact SET subject = "a" SET relation = "b" REASON "x"', "E050", ["object"]),
    ('ADD fact SET object = "a" REASON "x"', "E050", ["subject", "relation"]),
    ('ADD skill SET name = "a" REASON "x"', "E050", ["description"]),
    ('ADD goal REASON "x"', "E050", ["at least one SET"]),
    ('ADD recommendation SET object = "x" REASON "x"', "E051", ["recommendation", "query-only"]),
    ('ADD event SET object = "x" REASON "x"', "E051", ["event"]),
    ('ADD facts SET object = "x" REASON "x"', "E051", ["facts"]),
    (f'SUPERSEDE {H1} SET subject = "x" REASON "x"', "E017", ["subject"]),
    ('SUPERSEDE facts WHERE subject = "a" SET relation = "b" REASON "x"', "E017", ["relation"]),
    ('SUPERSEDE recommendations WHERE target_ref = "a" SET object = "b" REASON "x"', "E042",
     ["recommendations"]),
    ('SUPERSEDE fact WHERE subject = "a" SET object = "b" REASON "x"', "E042", ["'facts'"]),
    ('REVERT sha256:abc REASON "x"', "E015", ["8-64", "3"]),
    ('REVERT sha256:' + "a" * 65 + ' REASON "x"', "E015", ["65"]),
    ('REVERT sha256:ABCDEF12 REASON "x"', "E015", ["uppercase"]),
    ('REVERT SHA256:abcdef12 REASON "x"', "E015", ["lowercase"]),
    ('REVERT sha256:abcdefgz REASON "x"', "E015", ["not hex"]),
    ('REVERT "sha256:abcdef12" REASON "x"', "E015", ["unquoted"]),
    ('REVERT abcdef12 REASON "x"', "E015", ["sha256:"]),
    ('SUPERSEDE 42 SET object = "b" REASON "x"', "E015", ["sha256:"]),
    (f'REVERT {H2} REASON "' + "x" * 501 + '"', "E016", ["501", "500"]),
    ('ADD fact ' + " ".join(f'SET {f} = "v"' for f in
                            ["subject", "relation", "object", "goal_state", "assigned_agent",
                             "observer_id", "observer_type"]) + ' REASON "x"',
     "too_many_sets", ["6"]),
    (f'SUPERSEDE {H1} SET object = "a" SET confidence = 0.1 SET importance = 0.2 SET tags = [] '
     'SET object = "b" REASON "x"', "too_many_sets", ["4"]),
    ('ADD fact SET subject = "a" SET subject = "b" REASON "x"', "duplicate_field", ["subject"]),
    ('SUPERSEDE facts WHERE a = "1" AND a = "2" SET object = "b" REASON "x"',
     "duplicate_field", ["'a'"]),
    ('ADD fact SET colour = "a" REASON "x"', "unknown_field", ["colour"]),
    ('ADD fact SET name = "a" REASON "x"', "unknown_field", ["name"]),
    (f'SUPERSEDE {H1} SET confidence = 1.5 REASON "x"', "bad_value", ["confidence"]),
    (f'SUPERSEDE {H1} SET confidence = "high" REASON "x"', "bad_value", ["confidence"]),
    (f'SUPERSEDE {H1} SET tags = "a" REASON "x"', "bad_value", ["tags"]),
    (f'SUPERSEDE {H1} SET tags = [1] REASON "x"', "bad_value", ["tags"]),
    (f'SUPERSEDE {H1} SET object = 1e999 REASON "x"', "bad_value", ["finite"]),
    (f'SUPERSEDE {H1} SET object = 99999999999999999999 REASON "x"', "bad_value", ["int64"]),
    ('SUPERSEDE facts WHERE namespace = 3 SET object = "b" REASON "x"', "bad_value",
     ["namespace"]),
    ("", "empty", ["no statement"]),
    (" ;\n ; ", "empty", ["no statement"]),
    (f'SUPERSEDE {H1} SET object = morning REASON "x"', "syntax", ["double-quoted"]),
    (f'SUPERSEDE {H1} SET object "x" REASON "x"', "syntax", ["'='"]),
    (f'SUPERSEDE {H1} SET object = "x" REASON x', "syntax", ["double-quoted"]),
    (f'SUPERSEDE {H1} SET object = "x\\q" REASON "x"', "syntax", ["escape"]),
    (f'SUPERSEDE {H1} SET object = "x REASON "x"', "syntax", ["unterminated"]),
    (f'SUPERSEDE {H1} SET object = "x\x01" REASON "x"', "syntax", ["control"]),
    (f'REVERT {H2} REASON "x', "syntax", ["unterminated"]),
    (f'REVERT {H2} SET object = "x" REASON "x"', "syntax", ["REASON"]),
    ('ADD fact SET subject = $who REASON "x"', "syntax", ["parameters"]),
    ('ADD workflow a -> b REASON "x"', "syntax", ["->"]),
    ('SUPERSEDE facts WHERE subject != "a" SET object = "b" REASON "x"', "syntax", ["'!'"]),
    ('SUPERSEDE facts WHERE subject = "a" OR x = "b" SET object = "b" REASON "x"', "syntax",
     ["AND or SET"]),
    (f'REVERT {H2} REASON "x" trailing', "syntax", ["';' or a newline"]),
    (f'SUPERSEDE {H1} SET object = 01 REASON "x"', "syntax", ["number"]),
])
def test_refusals(text, code, words):
    refused(text, code, *words)


def test_invalid_utf8_and_surrogates():
    err = refused(b'ADD fact SET subject = "\xff" REASON "x"', "E070", "UTF-8")
    assert err.position == 24
    refused('ADD fact SET subject = "\ud800" REASON "x"', "E070", "surrogate")
    refused(r'ADD fact SET subject = "\ud800" REASON "x"', "E070", "surrogate")
    # valid UTF-8 bytes are accepted
    assert cal.parse(FACT.encode()) == cal.parse(FACT)


@pytest.mark.parametrize("ch", ["\u202e", "\u202a", "\u2066", "\u2069", "\u200f"])
def test_bidi_controls_refused(ch):
    refused(f'ADD fact SET subject = "a{ch}b" SET relation = "r" SET object = "o" REASON "x"',
            "E071", f"U+{ord(ch):04X}")
    refused(f'ADD fact SET subject = "a\\u{ord(ch):04x}b" SET relation = "r" SET object = "o" '
            'REASON "x"', "E071")
    refused(f'{ch}REVERT {H2} REASON "x"', "E071")


def test_error_carries_code_message_position():
    err = refused('ADD fact SET subject = "a" SET verification_status = "verified" REASON "x"',
                  "status_forbidden")
    assert err.position == 31
    assert str(err).startswith("status_forbidden at 31: SET verification_status is refused")
    assert isinstance(err, ValueError)


# ------------------------------------------------------------------- inverse and scoping

def test_inverse_add():
    batch = cal.parse(FACT)
    assert cal.inverse(batch) == [{"op": "retract", "statement": 0, "added": 0, "target": None,
                                   "invalidation_type": "retraction"}]
    assert cal.inverse(batch, {"0": H1})[0]["target"] == H1


def test_inverse_supersede_by_hash():
    batch = cal.parse(f'SUPERSEDE {H1} SET object = "coffee" REASON "fix"')
    assert cal.inverse(batch) == [{"op": "supersede", "statement": 0, "target": None,
                                   "restore_from": H1}]
    assert cal.inverse(batch, {"0": {"new": H2}}) == [
        {"op": "supersede", "statement": 0, "target": H2, "restore_from": H1}]


def test_inverse_supersede_by_selector():
    batch = cal.parse(OMS_EXAMPLE)
    assert cal.inverse(batch) == [{
        "op": "supersede", "statement": 0, "target": None,
        "restore_from": {"grain_type": "facts",
                         "where": {"subject": "user:john-smith",
                                   "relation": "preferred_activity"}}}]
    # the applier records what the selector actually matched
    olds = [H1, H2]
    (op,) = cal.inverse(batch, {"0": {"new": "sha256:" + "c" * 64, "old": olds}})
    assert op["restore_from"] == olds and op["target"] == "sha256:" + "c" * 64


def test_inverse_revert():
    batch = cal.parse(f'REVERT {H2} REASON "regressed"')
    assert cal.inverse(batch, {"0": H1}) == [
        {"op": "supersede", "statement": 0, "target": H1, "restore_from": H2}]


def test_inverse_is_reverse_order_and_json():
    batch = cal.parse(f'{FACT}\n{OMS_EXAMPLE}\nREVERT {H2} REASON "r"\n'
                      f'SUPERSEDE {H1} SET tags = ["x"] REASON "t"')
    plan = cal.inverse(batch)
    assert [p["statement"] for p in plan] == [3, 2, 1, 0]
    assert [p["op"] for p in plan] == ["supersede", "supersede", "supersede", "retract"]
    assert json.loads(json.dumps(plan)) == plan
    assert cal.rollbackable(batch) is True
    with pytest.raises(ValueError):
        cal.inverse(batch, {"0": 5})


def test_inverse_where_values_are_json():
    batch = cal.parse(f'SUPERSEDE facts WHERE subject = {H2} AND tags = ["a"] '
                      'SET object = 1 REASON "x"')
    (op,) = cal.inverse(batch)
    assert op["restore_from"]["where"] == {"subject": H2, "tags": ["a"]}


def test_touches_namespace():
    batch = cal.parse('SUPERSEDE facts WHERE namespace = "fitness:preferences" AND subject = "a" '
                      'SET object = "b" REASON "x"\n'
                      'SUPERSEDE goals WHERE namespace = "other" SET object = "b" REASON "x"\n'
                      + FACT)
    assert cal.touches_namespace(batch) == {"fitness:preferences", "other"}
    assert cal.touches_namespace(cal.parse(OMS_EXAMPLE)) == set()


# ------------------------------------------------------------------------------ properties

@settings(max_examples=300)
@given(st.text())
def test_arbitrary_text_raises_only_calerror(text):
    try:
        cal.parse(text)
    except CalError:
        pass


@settings(max_examples=200)
@given(st.binary())
def test_arbitrary_bytes_raise_only_calerror(data):
    try:
        cal.parse(data)
    except CalError:
        pass


_PIECES = ["ADD", "SUPERSEDE", "REVERT", "SET", "WHERE", "AND", "REASON", "BECAUSE", "fact",
           "facts", "skill", "object", "subject", "relation", "confidence", "tags", "rec_status",
           "namespace", "=", ";", "\n", "[", "]", ",", '"x"', '"\\"', '"', "0.5", "-1", "1e999",
           H1, "sha256:", "sha256:ABCDEF12", "DELETE", "->", "$p", "\\u202e", '"\\u0000"']


@settings(max_examples=500)
@given(st.lists(st.sampled_from(_PIECES), max_size=30), st.sampled_from([" ", "", "\n"]))
def test_token_soup_raises_only_calerror(pieces, sep):
    try:
        batch = cal.parse(sep.join(pieces))
    except CalError:
        return
    assert cal.parse(cal.render(batch)) == batch


# strategies for valid statements
_text = st.text(
    st.characters(exclude_categories=("Cs",),
                  exclude_characters="\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
                                     "\u2066\u2067\u2068\u2069"),
    max_size=20,
).map(lambda s: unicodedata.normalize("NFC", s))
_reason = _text.filter(lambda s: s.strip() and len(s) <= cal.MAX_REASON)
_hash = st.text("0123456789abcdef", min_size=8, max_size=64).map(Hash)
_number = st.one_of(st.integers(-(2**63), 2**63 - 1),
                    st.floats(allow_nan=False, allow_infinity=False))
_unit = st.one_of(st.integers(0, 1), st.floats(0, 1))
_scalar = st.one_of(_text, _number, _hash)
_value = st.one_of(_scalar, st.lists(_scalar, max_size=3).map(tuple))


def _value_for(field: str):
    if field in ("confidence", "importance"):
        return _unit
    if field == "tags":
        return st.lists(_text, max_size=3).map(tuple)
    return _value


def _sets(fields, required, max_size):
    @st.composite
    def build(draw):
        optional = sorted(set(fields) - set(required))
        extra = draw(st.lists(st.sampled_from(optional), unique=True,
                              min_size=0 if required else 1,
                              max_size=max_size - len(required)))
        names = draw(st.permutations(list(required) + extra))
        return tuple((f, draw(_value_for(f))) for f in names)
    return build()


@st.composite
def _add(draw):
    gtype = draw(st.sampled_from(cal.ADDABLE))
    sets = draw(_sets(cal.ADD_FIELDS[gtype], cal.REQUIRED.get(gtype, ()), cal.MAX_ADD_SETS))
    return Add(gtype, sets, draw(_reason))


_field = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True).filter(
    lambda f: f.upper() not in cal.FORBIDDEN and f not in ("namespace", "ns"))
_selector = st.builds(
    Selector,
    st.sampled_from([t + "s" for t in cal.ADDABLE]),
    st.dictionaries(_field, _value, min_size=1, max_size=3).map(lambda d: tuple(d.items())),
)
_supersede = st.builds(Supersede, st.one_of(_hash, _selector),
                       _sets(cal.EVOLVE_FIELDS, (), cal.MAX_SUPERSEDE_SETS), _reason)
_revert = st.builds(Revert, _hash, _reason)
_batch = st.lists(st.one_of(_add(), _supersede, _revert), min_size=1, max_size=4).map(tuple)


@settings(max_examples=300)
@given(_batch)
def test_parse_render_roundtrip(batch):
    text = cal.render(batch)
    assert cal.parse(text) == batch
    assert cal.rollbackable(batch)
    plan = cal.inverse(batch)
    assert len(plan) == len(batch)
    assert json.loads(json.dumps(plan)) == plan


@settings(max_examples=100)
@given(_batch, st.sampled_from([";", "; ", ";\n", "\n\n", "\n;\n"]))
def test_roundtrip_with_other_separators(batch, sep):
    lines = cal.render(batch).split("\n")
    assert cal.parse(sep.join(lines)) == batch
