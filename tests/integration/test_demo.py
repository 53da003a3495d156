"""`improved demo`: the whole loop on its own embedded mesh, walked through and verified."""

from __future__ import annotations

import asyncio
import io
import re
import socket
import subprocess
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.protocol import canonical
from improved_demo import demo


def _in_order(text: str, *parts: str) -> bool:
    at = 0
    for part in parts:
        at = text.find(part, at)
        if at < 0:
            return False
        at += len(part)
    return True


async def test_the_walk_shows_every_outcome_and_verifies_the_chains():
    out = io.StringIO()
    started = time.monotonic()
    rc = await demo.run(out, pace=0.0)
    elapsed = time.monotonic() - started
    text = out.getvalue()
    assert rc == 0, text
    assert "FAILED" not in text, text
    assert elapsed < 30, f"took {elapsed:.1f}s at pace 0"
    identity = canonical.skill_identity(demo.SKILL)
    for expected in (
        # 1. L1 surfaces, nothing applied
        "accept/L1: surfaced for review, status pending; the skills store got no order",
        # 2. L2 waits, then a signed approval applies it once under operator:demo
        "defer/L2 awaiting_operator",
        "operator:demo signs 'approve'",
        "authority operator:demo",
        "approved by operator:demo and applied once (1 order), status applied",
        # 3. the grant binds exactly the content hash
        f"canonical.skill_identity(definition) = {identity}",
        "grant summarize:<sha256> recorded",
        # 4. L3 under the grant: rec:policy, policy:auto
        "accept/L3",
        "observer rec:policy, authority policy:auto",
        # 5. a refinement is a new hash: no_grant, gated as L2
        "defer/L2 no_grant",
        # 6. feedback collapse, then an independent signal releases it
        "counted=True, independent=True",
        # 7. forbidden target, whatever the class
        "reject/L0 forbidden_target",
        "reject/L4 forbidden_target",
        # 8. rollback restores the prior value
        "rollback by operator:demo, dispatched, rolled_back by operator:demo",
        "search.title_boost is 1.0 again",
        # 9. learn-back measures again at review_after, finds a regression, rolls it back
        "measured by asked search: value 0.22 against baseline 0.31 -> regressed",
        "search.snippet_weight is unset again",
        # 10. OMS knowledge: a CAL batch and a doc edit applied, then undone by their inverses
        "memory: 1 live fact(s): 'morning_run_5k'; authority operator:demo",
        "the grains the batch really wrote, so a rollback can replay it",
        "memory: 2 live fact(s): 'morning run', 'running'",
        "docs: docs/guide.md line 3 reads 'Run the demo.'",
        "each undone by the inverse its store returned",
        # 11. L4: all or none, then reverted without a second approval
        "smoke test json failed (rc 1); nothing swapped",
        "reversal recorded before the apply: revert_proposal_id",
        "inherited the approval of operator:demo: no second signature",
        # 12. schema changes: no revert, backward, forward
        "schema_revert: a schema change carries its backward-compatible revert",
        "ok=False: schema_backward: orders at /properties/qty/maximum: lowered to 10",
        "schema: no revert, rejected",
        # 13. the audit
        "all verified",
        "RESULT: every step behaved as the loop promises",
        "improved review",
        "improved audit verify",
    ):
        assert expected in text, f"missing {expected!r} in:\n{text}"
    assert _in_order(text, "defer/L0 feedback_collapse", "independent=True",
                     "search set search.title_boost 1.0 -> 1.5"), text
    assert re.search(r"\d+ chains, \d+ trailers: all verified", text), text
    # ids are shortened to 12 hex digits in the timeline
    assert re.search(r"-> [0-9a-f]{12}, pending", text), text
    assert "\033[" not in text  # no colours on a non-terminal


async def test_a_step_that_never_arrives_fails_within_bounds_and_cleans_up(
        monkeypatch, tmp_path):
    """The operator signs with a key the daemon does not trust: the approval, the grant and the
    rollback never take effect. The walk reports FAILED lines, goes on, returns 1, and leaves no
    server behind; the kept data directory still verifies."""
    start = demo.Demo.start

    async def untrusted(self, root):
        await start(self, root)
        self.mesh.operator_key = Ed25519PrivateKey.generate()

    monkeypatch.setattr(demo.Demo, "start", untrusted)
    monkeypatch.setattr(demo, "STEP_TIMEOUT", 1.0)
    out = io.StringIO()
    started = time.monotonic()
    rc = await demo.run(out, data_dir=tmp_path / "mesh", pace=0.0)
    text = out.getvalue()
    assert rc == 1, text
    assert time.monotonic() - started < 40
    assert text.count("FAILED") >= 3, text
    assert "the apply outcome of" in text and "did not arrive within 1s" in text
    assert "the daemon refused the act: " in text and "(unknown_key)" in text, text
    assert "reject/L4 forbidden_target" in text  # the steps after a failure still ran
    assert "all verified" in text
    assert "RESULT:" in text and "FAILED" in text.split("RESULT:")[1]
    assert (tmp_path / "mesh" / "jetstream").is_dir()  # kept, as asked
    port = int(re.search(r"nats://127\.0\.0\.1:(\d+)", text).group(1))
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        pass


async def test_a_used_data_dir_is_refused(tmp_path):
    (tmp_path / "something").write_text("x")
    out = io.StringIO()
    assert await demo.run(out, data_dir=tmp_path) == 1
    assert "not an empty directory" in out.getvalue()


def test_help_describes_the_demo(capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.main(["--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    assert "self-improve loop" in shown and "--pace" in shown and "--data-dir" in shown


async def test_the_hints_of_a_kept_demo_verify_clean_from_any_directory(tmp_path):
    """"Try it yourself" names the kept store in every command: served again by `improved
    run` with that data directory, the printed `improved audit verify` line run from another
    directory finds the daemon's key there and verifies the log (exit 0); without the
    store kept, the hint says it is gone instead of printing commands that cannot work."""
    kept = tmp_path / "mesh"
    out = io.StringIO()
    assert await demo.run(out, data_dir=kept, pace=0.0) == 0, out.getvalue()
    hints = out.getvalue().split("Try it yourself:", 1)[1]
    verify = next(line.split("#")[0].split() for line in hints.splitlines()
                  if "improved audit verify" in line)
    assert verify == ["improved", "audit", "verify", "--data-dir", str(kept)], hints
    done = await asyncio.to_thread(_served_and_run, kept, verify, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].startswith("VERIFIED "), done.stdout

    gone = io.StringIO()
    assert await demo.run(gone, pace=0.0) == 0
    assert "store was temporary and is gone now" in gone.getvalue()
    assert "improved audit verify --data-dir DIR" in gone.getvalue()


def _served_and_run(kept, command: list[str], cwd) -> subprocess.CompletedProcess:
    """`improved run` of the kept data directory on a free port (the hint's 4222 may be
    another's on this machine), and `command` run in `cwd` while it serves."""
    from improved.runtime import bus
    from tests.cli import IMPROVED, improved

    daemon = subprocess.Popen([*IMPROVED, "run", "--data-dir", str(kept), "--port",
                               str(bus.free_port())], stderr=subprocess.PIPE, text=True)
    try:
        while "ready as improved:" not in (line := daemon.stderr.readline()):
            assert line, "the kept demo's daemon did not start"
        assert f"data directory {kept}" in line, line
        return improved(*command[1:], cwd=str(cwd))
    finally:
        daemon.terminate()
        daemon.wait(30)
