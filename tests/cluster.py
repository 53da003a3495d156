"""The deployment's real NATS configs run on this machine: deploy/nats-single.conf and the three
nodes of deploy/nats-cluster, their ports moved to free ones and their stores to a temporary
directory, with deploy/accounts.conf (its users and permissions) included as it is."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from improved.runtime import bus

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
ACCOUNTS = DEPLOY / "accounts.conf"
CLUSTER = [DEPLOY / "nats-cluster" / f"n{n}.conf" for n in (1, 2, 3)]

# The reference passwords of deploy/accounts.conf.
PASSWORDS = {
    "improved-admin": "dev-admin-pw",
    "improved-archivist": "dev-archivist-pw",
    "improved": "dev-improved-pw",
    "operator": "dev-operator-pw",
    "svc-ranking": "dev-ranking-pw",
    "svc-skills": "dev-skills-pw",
    "svc-knowledge": "dev-knowledge-pw",
    "svc-docs": "dev-docs-pw",
    "svc-deploy": "dev-deploy-pw",
    "rt-agent": "dev-rt-agent-pw",
}


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.2):
            return True
    except OSError:
        return False


def start_server(conf: Path, port: int, log: Path, timeout: float = 10.0) -> subprocess.Popen:
    with open(log, "ab") as out:
        proc = subprocess.Popen([bus.nats_server_binary(), "-c", str(conf)], stdout=out,
                                stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"nats-server exited {proc.returncode}: {log.read_text()}")
        if listening(port):
            return proc
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"nats-server did not listen on {port}: {log.read_text()}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def local_copy(conf: Path, dest: Path, ports: dict, store: Path) -> Path:
    """`conf` with its ports and store moved, next to a copy of accounts.conf."""
    text = conf.read_text()
    text = re.sub(r"^listen: \S+", f"listen: 127.0.0.1:{ports['client']}", text, flags=re.M)
    text = re.sub(r"^http: \S+", f"http: 127.0.0.1:{ports['http']}", text, flags=re.M)
    text = re.sub(r'store_dir: "[^"]*"', f'store_dir: "{store}"', text)
    text = re.sub(r"^include \S+", "include ./accounts.conf", text, flags=re.M)
    for old, new in ports.get("routes", {}).items():
        text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(ACCOUNTS, dest / "accounts.conf")
    out = dest / conf.name
    out.write_text(text)
    return out


class Cluster:
    """deploy/nats-cluster's three nodes on free ports, each node stopped and started again
    on its own port and store."""

    def __init__(self, base: Path):
        self.base = base
        self.client = {n: bus.free_port() for n in (1, 2, 3)}
        self.http = {n: bus.free_port() for n in (1, 2, 3)}
        routes = {6221 + n: bus.free_port() for n in (1, 2, 3)}
        self.confs: dict[int, Path] = {}
        for n, conf in zip((1, 2, 3), CLUSTER, strict=True):
            ports = {"client": self.client[n], "http": self.http[n], "routes": routes}
            self.confs[n] = local_copy(conf, base / f"n{n}", ports, base / f"n{n}" / "store")
        self.procs: dict[int, subprocess.Popen] = {}

    def url(self, n: int = 1, user: str | None = None) -> str:
        auth = f"{user}:{PASSWORDS[user]}@" if user else ""
        return f"nats://{auth}127.0.0.1:{self.client[n]}"

    def urls(self, user: str | None = None) -> str:
        return ",".join(self.url(n, user) for n in (1, 2, 3))

    def start(self, *nodes: int) -> None:
        for n in nodes or (1, 2, 3):
            self.procs[n] = start_server(self.confs[n], self.client[n],
                                         self.base / f"n{n}.log")

    def stop(self, *nodes: int) -> None:
        for n in nodes or tuple(self.procs):
            proc = self.procs.pop(n, None)
            if proc is not None:
                stop_server(proc)

    def healthy(self, n: int) -> bool:
        """The node is up and its JetStream is current with the meta leader."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http[n]}/healthz",
                                        timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.healthy(n) for n in self.procs):
            if time.monotonic() > deadline:
                raise AssertionError(f"cluster not healthy within {timeout}s")
            time.sleep(0.2)


# -- deploy/up.sh and down.sh, run as an operator runs them ---------------------------------

UP = DEPLOY / "up.sh"
DOWN = DEPLOY / "down.sh"
PORT_VARS = ("IMPROVED_CLUSTER_PORT", "IMPROVED_CLUSTER_ROUTE_PORT",
             "IMPROVED_CLUSTER_MONITOR_PORT")


def bindable(port: int) -> bool:
    """Free as nats-server binds it (a listener anywhere on the port makes it busy)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports_in_a_row(taken: set[int] | None = None, count: int = 3) -> int:
    """The first of `count` consecutive free ports, none in `taken`."""
    taken = taken or set()
    for _ in range(200):
        first = bus.free_port()
        run = range(first, first + count)
        if first + count <= 65535 and not taken & set(run) and all(map(bindable, run)):
            return first
    raise AssertionError(f"no {count} free ports in a row")


def script_ports() -> dict[str, int]:
    """Free first ports for up.sh's three kinds (client, route, monitoring), not overlapping."""
    chosen: dict[str, int] = {}
    taken: set[int] = set()
    for var in PORT_VARS:
        chosen[var] = free_ports_in_a_row(taken)
        taken |= set(range(chosen[var], chosen[var] + 3))
    return chosen


def script_env(home: Path, ports: Mapping[str, int | str], **extra: str) -> dict[str, str]:
    """The environment of up.sh and down.sh: the given ports, the run directory under
    `home`'s XDG_STATE_HOME (its default place), nothing of the caller's cluster settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in PORT_VARS and not k.startswith("IMPROVED_") and k != "WITH_RANKING"}
    env.update({k: str(v) for k, v in ports.items()})
    env["XDG_STATE_HOME"] = str(home / "state")
    env["HOME"] = str(home)
    env.update(extra)
    return env


def run_script(script: Path, env: dict[str, str], *args: str,
               timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(script), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=env["HOME"])


def processes_naming(text: str) -> list[str]:
    """Command lines of running processes that name `text` (a run directory)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(args)
    return found
