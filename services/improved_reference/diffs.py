"""Unified diffs, pure: parse one, apply it to exactly the text it was made against, reverse it,
and make one. The doc store's functional core (a `proposal_edit` and its inverse).

Applying is exact, with no fuzz and no offset search: the store has checked `base_digest`
first, so a hunk whose lines are not where it says is a malformed diff, never "close enough".
Lines keep their ends; a side's last line without a newline is followed by the
`\\ No newline at end of file` marker, as diff(1) and git write it. Texts are split on "\\n"
only, so a carriage return or a Unicode line separator is an ordinary character.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

NO_NEWLINE = "\\ No newline at end of file"
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_HEADER = ("diff ", "index ", "new file mode", "deleted file mode", "old mode", "new mode",
           "similarity index", "dissimilarity index", "rename from", "rename to",
           "copy from", "copy to")


class DiffError(ValueError):
    """A diff that does not parse, or does not apply to the text; the text says where."""


@dataclass(frozen=True)
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: tuple[tuple[str, str], ...]  # (" " | "-" | "+", the line with its end, if any)


@dataclass(frozen=True)
class Patch:
    old_path: str  # as written after `--- ` (`/dev/null` for a new file)
    new_path: str
    hunks: tuple[Hunk, ...]


def lines_of(text: str) -> list[str]:
    """`text` as lines that keep their "\\n"; the last has none when the text does not end
    with one."""
    pieces = text.split("\n")
    return [p + "\n" for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])


def parse(diff: str) -> list[Patch]:
    """Every file's patch in `diff`, or DiffError naming the first line that is wrong."""
    rows = diff.split("\n")
    if rows and rows[-1] == "":
        rows.pop()
    patches: list[Patch] = []
    i = 0
    while i < len(rows):
        row = rows[i]
        if row.startswith(_HEADER) or not row.strip():
            i += 1
            continue
        if not row.startswith("--- ") or i + 1 >= len(rows) or \
                not rows[i + 1].startswith("+++ "):
            raise DiffError(f"line {i + 1}: expected a '--- old' / '+++ new' file header, "
                            f"got {row[:80]!r}")
        old, new = _path(row[4:]), _path(rows[i + 1][4:])
        i += 2
        hunks: list[Hunk] = []
        while i < len(rows) and rows[i].startswith("@@"):
            hunk, i = _hunk(rows, i)
            hunks.append(hunk)
        if not hunks:
            raise DiffError(f"line {i + 1}: the patch of {new} has no hunk")
        patches.append(Patch(old, new, tuple(hunks)))
    if not patches:
        raise DiffError("the diff holds no patch")
    return patches


def _path(field: str) -> str:
    return field.split("\t", 1)[0]


def _hunk(rows: list[str], i: int) -> tuple[Hunk, int]:
    m = _HUNK.match(rows[i])
    if m is None:
        raise DiffError(f"line {i + 1}: malformed hunk header {rows[i][:80]!r}")
    old_start, new_start = int(m.group(1)), int(m.group(3))
    old_len = 1 if m.group(2) is None else int(m.group(2))
    new_len = 1 if m.group(4) is None else int(m.group(4))
    at = i + 1
    i += 1
    out: list[tuple[str, str]] = []
    olds = news = 0
    while olds < old_len or news < new_len:
        if i >= len(rows):
            raise DiffError(f"line {at}: the hunk ends early (expected {old_len} old and "
                            f"{new_len} new lines)")
        row = rows[i]
        tag, body = (row[:1], row[1:]) if row else (" ", "")  # a context line lost its space
        if tag not in " -+":
            raise DiffError(f"line {i + 1}: a hunk line starts with ' ', '-' or '+', got "
                            f"{row[:80]!r}")
        olds += tag in " -"
        news += tag in " +"
        if olds > old_len or news > new_len:
            raise DiffError(f"line {i + 1}: more lines than the hunk header at line {at} says")
        i += 1
        end = "\n"
        if i < len(rows) and rows[i].startswith("\\"):
            end = ""
            i += 1
        out.append((tag, body + end))
    if i < len(rows) and rows[i].startswith("\\"):
        i += 1
    return Hunk(old_start, old_len, new_start, new_len, tuple(out)), i


def apply(text: str, patch: Patch) -> str:
    """`text` with `patch` applied, or DiffError naming the hunk that does not fit."""
    old = lines_of(text)
    out: list[str] = []
    pos = 0
    for n, h in enumerate(patch.hunks, 1):
        start = h.old_start if h.old_len == 0 else h.old_start - 1
        expected = [line for tag, line in h.lines if tag in " -"]
        if start < pos or old[start:start + h.old_len] != expected:
            raise DiffError(f"hunk {n} (@@ -{h.old_start},{h.old_len}) does not match the "
                            "document at that line")
        out += old[pos:start]
        out += [line for tag, line in h.lines if tag in " +"]
        pos = start + h.old_len
    out += old[pos:]
    result = "".join(out)
    if any(not line.endswith("\n") for line in out[:-1]):
        raise DiffError("the diff leaves a line without its newline inside the document")
    return result


def render(patch: Patch) -> str:
    rows = [f"--- {patch.old_path}", f"+++ {patch.new_path}"]
    for h in patch.hunks:
        rows.append(f"@@ -{h.old_start},{h.old_len} +{h.new_start},{h.new_len} @@")
        for tag, line in h.lines:
            rows.append(tag + line.removesuffix("\n"))
            if not line.endswith("\n"):
                rows.append(NO_NEWLINE)
    return "\n".join(rows) + "\n"


def reverse(patch: Patch) -> Patch:
    """The patch that undoes `patch`: old and new swapped, deletions before additions."""
    hunks = []
    for h in patch.hunks:
        flipped: list[tuple[str, str]] = []
        run: list[tuple[str, str]] = []
        for tag, line in h.lines + ((" ", ""),):
            if tag == " ":
                flipped += [("-", ln) for t, ln in run if t == "+"]
                flipped += [("+", ln) for t, ln in run if t == "-"]
                run = []
                flipped.append((tag, line))
            else:
                run.append((tag, line))
        hunks.append(Hunk(h.new_start, h.new_len, h.old_start, h.old_len, tuple(flipped[:-1])))
    return Patch(patch.new_path, patch.old_path, tuple(hunks))


def make(old: str, new: str, path: str, context: int = 3) -> str:
    """The unified diff from `old` to `new` of the document `path` ("" when they are equal)."""
    a, b = lines_of(old), lines_of(new)
    hunks = []
    for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        body: list[tuple[str, str]] = []
        for tag, x1, x2, y1, y2 in group:
            if tag == "equal":
                body += [(" ", ln) for ln in a[x1:x2]]
                continue
            body += [("-", ln) for ln in a[x1:x2]]
            body += [("+", ln) for ln in b[y1:y2]]
        hunks.append(Hunk(i1 + 1 if i2 > i1 else i1, i2 - i1, j1 + 1 if j2 > j1 else j1,
                          j2 - j1, tuple(body)))
    if not hunks:
        return ""
    return render(Patch(f"a/{path}" if a else "/dev/null", f"b/{path}" if b else "/dev/null",
                        tuple(hunks)))
