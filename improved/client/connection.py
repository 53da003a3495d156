"""Connecting to NATS as a mesh service, the daemon or a command does: where (the servers, safe
to print) and as whom (`[nats]`, or the IMPROVED_NATS_* environment: a password, token or
.creds file and TLS files, read once at start), and the connection itself, which names no
credential in any log line or error.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import typing
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import msgspec
import nats
import structlog
from nats.aio.client import Client, RawCredentials

from improved.client import sdk
from improved.core.policy import Text

log = structlog.get_logger("improved.bus")

DEFAULT_INBOX = "_INBOX"  # nats-py's own, for a connection that names no user


class BusError(RuntimeError):
    """NATS cannot be reached, or refused the connection: one line naming the servers, never a
    credential."""


class ConfigError(ValueError):
    """A setting cannot be used as given (the config file, the environment, a credential file
    it names): one line naming the key, e.g. `config error: nats.password_file: …`."""


class NatsSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How the daemon, the CLI and a service authenticate to NATS (`[nats]`), each key also
    given by an environment variable (NATS_ENV, which wins over the file). Secrets live in
    files, read at start: never in the URL, the config file or a log line."""

    user: Text | None = None  # with password_file
    password_file: Path | None = None  # the password, alone in the file
    token_file: Path | None = None  # an authorization token, alone in the file
    creds_file: Path | None = None  # a NATS `.creds` file (user JWT and nkey seed)
    tls_cert: Path | None = None  # a client certificate (PEM), with tls_key
    tls_key: Path | None = None
    tls_ca: Path | None = None  # the CA that signed the servers' certificates (PEM)

    def credentials(self) -> list[str]:
        """The credential options set, by key name."""
        return [k for k in ("user", "password_file", "token_file", "creds_file")
                if getattr(self, k) is not None]


# `[nats]` keys given by the environment, which wins over the file
NATS_ENV = {
    "user": "IMPROVED_NATS_USER",
    "password_file": "IMPROVED_NATS_PASSWORD_FILE",
    "token_file": "IMPROVED_NATS_TOKEN_FILE",
    "creds_file": "IMPROVED_NATS_CREDS_FILE",
    "tls_cert": "IMPROVED_NATS_TLS_CERT",
    "tls_key": "IMPROVED_NATS_TLS_KEY",
    "tls_ca": "IMPROVED_NATS_TLS_CA",
}


def nats_from_env(settings: NatsSettings | None = None,
                  environ: typing.Mapping[str, str] | None = None) -> NatsSettings:
    """`settings` (else none) with the `[nats]` keys the environment sets (NATS_ENV) in place
    of theirs; ConfigError naming the variable when its value is not one."""
    environ = os.environ if environ is None else environ
    settings = NatsSettings() if settings is None else settings
    given = {key: environ[var] for key, var in NATS_ENV.items() if environ.get(var)}
    if not given:
        return settings
    settings = msgspec.structs.replace(settings, **{
        key: value if key == "user" else Path(value) for key, value in given.items()})
    check_nats(settings, env=True)
    return settings


def nats_key(key: str, env: bool = False) -> str:
    """How a `[nats]` key is named in an error: `nats.password_file`, or with its variable."""
    var = NATS_ENV[key]
    return f"nats.{key} ({var})" if env or os.environ.get(var) else f"nats.{key}"


def check_nats(settings: NatsSettings, env: bool = False) -> None:
    """One credential at most, and each with what it needs."""
    given = settings.credentials()
    if settings.user is not None and settings.password_file is None:
        raise ConfigError(f"config error: {nats_key('user', env)}: needs "
                          f"{nats_key('password_file', env)} (the password, in a file)")
    if settings.password_file is not None and settings.user is None:
        raise ConfigError(f"config error: {nats_key('password_file', env)}: needs "
                          f"{nats_key('user', env)}")
    kinds = {"password" if k in ("user", "password_file") else k for k in given}
    if len(kinds) > 1:
        raise ConfigError(f"config error: {nats_key(given[-1], env)}: one credential only "
                          "(user and password_file, token_file or creds_file), got "
                          + ", ".join(f"nats.{k}" for k in given))
    if (settings.tls_cert is None) != (settings.tls_key is None):
        have, need = (("tls_cert", "tls_key") if settings.tls_key is None
                      else ("tls_key", "tls_cert"))
        raise ConfigError(f"config error: {nats_key(have, env)}: needs {nats_key(need, env)}")


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
        settings = nats_from_env()
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


async def drain_all(subs: list[Any]) -> None:
    """Drain every subscription in `subs` (each finishes the message in hand); one whose
    connection is already closed is logged and passed over, so a stop always ends."""
    for sub in subs:
        try:
            await sub.drain()
        except Exception as exc:  # already closed with the connection
            log.debug("subscription drain failed", error=str(exc))


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
