"""The command line on the base install (no daemon extra: no anyio, no prometheus_client), and
the pure pieces of its one-line errors: the port type, a JSON file's position, a grant's hash,
each hint once, and the exit codes documented where they are defined."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from improved.cli import errors, verdicts
from improved.cli.authority import skill_problem
from improved.cli.common import json_object, port_type
from improved.cli.errors import Failure
from tests.cli import ENV

ROOT = Path(__file__).resolve().parents[2]
EXTRA_LINE = "improved run needs the daemon extra: pip install 'improved[daemon]'"
# the base install as far as Python can tell: the daemon extra's modules cannot be imported
BASE = ("import sys\n"
        "sys.modules['anyio'] = None\n"
        "sys.modules['prometheus_client'] = None\n"
        "from improved.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n")


def base(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BASE, *args], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path,
                          env={**ENV, "IMPROVED_KEYS": str(tmp_path / "keys"),
                               "XDG_STATE_HOME": str(tmp_path / "state")})


def test_the_base_install_runs_what_a_mesh_service_needs(tmp_path):
    helped = base(tmp_path, "--help")
    assert helped.returncode == 0 and "usage: improved" in helped.stdout, helped.stderr
    hashed = base(tmp_path, "skill", "hash", str(ROOT / "examples" / "skill-l2.json"))
    assert hashed.returncode == 0, hashed.stderr
    assert re.fullmatch(r"[a-z][a-z0-9_-]*:[0-9a-f]{64}\n", hashed.stdout)
    made = base(tmp_path, "keys", "new", "--principal", "operator:alice")
    assert made.returncode == 0 and "[trust.operators]" in made.stdout, made.stderr
    for command in (["show", "--help"], ["propose", "--help"]):
        assert base(tmp_path, *command).returncode == 0


def test_the_base_install_names_the_daemon_extra_in_one_line(tmp_path):
    helped = base(tmp_path, "run", "--help")
    assert helped.returncode == 0 and EXTRA_LINE in helped.stdout, helped.stdout
    ran = base(tmp_path, "run", "--port", "0", "--data-dir", str(tmp_path / "data"))
    assert (ran.returncode, ran.stderr) == (errors.USAGE, EXTRA_LINE + "\n")
    assert not (tmp_path / "data").exists()  # nothing started, nothing made
    demo = base(tmp_path, "demo")
    assert (demo.returncode, demo.stderr) == (
        errors.USAGE, "improved demo needs the daemon extra: pip install 'improved[daemon]'\n")


def test_the_daemon_extra_is_only_named_when_it_is_missing():
    assert errors.daemon_extra_note("run") is None  # the test install has it


@pytest.mark.parametrize(("free", "text", "port"), [(False, "1", 1), (False, "65535", 65535),
                                                    (True, "0", 0), (True, "8765", 8765)])
def test_a_port_in_range_is_taken(free, text, port):
    assert port_type(free)(text) == port


@pytest.mark.parametrize(("free", "text"), [(False, "0"), (False, "65536"), (True, "99999"),
                                            (True, "-1"), (False, "http"), (True, "")])
def test_a_port_out_of_range_is_refused_naming_the_range(free, text):
    with pytest.raises(argparse.ArgumentTypeError, match=f"a port is {int(not free)} to 65535"):
        port_type(free)(text)


def test_bad_json_is_named_by_file_line_and_column():
    with pytest.raises(Failure) as bad:
        json_object(b'{\n "a": 1,\n "b"\n}', "p.json", "proposal")
    assert str(bad.value) == ("p.json, line 4, column 1: not JSON: Expecting ':' delimiter; a "
                              "proposal is a JSON object")
    assert bad.value.code == errors.USAGE
    with pytest.raises(Failure, match="^stdin holds a JSON string, not an object"):
        json_object(b'"x"', "-", "proposal")
    assert json_object(b'{"service": "demo"}', "p.json", "proposal") == {"service": "demo"}


@pytest.mark.parametrize(("skill", "said"), [
    ("summarize:" + "a" * 12, "gives 12 of the hash's 64 hex digits"),
    ("summarize", "is not NAME:SHA256"),
    ("Summarize:" + "a" * 64, "'Summarize' is not a skill name"),
    ("summarize:" + "g" * 64, "is not a SHA-256 in lowercase hex"),
    ("summarize:" + "a" * 65, "has 65 hex digits"),
])
def test_a_grant_names_what_is_wrong_with_its_hash_in_words(skill, said):
    problem = skill_problem(skill)
    assert problem is not None and said in problem and "regex" not in problem
    assert problem.endswith("`improved skill hash FILE` prints, whole")
    assert skill_problem("summarize:" + "a" * 64) is None


def test_each_hint_is_said_once():
    assert verdicts.each_once("L0 is below L2; re-propose at the right class",
                              "re-propose at the right class (never up- or downgraded)") == (
        "L0 is below L2; re-propose at the right class (never up- or downgraded)")
    assert verdicts.each_once("a; b", "b", "c") == "a; b; c"
    assert verdicts.each_once("why", "") == "why"


def test_every_exit_code_is_documented_where_it_is_defined():
    doc = errors.__doc__ or ""
    for code in (errors.OK, errors.REFUSED, errors.USAGE, errors.UNVERIFIED,
                 errors.INTERRUPTED, errors.BROKEN_PIPE):
        assert re.search(rf"^\s+{code}\s", doc, re.M), code
