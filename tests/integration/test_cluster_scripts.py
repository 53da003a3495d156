"""deploy/up.sh and deploy/down.sh as an operator runs them, beside a server on the default
port: every port checked before anything starts, a busy one refused in one line that names
it; on free ports of its own the cluster comes up, its printed hints run as printed, and
down.sh stops it all. The refusals start nothing and run in the default suite; the test that
starts the cluster is slow."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import (
    DOWN,
    UP,
    listening,
    processes_naming,
    run_script,
    script_env,
    script_ports,
    start_server,
    stop_server,
)

DEFAULT_PORT = 4222


def held(port: int) -> socket.socket:
    """A socket listening on `port`, as another program's would."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def refused_and_nothing_left(done: subprocess.CompletedProcess, home: Path,
                             ports: dict[str, int], busy: int | None = None) -> str:
    """up.sh's one line of refusal, after checking it started and wrote nothing."""
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr)
    assert done.stdout == "", done.stdout
    run_dir = home / "state" / "improved-cluster"
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())  # no pid files
    assert processes_naming(str(run_dir)) == []
    cluster_ports = {p for first in ports.values() for p in range(first, first + 3)}
    assert [p for p in cluster_ports - {busy} if listening(p)] == []
    return lines[0]


@pytest.mark.parametrize(("var", "node"), [("IMPROVED_CLUSTER_PORT", 1),
                                           ("IMPROVED_CLUSTER_ROUTE_PORT", 2),
                                           ("IMPROVED_CLUSTER_MONITOR_PORT", 3)])
def test_up_refuses_a_busy_port_first_and_starts_nothing(tmp_path, var, node):
    """One of the nine ports the cluster would listen on is held by another program: up.sh
    says so on its first and only line, naming the port and the variable that moves it, exits
    2, and leaves no process, pid file or run directory behind."""
    ports = script_ports()
    busy = ports[var] + node - 1
    with held(busy):
        done = run_script(UP, script_env(tmp_path, ports), timeout=30)
        line = refused_and_nothing_left(done, tmp_path, ports, busy)
    assert line.startswith(f"up.sh: port {busy} "), line
    assert f"of node n{node}) is in use" in line and f"{var}=N" in line, line
    assert line.endswith("nothing started"), line


@pytest.mark.parametrize(("value", "said"), [
    ("port", "IMPROVED_CLUSTER_PORT=port is not a port number"),
    ("65534", "IMPROVED_CLUSTER_PORT=65534 is not a port number"),
    ("route", "overlap")])
def test_up_refuses_ports_it_cannot_use_in_one_line(tmp_path, value, said):
    """A port that is no number, leaves no room for three nodes, or overlaps another kind's
    ports: one line naming the variable, exit 2, nothing started."""
    ports = script_ports()
    ports_env: dict[str, int | str] = dict(ports)
    ports_env["IMPROVED_CLUSTER_PORT"] = (ports["IMPROVED_CLUSTER_ROUTE_PORT"] + 1
                                         if value == "route" else value)
    done = run_script(UP, script_env(tmp_path, ports_env), timeout=30)
    line = refused_and_nothing_left(done, tmp_path, ports)
    assert said in line, line


# -- the cluster beside a server on the default port (slow: it starts everything) -----------


@pytest.fixture
def default_port_taken(tmp_path) -> Iterator[None]:
    """A server on the default port 4222, as `improved run` keeps one: this test's own when
    the port is free, else whatever already listens there."""
    if listening(DEFAULT_PORT):
        yield
        return
    conf = tmp_path / "default.conf"
    conf.write_text(f"listen: 127.0.0.1:{DEFAULT_PORT}\n")
    proc = start_server(conf, DEFAULT_PORT, tmp_path / "default.log")
    try:
        yield
        assert proc.poll() is None, "the server on the default port was stopped"
    finally:
        stop_server(proc)


def hint(stdout: str, *words: str) -> str:
    """The one printed hint line holding every word."""
    lines = [line.strip() for line in stdout.splitlines() if all(w in line for w in words)]
    assert len(lines) == 1, (words, stdout)
    return lines[0]


def pids_of(run_dir: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in run_dir.glob("*.pid")}


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


@pytest.mark.slow
def test_cluster_on_its_own_ports_beside_the_default_server_verifies_clean(
        tmp_path, default_port_taken):
    """With 4222 held by another server and free ports of the test's choosing, up.sh brings
    the cluster up in its own run directory (under XDG_STATE_HOME), not touching 4222; the
    proposal and the verify command it prints, run exactly as printed, exit 0, the verify
    trusting the daemons' key; down.sh stops every process it started."""
    ports = script_ports()
    # a data directory of a single daemon in the environment must not mislead the hints
    env = script_env(tmp_path, ports, IMPROVED_DATA_DIR=str(tmp_path / "single"))
    run_dir = tmp_path / "state" / "improved-cluster"
    started: dict[str, int] = {}
    try:
        up = run_script(UP, env)
        assert up.returncode == 0, up.stdout + up.stderr
        started = pids_of(run_dir)
        assert set(started) == {"n1", "n2", "n3", "improved-1", "improved-2", "ranking"}
        client = ports["IMPROVED_CLUSTER_PORT"]
        assert f"cluster up: nats://127.0.0.1:{client}, :{client + 1}, :{client + 2}" in up.stdout
        assert all(listening(p) for p in range(client, client + 3))
        export = hint(up.stdout, "export IMPROVED_NATS_USER=operator")
        propose = hint(up.stdout, " propose - ")
        verify = hint(up.stdout, " audit verify ")
        proposed = subprocess.run(["bash", "-c", f"{export}\n{propose}"], capture_output=True,
                                  text=True, env=env, cwd=tmp_path, timeout=60)
        assert proposed.returncode == 0, proposed.stdout + proposed.stderr
        checked = subprocess.run(["bash", "-c", f"{export}\n{verify}"], capture_output=True,
                                 text=True, env=env, cwd=tmp_path, timeout=60)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "a trusted daemon key) holds" in checked.stdout, checked.stdout
        assert "BROKEN" not in checked.stdout + checked.stderr
    finally:
        down = run_script(DOWN, env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert pids_of(run_dir) == {}
    assert all(gone(pid) for pid in started.values()), started
    assert not any(listening(p) for first in ports.values() for p in range(first, first + 3))
    purged = run_script(DOWN, env, "--purge")
    assert purged.returncode == 0 and not run_dir.exists(), purged.stdout + purged.stderr


@pytest.mark.slow
def test_a_node_that_fails_to_start_stops_the_others_and_says_why_first(tmp_path):
    """Node n2 exits at start (its nats-server fails) while n1 and n3 come up: up.sh says so
    on its first line, naming the node and its log, shows that log under it, stops n1 and n3,
    and leaves no process, pid file or listener behind."""
    venv = Path(os.path.realpath(Path(__file__).parents[2] / ".venv" / "bin"))
    fake = tmp_path / "venv" / "bin"
    fake.mkdir(parents=True)
    for exe in ("python", "improved"):
        (fake / exe).symlink_to(venv / exe)
    real = os.path.realpath(venv / "nats-server")
    (fake / "nats-server").write_text(  # n2 passes its config check (-t), then fails to run
        "#!/usr/bin/env bash\n"
        'case "$*" in *n2.conf) [ "$3" = -t ] && exit 0\n'
        '  echo "simulated: n2 cannot open its store"; exit 1 ;; esac\n'
        f'exec "{real}" "$@"\n')
    (fake / "nats-server").chmod(0o755)
    ports = script_ports()
    run_dir = tmp_path / "state" / "improved-cluster"
    env = script_env(tmp_path, ports, IMPROVED_VENV=str(fake.parent))
    try:
        up = run_script(UP, env, timeout=120)
    finally:
        pids = pids_of(run_dir)
        run_script(DOWN, env, "--purge")
    lines = up.stderr.splitlines()
    assert up.returncode == 1, up.stdout + up.stderr
    assert lines[0] == (f"up.sh: nats node n2 exited (status 1) before it was ready; its log: "
                        f"{run_dir}/logs/n2.log"), up.stderr
    assert lines[1] == "  | simulated: n2 cannot open its store", up.stderr
    assert lines[-1].startswith("up.sh: stopped what it had started (n3 n1)"), up.stderr
    assert pids == {}, pids
    assert processes_naming(str(run_dir)) == []
    assert not any(listening(p) for first in ports.values() for p in range(first, first + 3))
