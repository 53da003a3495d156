"""examples/mesh_service.py, run as docs/services.md prints it, against the session's real
nats-server and daemon: it proposes an L0 change to itself, serves the apply, and says what
was applied; the proposal's audit chain then shows it applied under the policy principal."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

from tests.cli import ENV, improved

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mesh_service.py"


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True,
                          text=True, timeout=90, env=ENV)


async def test_the_example_service_proposes_serves_and_sees_its_change_applied(nats_url, daemon):
    done = await asyncio.to_thread(run_example, "--nats", nats_url, "--service",
                                   "example-guide", "--key", "search.title_boost",
                                   "--value", "2.5")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    proposed = re.fullmatch(r"proposed ([0-9a-f]{64}) \(pending\)", lines[0])
    assert proposed, lines
    applied = json.loads(lines[1].removeprefix("applied: "))
    assert applied["ok"] is True and applied["authority"].startswith("policy:")
    assert applied["inverse"] == {"delete": "search.title_boost"}  # nothing was there before
    assert lines[2] == "search.title_boost = 2.5"

    shown = await asyncio.to_thread(improved, "show", "--json", "--nats", nats_url,
                                    proposed.group(1))
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    assert view["state"]["status"] == "applied", view["state"]
    assert "apply" in [t["to_stage"] for t in view["trailers"]]
    assert view["outcome"]["inverse"] == {"delete": "search.title_boost"}


async def test_the_example_says_in_one_line_when_nothing_listens(tmp_path):
    """No server at the URL: one line and exit 2, no traceback."""
    done = await asyncio.to_thread(run_example, "--nats", "nats://127.0.0.1:9",
                                   "--service", "example-guide")
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


async def test_the_example_runs_as_its_own_user_on_the_bus_with_users_too(mesh_bus):
    """On the open bus and under deploy/accounts.conf's users, as the guide says: the service's
    user from the two IMPROVED_NATS_* variables, and nothing it does is refused by the server."""
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, str(EXAMPLE), "--nats", mesh_bus.url,
                         "--service", "ranking"],
        capture_output=True, text=True, timeout=90, env={**ENV, **mesh_bus.env("svc-ranking")})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[1].startswith('applied: {"ok": true'), done.stdout
    assert not mesh_bus.violations("svc-ranking")
