"""The README's "An operator's first hour", run as it stands.

Every shell block of that section marked `<!-- walkthrough -->` is run line by line with
`bash -c`, in a directory of the test's own where `examples/` is the repository's, against a
real nats-server of the test's own (`own_server`: the session server's daemon would take the
walk's signed acts off the shared inbound consumer and judge them by its own trust store). The
test sets only what the section says a reader may set: `IMPROVED_NATS_URL` (the server) and
`IMPROVED_KEYS` (the key directory), and puts `improved` and `python` first on the PATH.

A block marked `<!-- walkthrough: serve -->` holds long-running commands, one per terminal for
a reader: each is started in the background, its output kept, and the walk goes on once it
printed the line its comment shows. They are stopped with SIGTERM at the end and must exit 0.

A line's `# → TEMPLATE` comment is a line the command prints (stdout or stderr, leading spaces
ignored): `…` stands for anything, and `<name>` for a token (letters, digits, `:`, `.`, `-`,
`_`). A placeholder seen for the first time takes the token printed there; after that it stands
for that value, in a template (which must then print it) and in a command (where it is pasted,
as a reader would paste it). Every command must exit 0 and print its line; a read-only command
(show, review, audit, skill hash, cat) is asked again for a few seconds until it does, as a
reader reads again while an apply finishes. After the walk, the effects are checked on the
broker itself and in the daemon's log."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from improved.client import connection
from improved.protocol import canonical
from improved.runtime import bus
from improved_reference.artefact_store import bucket_names as artefact_buckets
from improved_reference.artefact_store import digest_of
from improved_reference.skills_store import bucket_names as skills_buckets
from tests.bus import wait_for_event

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
TITLE = "An operator's first hour"
BLOCK = re.compile(r"<!-- walkthrough(?:: (?P<kind>serve))? -->\n```sh\n(?P<body>.*?)```", re.S)
ARROW = "# →"
PLACEHOLDER = re.compile(r"<([a-z][a-z0-9-]*)>")
TOKEN = r"[\w:.-]+"
READ_ONLY = ("improved show", "improved review", "improved audit", "improved skill hash", "cat ")
READ_AGAIN_S = 15.0
SERVE_READY_S = 30.0


def section() -> str:
    assert f"\n## {TITLE}\n" in README, f"the README has no section {TITLE!r}"
    return README.split(f"\n## {TITLE}\n", 1)[1].split("\n## ", 1)[0]


def blocks() -> list[tuple[str, list[tuple[str, str | None]]]]:
    """Each marked block: its kind ("step" or "serve") and its lines as (command, template)."""
    found = []
    for m in BLOCK.finditer(section()):
        lines = []
        for line in m.group("body").splitlines():
            if not line.strip():
                continue
            command, arrow, template = line.partition(ARROW)
            lines.append((command.strip(), template.strip() if arrow else None))
        found.append((m.group("kind") or "step", lines))
    return found


def pattern(template: str, bound: dict[str, str]) -> re.Pattern[str]:
    """The template as a regex: `…` anything, a bound `<name>` its value, an unbound one a
    named group."""
    out, groups = "", set()
    for part in re.split(r"(<[a-z][a-z0-9-]*>|…)", template):
        m = PLACEHOLDER.fullmatch(part)
        if part == "…":
            out += ".*?"
        elif m and m.group(1) in bound:
            out += re.escape(bound[m.group(1)])
        elif m:
            group = m.group(1).replace("-", "_")
            out += f"(?P={group})" if group in groups else f"(?P<{group}>{TOKEN})"
            groups.add(group)
        else:
            out += re.escape(part)
    return re.compile(out)


def match(template: str, output: str, bound: dict[str, str]) -> dict[str, str] | None:
    """The placeholders a line of `output` binds by matching `template`; None if none does."""
    regex = pattern(template, bound)
    for line in output.splitlines():
        m = regex.match(line.strip())
        if m:
            return {name.replace("_", "-"): value for name, value in m.groupdict().items()}
    return None


def paste(command: str, bound: dict[str, str]) -> str:
    def value(m: re.Match[str]) -> str:
        assert m.group(1) in bound, (f"the README uses <{m.group(1)}> in `{command}` before a "
                                     "command printed it")
        return bound[m.group(1)]

    return PLACEHOLDER.sub(value, command)


def shell_env(tmp: Path, url: str) -> dict[str, str]:
    """The environment the section documents, with `improved` and `python` first on the PATH
    (this interpreter, whatever installed it)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, run in (("python", ""), ("improved", " -m improved.cli")):
        wrapper = bin_dir / name  # a script, not a link: a venv's python finds its site by path
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}"{run} "$@"\n')
        wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("IMPROVED_") and k != "PYTHONPATH"}
    # the reader's own per-user state: the daemon's data directory is its default there
    return {**env, "IMPROVED_NATS_URL": url, "IMPROVED_KEYS": str(tmp / "keys"),
            "XDG_STATE_HOME": str(tmp / "state"),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


class Walk:
    def __init__(self, tmp: Path, url: str):
        self.work = tmp / "work"
        self.work.mkdir()
        (self.work / "examples").symlink_to(ROOT / "examples")
        self.env = shell_env(tmp, url)
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.bound: dict[str, str] = {}
        self.served: list[tuple[str, subprocess.Popen, Path]] = []

    def step(self, command: str, template: str | None) -> str:
        line = paste(command, self.bound)
        deadline = time.monotonic() + (READ_AGAIN_S if line.startswith(READ_ONLY) else 0)
        while True:
            done = subprocess.run(["bash", "-c", line], cwd=self.work, env=self.env,
                                  capture_output=True, text=True, timeout=90)
            output = done.stdout + done.stderr
            assert done.returncode == 0, f"`{line}` exited {done.returncode}:\n{output}"
            assert "Traceback" not in output, output
            got = {} if template is None else match(template, output, self.bound)
            if got is not None:
                self.bound.update(got)
                return output
            if time.monotonic() >= deadline:
                pytest.fail(f"`{line}` printed no line matching the README's `# → {template}`:"
                            f"\n{output}")
            time.sleep(0.3)

    def serve(self, command: str, template: str | None) -> None:
        assert template is not None, f"a serve line says what it prints when ready: {command}"
        log = self.logs / f"{len(self.served)}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(["bash", "-c", "exec " + paste(command, self.bound)],
                                    cwd=self.work, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, text=True)
        self.served.append((command, proc, log))
        deadline = time.monotonic() + SERVE_READY_S
        while time.monotonic() < deadline:
            got = match(template, log.read_text(), self.bound)
            if got is not None:
                self.bound.update(got)
                return
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        pytest.fail(f"`{command}` did not print `{template}`:\n{log.read_text()}")

    def stop(self) -> list[tuple[str, int | None, str]]:
        """SIGTERM to everything served, last first; (command, exit code, output) each."""
        ended = []
        for command, proc, log in reversed(self.served):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            ended.append((command, proc.returncode, log.read_text()))
        self.served.clear()
        return ended


def test_the_section_walks_the_whole_loop():
    """The section shows every step the issue asks for, in marked blocks: a test that ran
    fewer commands would not be the walkthrough."""
    commands = [c for _, lines in blocks() for c, _ in lines]
    text = "\n".join(commands)
    for needed in ("improved keys new --principal operator:", "improved run --config",
                   "improved_reference.ranking_store", "improved_reference.skills_store",
                   "improved_reference.artefact_store", "--seed ", "improved propose",
                   "improved review", "improved approve", "improved show", "improved skill hash",
                   "improved grant", "improved rollback", "improved revoke", "improved revert",
                   "improved audit verify", "kill -HUP"):
        assert needed in text, f"the walkthrough no longer runs {needed!r}"
    for example in re.findall(r"examples/[\w.-]+", text):
        assert (ROOT / example).is_file(), f"{example} does not exist"


def test_the_operators_first_hour_runs_as_written(own_server, tmp_path):
    walk = Walk(tmp_path, own_server.url)
    try:
        for kind, lines in blocks():
            for command, template in lines:
                (walk.serve if kind == "serve" else walk.step)(command, template)
        daemon_log = walk.served[0][2]
        reloaded = wait_for_event(daemon_log, "trust store reloaded")
        effects = asyncio.run(broker_effects(own_server.url))
    finally:
        ended = walk.stop()
    for command, code, output in ended:
        assert code == 0, f"`{command}` exited {code} on SIGTERM:\n{output[-2000:]}"
        assert "Traceback" not in output, output

    # the bob key added at the end was recorded and named in the one reload line
    assert "operator operator:bob" in reloaded and '"removed": []' in reloaded, reloaded
    # the L0 change is in the ranking store; the rolled-back L2 skill is retracted from the skills
    # store; the reverted swap left app at the seeded last-known-good
    assert effects["rank"] == 1.5
    assert effects["skill"] is None, effects
    seeded = (ROOT / "examples" / "app-release-1.json").read_text()
    assert effects["manifest"] == {"app": digest_of(seeded.encode())}
    b = walk.bound
    identity = canonical.skill_identity(
        json.loads((ROOT / "examples" / "skill-l2.json").read_text())["proposal_data"]["skill"])
    assert b["skill-hash"] == identity
    assert {b["rank-id"], b["skill-id"], b["rerun-id"], b["swap-id"], b["revert-id"]} \
        <= effects["chains"]
    assert effects["outcomes"][b["skill-id"]] == "operator:alice"
    assert effects["outcomes"][b["rerun-id"]] == "policy:auto"


def test_the_operators_first_hour_runs_as_written_on_the_bus_with_users(tmp_path):
    """The same walk with the daemon started `--accounts` in the work directory (its own
    port), and the user the README says service demo needs added before its store starts; no
    server named, no credential given: every command and store finds its own user in the
    default data directory's `accounts/`, and the server refused none of them anything."""
    walk = Walk(tmp_path, "unused")
    del walk.env["IMPROVED_NATS_URL"]
    port = bus.free_port()
    try:
        for kind, lines in blocks():
            for command, template in lines:
                if command.startswith("improved run "):
                    command += f" --accounts --port {port}"
                if "ranking_store --service demo" in command:
                    walk.step("improved accounts add-service demo",
                              "svc-demo: a user of … with …")
                (walk.serve if kind == "serve" else walk.step)(command, template)
        wait_for_event(walk.served[0][2], "trust store reloaded")
    finally:
        ended = walk.stop()
    for command, code, output in ended:
        assert code == 0, f"`{command}` exited {code} on SIGTERM:\n{output[-2000:]}"
    assert not (walk.work / ".improved").exists()  # nothing is kept where a command runs
    log = (tmp_path / "state" / "improved" / "nats-server.log").read_text()
    assert "Violation" not in log, [line for line in log.splitlines() if "Violation" in line]


async def broker_effects(url: str) -> dict:
    """What the walk left on the broker, read there directly."""
    from improved.protocol import subjects as S

    nc = await connection.connect(url, "walkthrough-check", persistent=False)
    try:
        js = nc.jetstream()
        rank = await (await js.key_value("rank_demo")).get("search.title_boost")
        skill_name, sha = canonical.skill_identity(json.loads(
            (ROOT / "examples" / "skill-l2.json").read_text())["proposal_data"]["skill"]
        ).split(":")
        defs = await js.key_value(skills_buckets("skills")[0])
        try:
            entry = await defs.get(f"{skill_name}.{sha}")
            skill = entry.value or None
        except Exception:  # deleted (retracted) or never there
            skill = None
        heads = await js.key_value(artefact_buckets("deploy")[1])
        manifest = msgspec.json.decode((await heads.get("manifest")).value)
        chains, outcomes = set(), {}
        info = await js.stream_info(S.STREAM_AUDIT, subjects_filter="improve.audit.>")
        for subject in (info.state.subjects or {}):
            chains.add(subject.rsplit(".", 1)[-1])
        for svc in ("skills",):
            for subject in (info.state.subjects or {}):
                if subject.startswith(f"improve.audit.{svc}."):
                    pid = subject.rsplit(".", 1)[-1]
                    msg = await js.get_last_msg(S.STREAM_RECORDS, S.apply_outcome(svc, pid))
                    outcomes[pid] = msgspec.json.decode(msg.data).get("authority")
        return {"rank": msgspec.json.decode(rank.value), "skill": skill, "manifest": manifest,
                "chains": chains, "outcomes": outcomes}
    finally:
        await connection.close(nc)
