"""The embedded server's users and permissions under `improved run --accounts`: those of
deploy/accounts.conf, each user with a password of its data directory's own.

deploy/accounts.conf is the one source. The package's `accounts.conf` is a link to it, and the
embedded server is given that text with each reference password (`password: "dev-…"`)
replaced, so the two cannot differ in a user or a permission. What is secret lives in
`<data_dir>/accounts/` (mode 0700): `<user>.pw`, a random password per user, made once and
reused by every restart (0600); `nats.conf`, the block the server's configuration includes
(0600); and `services`, the services `improved accounts add-service` gave a user of their own.
No password is printed or logged.

A command or a reference store finds its user's file there by itself
(`improved.client.credentials.target`) and sends it to the server running in that data
directory only (its lock and ports file say where), never to a server named by anything else.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import stat
import time
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

from improved.client.credentials import DIR, AccountsError, directory, password_file, running_in
from improved.protocol import subjects as S

SERVER_BLOCK = "nats.conf"
SERVICES = "services"
# the line of <data_dir>/nats-server.conf that takes the block in (relative to that file)
INCLUDE = f'include "{DIR}/{SERVER_BLOCK}"\n'

LIKE = "ranking"  # a service given a user here gets svc-ranking's permissions, for its name

_ENTRY = re.compile(r'(?P<head>\buser:\s*(?P<user>[A-Za-z0-9_.-]+)\s*,?\s*password:\s*)'
                    r'"[^"]*"')
_PASSWORD = re.compile(r"[\x21-\x7e]{16,256}")  # printable, no space: safe in a quoted string
_USERS_LIST = re.compile(r"^[ \t]*users:[ \t]*\[[ \t]*\n", re.M)  # the line, with its end


# -- the text: pure ---------------------------------------------------------------------------


def template() -> str:
    """deploy/accounts.conf, as the package carries it."""
    return (resources.files("improved.runtime") / "accounts.conf").read_text(encoding="utf-8")


def users(text: str) -> list[str]:
    """The users of an accounts configuration that log in with a password, in its order."""
    return [m["user"] for m in _ENTRY.finditer(text)]


def with_passwords(text: str, passwords: Mapping[str, str]) -> str:
    """`text` with each user's password replaced by `passwords[user]`; nothing else changed."""
    return _ENTRY.sub(lambda m: f'{m["head"]}"{passwords[m["user"]]}"', text)


def service_user(text: str, service: str) -> str:
    """The entry of svc-ranking in `text`, made `service`'s: its own subjects, inbox and the
    ranking store's buckets (`rank_<svc>`, `applies_<svc>`, `-` made `_`), its comments left
    out. What accounts.conf tells an administrator to do by hand for a new service."""
    at = text.index(f"user: svc-{LIKE}\n")
    start = text.rindex("{", 0, at)
    depth, lines = 0, []
    for line in text[start:].splitlines():
        code = line.split("#", 1)[0].rstrip()  # no string in accounts.conf holds a '#'
        depth += code.count("{") - code.count("}")
        if code.strip():
            lines.append(code)
        if depth == 0:
            break
    entry = "\n".join(lines)
    entry = re.sub(rf"(?<=_){LIKE}(?![A-Za-z0-9])", service.replace("-", "_"), entry)
    return re.sub(rf"(?<![A-Za-z0-9_]){LIKE}(?![A-Za-z0-9])", service, entry) + "\n"


def with_services(text: str, services: list[str]) -> str:
    """`text` with a user for each of `services` (`service_user`), first in MESH's list."""
    if not services:
        return text
    found = _USERS_LIST.search(text)
    assert found is not None, "accounts.conf lists no users"
    added = "".join(service_user(text, svc) for svc in services)
    return text[:found.end()] + added + text[found.end():]


def server_block(text: str, passwords: Mapping[str, str]) -> str:
    return ("# Written by `improved run --accounts` from deploy/accounts.conf: its users and\n"
            "# permissions, with this data directory's own passwords (accounts/<user>.pw).\n"
            "# Rewritten at every start: change deploy/accounts.conf, not this file.\n\n"
            + with_passwords(text, passwords))


# -- the files --------------------------------------------------------------------------------


def added(data_dir: Path) -> list[str]:
    """The services `add_service` gave a user in this data directory."""
    try:
        text = (directory(data_dir) / SERVICES).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


def prepare(data_dir: Path) -> str:
    """Make what is missing of this data directory's credentials (a password per user of
    deploy/accounts.conf and of the added services), check what is there, and write the
    server's block; return the line that includes it in the server's configuration."""
    private = private_dir(directory(data_dir))
    text = with_services(template(), added(data_dir))
    passwords = {user: password_in(private / f"{user}.pw") for user in users(text)}
    write_private(private / SERVER_BLOCK, server_block(text, passwords))
    return INCLUDE


def add_service(data_dir: Path, service: str) -> tuple[Path, bool]:
    """Give `service` a user `svc-<service>` in this data directory (svc-ranking's
    permissions for its name), its server's block rewritten; (its password file, whether the
    user is new). A user that exists already is left as it is."""
    if not S.SERVICE_RE.match(service):
        raise AccountsError(f"service name {service!r} must match {S.SERVICE_RE.pattern}")
    user = f"svc-{service}"
    new = user not in users(with_services(template(), added(data_dir)))
    if new:
        private = private_dir(directory(data_dir))
        fd = os.open(private / SERVICES, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as fh:
            fh.write(service + "\n")
    prepare(data_dir)
    return password_file(data_dir, user), new


def mode_in(data_dir: Path) -> str | None:
    """How the data directory's loop was run: "accounts" (its credentials are there),
    "open" (its streams are in the server's global account), or None (neither yet)."""
    if directory(data_dir).exists():
        return "accounts"
    streams = Path(data_dir) / "jetstream" / "jetstream" / "$G" / "streams"
    if streams.is_dir() and any(streams.iterdir()):
        return "open"
    return None


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _owner_only(path, "700")
    return path


def _owner_only(path: Path, mode: str) -> None:
    """AccountsError unless `path` is out of reach of group and others."""
    st = path.stat()
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise AccountsError(f"{path} is open to others (mode {stat.S_IMODE(st.st_mode):04o}): "
                            f"`chmod {mode} {path}`, or remove it to make a new one")


def password_in(path: Path) -> str:
    """The password in `path`, made (random, 0600) when there is none."""
    made = secrets.token_urlsafe(24)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        _owner_only(path, "600")
        found = path.read_text(encoding="utf-8").strip()
        if not _PASSWORD.fullmatch(found):
            raise AccountsError(f"{path} holds no password (16 to 256 printable characters, "
                                "no space): remove it to make a new one") from None
        return found
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(made + "\n")
    return made


def write_private(path: Path, text: str) -> None:
    """Replace `path` by `text` atomically, readable by its owner only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def reload(data_dir: Path, timeout: float = 5.0) -> bool:
    """Have the server running in the data directory read its configuration again (SIGHUP),
    and wait until its log says it did; False when none runs there."""
    server = running_in(data_dir)
    if server is None:
        return False
    log = Path(data_dir) / "nats-server.log"
    seen = log.stat().st_size if log.exists() else 0
    os.kill(server.pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(log, "rb") as fh:
                fh.seek(seen)
                new = fh.read().decode(errors="replace")
        except FileNotFoundError:
            new = ""
        if "Reloaded server configuration" in new:
            return True
        failed = [line for line in new.splitlines() if "[ERR]" in line or "[FTL]" in line]
        if failed:
            raise AccountsError(f"the server of {data_dir} did not reload: {failed[0]}")
        time.sleep(0.05)
    raise AccountsError(f"the server of {data_dir} did not say it reloaded within "
                        f"{timeout:g}s; see {log}")
