"""The doc store's diffs, pure: a diff made from one text to another applies to exactly that
text and gives the other; its reverse undoes it; malformed or misplaced hunks are refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from improved_reference import diffs

# Few distinct lines, so texts share lines and diffs have context, moves and repeats; some
# lines carry a carriage return or a Unicode line separator, which are not line ends here.
LINE = st.sampled_from(["a", "b", "c", "", " indented", "x\r", "tab\tbed", "sep\u2028here", "é"])
TEXT = st.builds(lambda ls, end: "\n".join(ls) + ("\n" if ls and end else ""),
                 st.lists(LINE, max_size=12), st.booleans())


@settings(max_examples=300, deadline=None)
@given(TEXT, TEXT, st.integers(0, 3))
def test_a_diff_applies_to_its_base_and_its_reverse_undoes_it(old, new, context):
    text = diffs.make(old, new, "docs/a.md", context)
    if old == new:
        assert text == ""
        return
    [patch] = diffs.parse(text)
    assert diffs.apply(old, patch) == new
    back = diffs.reverse(patch)
    assert diffs.apply(new, back) == old
    assert diffs.parse(diffs.render(back)) == [back]
    assert diffs.reverse(back) == patch or diffs.apply(old, diffs.reverse(back)) == new


@settings(max_examples=200, deadline=None)
@given(TEXT, TEXT, TEXT)
def test_a_diff_never_applies_silently_to_another_text(old, new, other):
    text = diffs.make(old, new, "docs/a.md")
    if not text:
        return
    [patch] = diffs.parse(text)
    try:
        result = diffs.apply(other, patch)
    except diffs.DiffError:
        return
    # it applied: then every line it removed or kept was where it said, in `other` too
    assert diffs.apply(result, diffs.reverse(patch)) == other


@pytest.mark.parametrize(("text", "why"), [
    ("", "holds no patch"),
    ("hello\n", "expected a '--- old'"),
    ("--- a/x\n+++ b/x\n", "has no hunk"),
    ("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n", "ends early"),
    ("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n+c\n", "expected a '--- old'"),
    ("--- a/x\n+++ b/x\n@@ one @@\n", "malformed hunk header"),
    ("--- a/x\n+++ b/x\n@@ -1 +1 @@\n*a\n+b\n", "starts with ' ', '-' or '+'"),
])
def test_malformed_diffs_are_refused_naming_the_line(text, why):
    with pytest.raises(diffs.DiffError, match=why.replace("(", r"\(").replace("+", r"\+")):
        diffs.parse(text)


def test_a_hunk_that_does_not_match_is_refused():
    [patch] = diffs.parse("--- a/x\n+++ b/x\n@@ -2 +2 @@\n-b\n+B\n")
    assert diffs.apply("a\nb\n", patch) == "a\nB\n"
    with pytest.raises(diffs.DiffError, match="hunk 1"):
        diffs.apply("a\nc\n", patch)


def test_git_headers_and_two_files_parse_as_two_patches():
    text = ("diff --git a/x b/x\nindex 1..2 100644\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n"
            "diff --git a/y b/y\n--- a/y\n+++ b/y\n@@ -0,0 +1 @@\n+new\n")
    x, y = diffs.parse(text)
    assert (x.new_path, y.new_path) == ("b/x", "b/y")
    assert diffs.apply("", y) == "new\n"
