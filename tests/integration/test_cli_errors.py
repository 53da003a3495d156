"""Every mistake that once ended in a traceback, run through the installed `improved` command
as a user runs it: exactly one line on stderr, no traceback, the exit code improved/cli/errors.py
documents, and nothing made on the way. Then the messages that were wrong or leaked internals,
and the daemon's start, which logs no warning when nothing is wrong."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from improved.cli import errors
from tests.cli import ENV
from tests.factories import rank_proposal

# the console script pip installed, as a user runs it; the module where there is none
SCRIPT = Path(sys.executable).with_name("improved")
IMPROVED = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "improved.cli"]
ID = "ab" * 32
ROOT = Path(__file__).resolve().parents[2]


def env_in(tmp_path: Path) -> dict[str, str]:
    """No configuration, no server and no keys of this machine's: all of it under tmp_path."""
    return {**ENV, "IMPROVED_KEYS": str(tmp_path / "keys"), "HOME": str(tmp_path / "home"),
            "XDG_STATE_HOME": str(tmp_path / "state"), "IMPROVED_PRINCIPAL": ""}


def run(tmp_path: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*IMPROVED, *args], capture_output=True, text=True, timeout=60,
                          env=env_in(tmp_path), cwd=tmp_path, **kw)


def one_line(done: subprocess.CompletedProcess, code: int) -> str:
    """The one line a failed command printed, checked: no traceback, the code."""
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.endswith("\n"), done.stderr
    assert done.returncode == code, (done.returncode, done.stderr)
    return done.stderr.strip()


TRACEBACKS = [
    (["run", "--port", "99999"], "argument --port: a port is 0 to 65535 (0: a free port)"),
    (["run", "--metrics-port", "99999"], "argument --metrics-port: a port is 0 to 65535 (0: a "
                                           "free port)"),
    (["run", "--metrics-port", "-1"], "argument --metrics-port: a port is 0 to 65535 (0: a "
                                      "free port)"),
    (["console", "--port", "70000"], "argument --port: a port is 0 to 65535 (0: a free port)"),
    (["run", "--data-dir", "{file}"], "the data directory {file} is a file, not a directory"),
    (["run", "--data-dir", "{file}/sub"], "cannot make the data directory {file}/sub: Not a "
                                          "directory"),
    (["keys", "new", "--principal", "operator:x", "--dir", "/proc/x"],
     "cannot write a key under /proc/x: No such file or directory"),
    (["keys", "new", "--principal", "operator:x", "--dir", "{file}/sub"],
     "cannot write a key under {file}/sub: Not a directory"),
    (["keys", "new", "--principal", "operator:x", "--dir", "{file}"],
     "cannot write a key under {file}: a file is in the way"),
]


@pytest.mark.parametrize(("args", "said"), TRACEBACKS, ids=lambda v: " ".join(v)
                         if isinstance(v, list) else "")
def test_what_was_a_traceback_is_one_line_exit_2_and_changes_nothing(tmp_path, args, said):
    file = tmp_path / "regular-file"
    file.write_text("not a directory\n")
    before = sorted(tmp_path.rglob("*"))
    args = [a.format(file=file) for a in args]
    line = one_line(run(tmp_path, *args), errors.USAGE)
    assert line.startswith(f"improved {args[0]}"), line
    assert said.format(file=file) in line, line
    assert sorted(tmp_path.rglob("*")) == before  # no key, no data directory, no server


def closed_early(tmp_path: Path, *args: str) -> tuple[int, str]:
    """Run with stdout closed before the command writes, as `| head -1` leaves it."""
    proc = subprocess.Popen([*IMPROVED, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env_in(tmp_path), cwd=tmp_path)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    return proc.wait(timeout=60), stderr


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("command", [["status"], ["audit", "verify"]])
async def test_output_closed_early_exits_141_quietly(nats_url, daemon, tmp_path, command):
    """`improved status | head -1`, `improved audit verify | head -1`."""
    code, stderr = await asyncio.to_thread(closed_early, tmp_path, *command, "--nats", nats_url)
    assert code == errors.BROKEN_PIPE == 141, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    if command == ["status"]:
        assert stderr == ""


def test_a_malformed_proposal_file_is_named_with_its_line_and_column(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "service": "demo",\n  "summary": [1, 2,\n}\n')
    line = one_line(run(tmp_path, "propose", str(bad)), errors.USAGE)
    assert line == (f"improved propose: {bad}, line 4, column 1: not JSON: Expecting value; a "
                    "proposal is a JSON object")
    array = tmp_path / "array.json"
    array.write_text("[1, 2]")
    assert one_line(run(tmp_path, "propose", str(array)), errors.USAGE) == (
        f"improved propose: {array} holds a JSON array, not an object: a proposal is a JSON "
        "object")
    done = run(tmp_path, "propose", "-", input='{"service": 5}')
    assert "stdin has `service` 5, not a service name" in one_line(done, errors.USAGE)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_malformed_proposal_exits_2_whether_refused_here_or_by_the_daemon(
        nats_url, daemon, tmp_path, svc):
    good = msgspec.to_builtins(rank_proposal(svc))
    bad_class = json.dumps({**good, "change_class": "L9"})
    done = await asyncio.to_thread(run, tmp_path, "propose", "-", "--nats", nats_url,
                                   input=bad_class)
    line = one_line(done, errors.USAGE)
    assert line.startswith("improved propose: refused invalid_value (change_class)"), line
    as_json = await asyncio.to_thread(run, tmp_path, "propose", "--json", "-", "--nats",
                                      nats_url, input=bad_class)
    assert as_json.returncode == errors.USAGE
    assert json.loads(as_json.stdout)["error"]["code"] == "invalid_value"


@pytest.mark.asyncio(loop_scope="session")
async def test_a_rejected_proposal_says_each_hint_once(nats_url, daemon, tmp_path, svc):
    good = msgspec.to_builtins(rank_proposal(svc))
    cases = [({"target_ref": "skill:once", "change_class": "L0"}, "class_mismatch"),
             ({"target_ref": "doc:_spec/CHANGELOG.md", "change_class": "L2"},
              "forbidden_target"),
             ({"target_ref": "rnk:once"}, "class_mismatch")]
    for change, cause in cases:
        done = await asyncio.to_thread(run, tmp_path, "propose", "-", "--nats", nats_url,
                                       input=json.dumps({**good, **change}))
        line = one_line(done, errors.REFUSED)
        assert f"rejected: reject/{cause}" in line, line
        clauses = line.split(": ", 1)[1].split("; ")
        assert len(clauses) == len(set(clauses)), line
        for repeated in ("re-propose at the right class", "no class may change",
                         "fix the scheme", "fix the target's scheme"):
            assert line.count(repeated) <= 1, line


def test_a_grant_of_a_hash_prefix_is_refused_in_words(tmp_path):
    done = run(tmp_path, "grant", "summarize:abcdef123456", "--proposal", ID, "--reason", "ok",
               "--principal", "operator:alice")
    line = one_line(done, errors.USAGE)
    assert line == ("improved grant: summarize:abcdef123456 gives 12 of the hash's 64 hex "
                    "digits: a grant binds the whole hash, never a prefix; give the NAME:SHA256 "
                    "`improved skill hash FILE` prints, whole")
    line = one_line(run(tmp_path, "revoke", "Summarize:" + "c" * 64, "--reason", "no"),
                    errors.USAGE)
    assert "regex" not in line and "\\Z" not in line and "'Summarize' is not a skill name" in line


def test_a_principal_without_operator_suggests_one_that_works(tmp_path):
    line = one_line(run(tmp_path, "approve", ID, "--reason", "ok", "--principal", "alice"),
                    errors.USAGE)
    assert "--principal operator:alice" in line, line
    suggested = re.search(r"--principal (\S+?)\?", line)
    assert suggested is not None
    made = run(tmp_path, "keys", "new", "--principal", suggested.group(1))
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "keys" / "operator_alice.pem").exists()


def _run_until_ready(tmp_path, then=None) -> tuple[int, str, list[str]]:
    """`improved run --port 0` on `tmp_path/data` until ready, 2 s more (what it does after
    ready is logged too), `then(url)` if given, then SIGTERM: (exit code, all it said, its
    log lines' levels)."""
    proc = subprocess.Popen([*IMPROVED, "run", "--port", "0", "--data-dir",
                             str(tmp_path / "data")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env_in(tmp_path),
                            cwd=tmp_path)
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("improved: ready as"):
                break
        time.sleep(2)  # what it does after ready (the refill, the index checks) is logged too
        listening = re.search(r"listening on (nats://127\.0\.0\.1:\d+)", "".join(lines))
        if then is not None and listening is not None:
            then(listening.group(1))
    finally:
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    lines += rest.splitlines(keepends=True)
    levels = [json.loads(line).get("level") for line in lines if line.startswith("{")]
    return proc.returncode, "".join(lines), levels


def test_run_on_port_0_listens_on_a_free_port_and_a_fresh_start_warns_of_nothing(tmp_path):
    def propose(url: str) -> None:
        done = subprocess.run([*IMPROVED, "propose", "--nats", url,
                               str(ROOT / "examples" / "skill-l2.json")],
                              capture_output=True, text=True, env=env_in(tmp_path), timeout=60)
        assert done.returncode == 0, done.stderr

    code, said, levels = _run_until_ready(tmp_path, then=propose)
    assert code == 0, said
    listening = re.search(r"listening on nats://127\.0\.0\.1:(\d+)", said)
    assert listening is not None and int(listening.group(1)) not in (0, 4222), said
    assert levels and "warning" not in levels and "error" not in levels, said
    # started again: the embedded server's restart lost the records (memory storage, the
    # default) and the daemon refilled them from the chains — as expected, so no warning
    code, said, levels = _run_until_ready(tmp_path)
    assert code == 0, said
    assert "refilled from the audit chains" in said, said
    assert levels and "warning" not in levels and "error" not in levels, said

