"""The deployment's real NATS configs run on this machine: deploy/nats-single.conf and the three
nodes of deploy/nats-cluster, their ports moved to free ones and their stores to a temporary
directory, with deploy/accounts.conf (its users and permissions) included as it is."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
import urllib.request
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
