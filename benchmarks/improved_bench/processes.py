"""The processes a bench run starts and must end: the embedded nats-server (unless --nats), the
daemon replicas and the publisher, each logging under the run's one temporary directory.

Apart from the bench's drive because ending them is its own duty: on success, an error or a
Ctrl-C alike, nothing the run started outlives it, and the directory goes with them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal as signals
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nats.aio.client import Client

from improved.protocol import subjects as S
from improved.runtime import bus


def cpu_s(pid: int) -> float:
    """The CPU time (user and system) a process has used so far, in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class BenchProcesses:
    """The server, the daemons and the bench's own child processes of one run, and `tmp`,
    where they keep their data and logs."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="improved-bench-"))
        self.server: bus.EmbeddedServer | None = None
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.children: list[subprocess.Popen[bytes]] = []  # the publisher, while it runs
        self.config = self.tmp / "bench.toml"

    def start_server(self) -> str:
        if self.args.nats:
            url: str = self.args.nats
            return url
        self.server = bus.EmbeddedServer(self.tmp / "nats", bus.free_port(), sync=self.args.sync)
        return self.server.start()

    def start_daemons(self, url: str, replicas: int, operator: str, public: str) -> None:
        """`replicas` daemons on `url`, trusting `operator` by its base64 public key."""
        config = self.config
        config.write_text(f'records_storage = "{self.args.records}"\n'
                          f'replicas = {self.args.stream_replicas}\n'
                          f'data_dir = "{self.tmp / "daemon"}"\n\n'
                          f'[trust.operators]\n"{operator}" = "{public}"\n')
        env = {**os.environ, "IMPROVED_CONFIG": str(config)}
        for i in range(replicas):
            log = open(self.tmp / f"daemon-{i}.log", "ab")  # noqa: SIM115
            self.daemons.append(subprocess.Popen(
                [sys.executable, "-m", "improved.cli", "--log-level", "warning", "run",
                 "--nats", url, "--data-dir", str(self.tmp / "daemon")],
                stdout=log, stderr=log, env=env, stdin=subprocess.DEVNULL))

    async def wait_ready(self, nc: Client) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                await nc.request(S.SPEC_GET, b"{}", timeout=0.5)
                return
            except Exception:
                await asyncio.sleep(0.1)
        raise RuntimeError(f"the daemon did not come up; see {self.tmp}/daemon-*.log")

    def spawn(self, name: str, module: str, *argv: str) -> subprocess.Popen[bytes]:
        """A Python process of the bench's, logging to `<name>.log` in the temp directory."""
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115
        child = subprocess.Popen([sys.executable, "-m", module, *argv], stdout=log,
                                 stderr=log, stdin=subprocess.DEVNULL)
        self.children.append(child)
        return child

    def reap(self, child: subprocess.Popen[bytes]) -> None:
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if child in self.children:
            self.children.remove(child)

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by the daemons (together), the broker (when embedded) and
        this process (the publisher and the owning service)."""
        out = {"daemon": sum(cpu_s(d.pid) for d in self.daemons),
               "applier and clock": cpu_s(os.getpid())}
        if self.server is not None and self.server.proc is not None:
            out["broker"] = cpu_s(self.server.proc.pid)
        elif self.args.broker_pid:  # an external server's nodes, named by the caller
            out["broker"] = sum(cpu_s(pid) for pid in self.args.broker_pid)
        return out

    def stop(self) -> None:
        """Stop the daemons and the embedded server; a second call does nothing."""
        for child in self.children:
            if child.poll() is None:
                child.kill()
                child.wait()
        self.children = []
        daemons, self.daemons = self.daemons, []
        for d in daemons:
            if d.poll() is None:
                d.send_signal(signals.SIGTERM)
        for d in daemons:
            try:
                d.wait(30)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait()
        server, self.server = self.server, None
        if server is not None:
            server.stop()

    def cleanup(self) -> None:
        """Remove everything the run created under the temporary directory (after `stop`)."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def daemon_log_tail(self, lines: int = 20) -> str:
        """The end of each daemon's log, to show on a failure before the directory goes."""
        out = []
        for log in sorted(self.tmp.glob("daemon-*.log")):
            try:
                text = log.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(out)
