"""The evidence boundary, enforced from the source (DESIGN §9, "Evidence, not answers"): an
answer to one of the daemon's requests, a retained record or index entry, a report anyone may
publish reaches a decision only as evidence `improved.core.boundary` made of it. Two rules:

- only the boundary makes `Attested` (and `Conflict`) values: nothing else can declare an
  answer the service's own;
- no core function or class the shell (runtime, cli, client) calls takes one of those raw
  types in a parameter, unless wrapped as evidence — so a new decision input that skipped the
  boundary fails here, and the type checker keeps the shell's calls to these signatures.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "improved"
BOUNDARY = PACKAGE / "core" / "boundary.py"
ATTESTING = frozenset({"Attested", "Conflict"})
SHELL = ("runtime", "cli", "client")

# What arrives from outside the chain and the signed acts: replies to the daemon's requests,
# reports anyone may publish, retained records and index entries, bucket values.
UNVERIFIED = frozenset({"MeasureReply", "ClassifyReply", "LkgReport", "ApplyResult",
                        "ApplyReport", "ReviewEntry", "MeasureDue", "IndexMarker", "DedupHead",
                        "ProposalState", "Reading"})
WRAPPERS = ("Evidence[", "Attested[", "Unattested[", "Answer[", "Conflict[")
# Core functions that take such a value and decide nothing with it, each with the reason.
HINTS = {
    ("queue", "due"): "an index entry only says which chain to carry on: the pass it wakes "
                      "decides from that chain",
    ("apply", "recordable"): "turns a result the loop cannot encode into a failed one, before "
                             "the boundary: it moves nothing",
    ("propose", "head_may_expire"): "whether the dedup head being rewritten (compare-and-set) "
                                    "may carry a TTL: it decides only that write; supersession "
                                    "is decided from the chains",
}


def core_definitions() -> dict[tuple[str, str], ast.FunctionDef | ast.ClassDef]:
    """(module, name) → the top-level function or class of every improved.core module."""
    out: dict[tuple[str, str], ast.FunctionDef | ast.ClassDef] = {}
    for path in sorted((PACKAGE / "core").glob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                out[(path.stem, node.name)] = node
    return out


def core_calls(path: Path) -> list[tuple[int, str, str]]:
    """(line, core module, name) of every call the file makes into improved.core, by module
    alias (`from improved.core import apply as apply_stage; apply_stage.transition(...)`) or
    by an imported name (`from improved.core.triage import decide; decide(...)`)."""
    tree = ast.parse(path.read_text(), str(path))
    modules: dict[str, str] = {}
    names: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "improved.core":
            for a in node.names:
                modules[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("improved.core."):
            for a in node.names:
                names[a.asname or a.name] = (node.module.split(".")[2], a.name)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                and f.value.id in modules:
            out.append((node.lineno, modules[f.value.id], f.attr))
        elif isinstance(f, ast.Name) and f.id in names:
            out.append((node.lineno, *names[f.id]))
    return out


def raw_inputs(node: ast.FunctionDef | ast.ClassDef) -> list[str]:
    """The parameters (or, for a class, the fields) annotated with an unverified type that is
    not wrapped as evidence."""
    if isinstance(node, ast.FunctionDef):
        params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        annotated = [(a.arg, a.annotation) for a in params if a.annotation is not None]
    else:
        annotated = [(s.target.id, s.annotation) for s in node.body
                     if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    found = []
    for name, annotation in annotated:
        text = ast.unparse(annotation)
        words = {w.strip("[],|. ") for w in text.replace("[", " [ ").split()}
        if words & UNVERIFIED and not any(w in text for w in WRAPPERS):
            found.append(f"{name}: {text}")
    return found


def shell_files() -> list[Path]:
    return sorted(p for layer in SHELL for p in (PACKAGE / layer).rglob("*.py"))


def violations(files: list[Path], defs) -> list[str]:
    found = []
    for path in files:
        for line, module, name in core_calls(path):
            node = defs.get((module, name))
            if node is None or (module, name) in HINTS:
                continue
            for raw in raw_inputs(node):
                found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
                             f":{line} hands core.{module}.{name} a raw {raw}")
    return found


def test_only_the_boundary_makes_attested_evidence():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == BOUNDARY:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if called in ATTESTING:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} makes {called}")
    assert not found, "\n".join(found)


def test_no_core_function_the_shell_calls_takes_an_unverified_value_raw():
    assert not (found := violations(shell_files(), core_definitions())), "\n".join(found)


def test_every_exemption_names_a_core_function_that_exists():
    defs = core_definitions()
    assert all(key in defs for key in HINTS), [k for k in HINTS if k not in defs]


def test_the_checker_sees_a_new_decision_input_that_skipped_the_boundary(tmp_path):
    """What the rule is for: a core function taking a retained index entry as it came, and a
    shell module handing it one, fail the test; wrapped as evidence, they pass."""
    core = ast.parse("def decide(record, entry: ReviewEntry | None) -> bool: ...\n"
                     "def judged(record, said: Evidence[MeasureReply]) -> bool: ...\n"
                     "class View:\n    marker: IndexMarker\n    now: int\n")
    defs = {("planner", n.name): n for n in core.body}
    shell = tmp_path / "shell.py"
    shell.write_text("from improved.core import planner\n"
                     "planner.decide(r, entry)\nplanner.judged(r, said)\n"
                     "planner.View(marker=m, now=1)\n")
    assert [v.split(" hands ")[1] for v in violations([shell], defs)] == [
        "core.planner.decide a raw entry: ReviewEntry | None",
        "core.planner.View a raw marker: IndexMarker"]
