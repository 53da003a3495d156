"""Where a command or a service of this machine connects, and as whom, when nothing names its
credentials: on the server running in a data directory with accounts (`improved run
--accounts`), the user's own password file there (`<data_dir>/accounts/<user>.pw`), sent to
that server only (its lock and ports file say where), never to a server named by anything
else (`target`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

from improved.client.connection import NatsSettings, Target, nats_from_env, split_credentials
from improved.client.connection import target as target_of

DIR = "accounts"  # under the data directory: the users' password files (mode 0700)
LOCK = "nats-server.lock"  # the embedded server's lock in its data directory: its pid
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}

# the users the commands connect as (deploy/accounts.conf says what each may do)
ADMIN = "improved-admin"  # provisioning: the streams, buckets and inbound consumer
DAEMON = "improved"
OPERATOR = "operator"
ARCHIVIST = "improved-archivist"


class AccountsError(ValueError):
    """A data directory's credentials cannot be used as they are: one line saying why."""


def directory(data_dir: Path) -> Path:
    return Path(data_dir) / DIR


def password_file(data_dir: Path, user: str) -> Path:
    return directory(data_dir) / f"{user}.pw"


# -- the server running in a data directory ---------------------------------------------------


@dataclass(frozen=True)
class Running:
    """The embedded nats-server running in a data directory: its pid and where it listens."""

    pid: int
    url: str


def running_in(data_dir: Path) -> Running | None:
    """The server holding the data directory's lock, when it runs and says where it listens
    (`<binary>_<pid>.ports`, which it writes once it does)."""
    data_dir = Path(data_dir)
    try:
        pid = int((data_dir / LOCK).read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    for ports in data_dir.glob(f"*_{pid}.ports"):
        try:
            urls = json.loads(ports.read_text()).get("nats") or []
        except (OSError, ValueError, AttributeError):
            continue
        if urls and isinstance(urls[0], str):
            return Running(pid, urls[0])
    return None


def _address(url: str) -> tuple[str, int]:
    parsed = urlsplit(url if "://" in url else f"nats://{url}")
    host = parsed.hostname or ""
    return ("127.0.0.1" if host in _LOOPBACK else host), parsed.port or 4222


def target(url: str | None, data_dir: Path, user: str, settings: NatsSettings | None = None,
           default: str = "nats://127.0.0.1:4222") -> Target:
    """Where a command or a service of this machine connects, and as whom: `url`, else the
    server running in `data_dir`, else `default`; with the credentials `settings` (else the
    environment, IMPROVED_NATS_*) or the URL name — or, when they name none and the server is
    the one running in `data_dir` with accounts, as `user`, with its password file there."""
    server = running_in(data_dir)
    where = url or (server.url if server is not None else default)
    if settings is None:
        settings = nats_from_env()
    servers, in_url = split_credentials(where)
    if (server is not None and not settings.credentials() and not in_url
            and directory(data_dir).exists()
            and _address(server.url) in {_address(s) for s in servers}):
        path = password_file(data_dir, user)
        if not path.exists():
            svc = user.removeprefix("svc-")
            raise AccountsError(
                f"the server of {data_dir} runs with accounts and has no user {user}"
                + (f": give it one with `improved accounts add-service {svc}`"
                   if user != svc else ""))
        settings = msgspec.structs.replace(settings, user=user, password_file=path)
    return target_of(where, settings)
