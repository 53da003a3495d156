"""docs/architecture.md's rule map ("Where each rule lives") names code and tests a reader
will look for: every `core.…`/`runtime.…`/`client.…`/`cli.…`/`protocol.…` it names must
import, and every `test_file.py::test_name` must be a test of that name in that file, so the
map cannot silently point at code or tests that were renamed or never existed."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("core.", "runtime.", "client.", "cli.", "protocol.")


def rows(text: str) -> list[list[str]]:
    """The table rows under "## Where each rule lives", as cells (header and rule left out)."""
    section = text[text.index("## Where each rule lives"):]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [line.strip().strip("|").split("|") for line in lines[2:]]


def names_in(cell: str) -> list[str]:
    """The dotted names a "where it lives" cell gives in backticks (`core.x.f`, `core.x`); what
    follows one in parentheses is prose (fields, arguments, names of its), not checked."""
    return [name.rstrip(".") for name in
            re.findall(r"`((?:core|runtime|client|cli|protocol)\.[\w.]+)`", cell)]


def unresolved(name: str) -> bool:
    bits = name.split(".")
    for cut in range(len(bits), 0, -1):
        try:
            obj: object = importlib.import_module("improved." + ".".join(bits[:cut]))
        except ImportError:
            continue
        try:
            for attr in bits[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return True
        return False
    return True


def named_tests(cell: str) -> list[tuple[str, str | None]]:
    """(file, test or None) for each `file.py`, `file.py::name` and `::name` (of the file
    named last) in a tests cell."""
    out: list[tuple[str, str | None]] = []
    current = None
    for ref in re.findall(r"`([^`]+)`", cell):
        for file, name in re.findall(r"(?:tests/(?:unit|integration)/)?(test_\w+\.py)?(?:::(\w+))?",
                                     ref):
            current = file or current
            if current and (file or name):
                out.append((current, name or None))
    return out


def stale(text: str, files: dict[str, list[Path]]) -> list[str]:
    problems = []
    for cells in rows(text):
        if len(cells) < 3:
            continue
        problems += [f"no {name}" for name in names_in(cells[-2]) if unresolved(name)]
        for file, name in named_tests(cells[-1]):
            paths = files.get(file)
            if not paths:
                problems.append(f"no test file {file}")
            elif name and not any(re.search(rf"def {name}\b", p.read_text()) for p in paths):
                problems.append(f"no test {file}::{name}")
    return problems


def suite_files() -> dict[str, list[Path]]:
    files: dict[str, list[Path]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        files.setdefault(path.name, []).append(path)
    return files


def test_every_name_and_test_the_rule_map_gives_exists():
    assert stale((ROOT / "docs" / "architecture.md").read_text(), suite_files()) == []


def test_the_check_sees_a_renamed_function_and_a_missing_test():
    table = ("## Where each rule lives\n\n| rule | where | tests |\n|---|---|---|\n"
             "| x | `core.guards.touched_paths`, `core.guards.no_such` (`prose`) | "
             "`test_rule_map.py::test_every_name_and_test_the_rule_map_gives_exists`, "
             "`::test_gone`, `test_nowhere.py` |\n")
    assert stale(table, suite_files()) == ["no core.guards.no_such",
                                          "no test test_rule_map.py::test_gone",
                                          "no test file test_nowhere.py"]
