"""A bus of a test's own, open or with deploy/accounts.conf's users, and a daemon on it.

The fixtures `mesh_bus` (both kinds: the test runs twice) and `accounts_bus` (accounts only),
in tests/conftest.py, give a `Mesh`: an embedded nats-server started as `improved run` starts
it — with `--accounts`, its data directory's own passwords (`improved.runtime.accounts`),
provisioned as `improved-admin`, and the daemon connected as `improved` with
`subjects_bound` on — and an in-process daemon (the test daemons' config, tests/bus.py).

An attack test is written once and run on both buses; it asks for `mesh_bus`, connects as the
user the attacker would have (on the open bus the same code connects with no credentials:
anyone may do anything there) and asserts what must hold on either bus, e.g.

    async def test_a_forged_record_moves_nothing(mesh_bus):
        attacker = await mesh_bus.connect("svc-ranking")
        await attacker.nc.publish(S.proposal_state("skills", pid), forged)
        if mesh_bus.accounts:  # refused by the server, named in its error
            await attacker.violation(S.proposal_state("skills", pid))
        ...  # and on both: nothing the daemon decides changed

`mesh_bus.daemon` is the Daemon, `mesh_bus.url` the server, `mesh_bus.target(user)` what
`connection.connect` and the CLI helpers take, `mesh_bus.env(user)` the IMPROVED_NATS_* variables for
a subprocess (empty on the open bus), `mesh_bus.violations(user)` the permissions violations
the server logged. Each `connect` is closed when the test ends.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
from nats.aio.client import Client

from improved.cli.provision import provisioned
from improved.client import connection, credentials
from improved.client.connection import NatsSettings
from improved.client.sdk import inbox_prefix
from improved.runtime import accounts, bus
from improved.runtime.daemon import Daemon
from tests.bus import daemon_config, eventually

MODES = ("open", "accounts")


@dataclass
class Participant:
    """A connection as one user, with the server's asynchronous errors it was told."""

    user: str
    nc: Client
    errors: list[str] = field(default_factory=list)

    def violations(self) -> list[str]:
        return [e for e in self.errors if "permissions violation" in e.lower()]

    async def violation(self, subject: str, timeout: float = 3.0) -> str:
        """The server's permissions violation naming `subject` (waited for; nats-py gives the
        server's text lowercased)."""

        async def seen() -> list[str]:
            return [v for v in self.violations() if f'"{subject.lower()}"' in v.lower()]

        return (await eventually(seen, timeout=timeout))[0]

    async def violation_like(self, pattern: str, timeout: float = 3.0) -> str:
        """The violation whose quoted subject matches `pattern` (a regex)."""

        async def seen() -> list[str]:
            return [v for v in self.violations()
                    if re.search(f'"{pattern}"', v, flags=re.IGNORECASE)]

        return (await eventually(seen, timeout=timeout))[0]


@dataclass
class Mesh:
    """A server and a daemon of a test's own; `accounts`: with deploy/accounts.conf's users."""

    mode: str
    data_dir: Path
    server: bus.EmbeddedServer
    daemon: Daemon = field(init=False)
    participants: list[Participant] = field(default_factory=list)

    @property
    def accounts(self) -> bool:
        return self.mode == "accounts"

    @property
    def url(self) -> str:
        return self.server.url

    def password_file(self, user: str) -> Path:
        return credentials.password_file(self.data_dir, user)

    def target(self, user: str) -> connection.Target:
        """The server as `user` (on the open bus: without credentials)."""
        if not self.accounts:
            return connection.target(self.url, NatsSettings())
        return connection.target(self.url, NatsSettings(user=user,
                                                        password_file=self.password_file(user)))

    def env(self, user: str) -> dict[str, str]:
        """The IMPROVED_NATS_* variables a subprocess connects as `user` with."""
        if not self.accounts:
            return {}
        return {"IMPROVED_NATS_USER": user,
                "IMPROVED_NATS_PASSWORD_FILE": str(self.password_file(user))}

    def violations(self, user: str | None = None) -> list[str]:
        """The permissions violations the server logged, of `user` only when given: an honest
        party (the daemon, a reference store) is expected to have none."""
        log = self.data_dir / "nats-server.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        return [line for line in lines if " Violation - " in line
                and (user is None or f'"MESH/user:{user}"' in line)]

    async def connect(self, user: str, prefix: str | None = None) -> Participant:
        """A connection as `user`, hearing replies on its own inboxes (or under `prefix`);
        closed when the test ends."""
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        options = dict(self.target(user).options)
        nc = await nats.connect(self.url, name=f"test-{user}", error_cb=on_error,
                                max_reconnect_attempts=1, connect_timeout=2,
                                inbox_prefix=prefix or inbox_prefix(user), **options)
        participant = Participant(user, nc, errors)
        self.participants.append(participant)
        return participant

    async def close(self) -> None:
        for participant in self.participants:
            if not participant.nc.is_closed:
                await participant.nc.close()


@asynccontextmanager
async def started(mode: str, base: Path) -> AsyncIterator[Mesh]:
    """A server under `base` and a daemon on it, as `improved run` (with `--accounts` when
    `mode` is "accounts") starts them; stopped at the end."""
    assert mode in MODES, mode
    data_dir = base / "improved"
    include = accounts.prepare(data_dir) if mode == "accounts" else ""
    server = bus.EmbeddedServer(data_dir, bus.free_port(), sync="2m", extra=include)
    server.start()
    config = daemon_config(data_dir=data_dir)
    mesh = Mesh(mode, data_dir, server)
    try:
        if mode == "accounts":
            await provisioned(mesh.target(credentials.ADMIN), config.replicas,
                              config.records_storage)
            config = msgspec.structs.replace(config, trust=msgspec.structs.replace(
                config.trust, subjects_bound=True))
        nc = await connection.connect(mesh.target(credentials.DAEMON), "improved-test-daemon")
        mesh.daemon = Daemon(nc, config)
        await mesh.daemon.start()
        try:
            yield mesh
        finally:
            await mesh.close()
            await mesh.daemon.stop()
            await connection.close(nc)
    finally:
        server.stop()
