"""The README says what the code does: every flag of every command is in the command table
(or among the shared flags), every configuration key is in the sample under its own table,
and the exit codes it documents are the ones a usage error and a Failure give. Each test
fails naming what is missing or misplaced."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import msgspec
import pytest

from improved.cli import errors, parser
from improved.client.config import Config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def commands(p: argparse.ArgumentParser, path: tuple[str, ...] = ()
             ) -> dict[tuple[str, ...], list[str]]:
    """Each runnable command's words and its flags (the long spelling when there is one)."""
    found: dict[tuple[str, ...], list[str]] = {}
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(commands(sub, (*path, name)))
    if p.get_default("func") is not None:
        found[path] = [max(a.option_strings, key=len) for a in p._actions
                       if a.option_strings and not isinstance(a, argparse._HelpAction)]
    return found


def rows() -> list[tuple[list[list[str]], str]]:
    """The command table's rows: the alternatives of each command word, and the row's text."""
    table = []
    for line in section("Command line").splitlines():
        m = re.match(r"\| `improved ([^`]*)`", line)
        if m:
            words = [w.replace("\\|", "|").split("|") for w in m.group(1).split()[:2]]
            table.append((words, line))
    return table


def mentions(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_every_flag_of_every_command_is_in_the_readme():
    table = rows()
    shared = section("Command line").split("Shared flags.", 1)[1].split("\n\n", 1)[0]
    missing = []
    for path, flags in sorted(commands(parser()).items()):
        if not path:
            continue
        name = "improved " + " ".join(path)
        text = " ".join(line for words, line in table
                        if all(i < len(words) and w in words[i] for i, w in enumerate(path)))
        if not text:
            missing.append(f"{name}: no row in the README's command table")
            continue
        missing += [f"{name} {flag}: not in its row nor among the shared flags"
                    for flag in flags if not mentions(text, flag) and not mentions(shared, flag)]
    top = [a for a in parser()._actions if "--log-level" in a.option_strings]
    assert top and mentions(section("Command line"), "--log-level")
    assert not missing, "undocumented:\n" + "\n".join(missing)


def schema(struct: type, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for f in msgspec.structs.fields(struct):
        if isinstance(f.type, type) and issubclass(f.type, msgspec.Struct):
            keys |= schema(f.type, f"{prefix}{f.encode_name}.")
        else:
            keys.add(prefix + f.encode_name)
    return keys


def sample() -> set[str]:
    """Every key the README's configuration sample sets or shows commented out, dotted with
    the table it sits under; a table such as [trust.operators] documents that key itself."""
    block = section("Configuration").split("```toml\n", 1)[1].split("```", 1)[0]
    keys, table = set(), ""
    for line in block.splitlines():
        header = re.match(r"\[([\w.]+)\]", line)
        if header:
            table = header.group(1)
            keys.add(table)
            continue
        key = re.match(r"#?\s*([a-z_][a-z0-9_]*)\s*=", line)
        if key:
            keys.add(f"{table}.{key.group(1)}" if table else key.group(1))
    return keys


def test_every_config_key_is_in_the_readme_sample_under_its_table():
    tables = {"nats", "policy", "trust", "apply", "audit", "telemetry"}  # Structs: their keys are listed
    known, shown = schema(Config), sample() - tables
    assert not known - shown, f"not in the README's sample: {sorted(known - shown)}"
    assert not shown - known, (f"in the README's sample under a table the configuration does "
                               f"not have them in: {sorted(shown - known)}")


@pytest.mark.parametrize("argv", [["show"], ["no-such-command"], ["show", "zz"],
                                  ["audit", "verify", "--since", "--nope"]])
def test_a_usage_error_exits_2_as_documented(argv):
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(argv)
    assert exited.value.code == 2 == errors.USAGE
    codes = section("Command line").split("**Exit codes**", 1)[1].split("\n\n", 1)[0]
    assert all(f"`{code}`" in codes for code in (0, errors.REFUSED, errors.USAGE))
