"""The documentation stands on its own: README.md and docs/ name no document the repository
does not hold. A `*.md` file they mention exists here; an outside specification is cited only
as a link to its public address (`[SPEC 09][spec09]` with `[spec09]: https://...`, or an
inline `[text](https://...)`); a design document kept elsewhere, or notes beside the checkout,
are never pointed at. Each failure names the file, the line and the reference."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Paths in the mesh a proposal may touch, written as examples of targets: files of the
# services' world, not documents to read (the constitution's own path is forbidden, a charter
# edit adds to a CHANGELOG.md, the doc store edits docs/guide.md).
MESH_PATHS = {"a/../constitution.md", "CHANGELOG.md", "_spec/CHANGELOG.md", "docs/guide.md"}

LINK_DEF = re.compile(r"^\s*\[([^\]]+)\]:\s*(\S+)", re.M)
MD_NAME = re.compile(r"(?<![\w/.-])([\w.*/-]*[\w*]\.md)\b")
OUTSIDE = [
    (re.compile(r"\bDESIGN\b"), "the design document kept outside the repository"),
    (re.compile(r"\bSPEC\s*\d+"), "an outside specification not cited by its public link"),
    (re.compile(r"\bseeds/|\.\./shared\b|\breference/(anchors|cosmix|oms)\.md"),
     "notes kept beside the checkout"),
]


def public_citations_removed(text: str) -> str:
    """The text without what cites a public address: links whose target is an https URL
    (inline, or by a reference defined with one) and bare URLs. Lines are kept."""
    public = {label.lower() for label, url in LINK_DEF.findall(text)
              if url.startswith("https://")}

    def blank(m: re.Match[str]) -> str:
        return "\n" * m.group(0).count("\n")

    text = LINK_DEF.sub(lambda m: "" if m.group(2).startswith("https://") else m.group(0), text)
    text = re.sub(r"\[[^\]]*\]\(https://[^)\s]+\)", blank, text)
    text = re.sub(r"\[[^\]]*\]\[([^\]\n]+)\]",
                  lambda m: blank(m) if m.group(1).lower() in public else m.group(0), text)
    return re.sub(r"https://\S+", "", text)


def held(name: str, doc: Path) -> bool:
    """Whether the repository holds the file `name` (relative to the document or the root),
    or `name` is a glob or a path of the mesh rather than a document."""
    if "*" in name or name in MESH_PATHS:
        return True
    return (doc.parent / name).is_file() or (ROOT / name).is_file()


def problems(doc: Path, text: str) -> list[str]:
    found = []
    bare = public_citations_removed(text)
    # a name broken over two lines is still a name
    found += [f"{doc.name}: {m.group(0)!r}: an outside specification not cited by its public "
              "link" for m in re.finditer(r"\bSPEC[ \t]*\n\s*\d+", bare)]
    for number, line in enumerate(bare.splitlines(), 1):
        where = f"{doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc.name}:{number}"
        for pattern, what in OUTSIDE:
            for m in pattern.finditer(line):
                found.append(f"{where}: {m.group(0)!r}: {what}")
        for m in MD_NAME.finditer(line):
            if not held(m.group(1), doc):
                found.append(f"{where}: {m.group(1)!r}: not a file of this repository")
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_name_no_document_the_repository_does_not_hold(doc):
    found = problems(doc, doc.read_text())
    assert not found, "\n".join(found)


def test_the_check_sees_what_it_must_and_lets_public_citations_be(tmp_path):
    doc = tmp_path / "x.md"
    text = ("The contract is DESIGN §3; see SPEC 09 §5 and notes.md.\nSPEC\n 08 too.\n"
            "Cited: [SPEC 09 §5][spec09], [OMS](https://github.com/openmemoryspec/oms), "
            "and README.md.\n\n[spec09]: https://github.com/markc/cosmix\n")
    (tmp_path / "README.md").write_text("")
    found = problems(doc, text)
    assert [f.split(": ")[1] for f in found] == ["'SPEC\\n 08'", "'DESIGN'", "'SPEC 09'",
                                                 "'notes.md'"], found
