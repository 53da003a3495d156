"""Fixtures for both suites: a real nats-server with JetStream (session-scoped, free port,
temporary store), a server of a test's own, an in-process daemon bound to the session server and
a quorum daemon. Only tests/integration asks for them; tests/unit needs none, so it starts no
server. Tests isolate themselves by service name. Shared helpers live beside this file:
builders (pure core data), keys, factories (wire messages), bus, cli, harness, tool_surfaces,
accounts (`mesh_bus` and `accounts_bus`: the open bus and deploy/accounts.conf's, side by
side)."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import uuid

import pytest
import pytest_asyncio

from improved.client import connection
from improved.runtime import bus
from improved.runtime.daemon import Daemon
from tests._hermetic import HERMETIC_ROOT
from tests.accounts import MODES, started
from tests.bus import amendment, daemon_config, quorum_config, whole_log_breaks


@pytest.fixture(scope="session", autouse=True)
def hermetic_environment():
    """Holds the environment `_hermetic` made for the whole session, and removes its
    directory at the end."""
    assert os.environ["HOME"].startswith(str(HERMETIC_ROOT))
    yield HERMETIC_ROOT
    shutil.rmtree(HERMETIC_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    """One nats-server for the session; `sync` left at the server default for speed (the
    embedded daemon server's `always` is exercised by the CLI tests). Every trailer the
    session's honest tests wrote must verify at the end — hashes, links, the test daemons'
    signature, every signed act — or the session fails: nothing honest may look forged."""
    server = bus.EmbeddedServer(tmp_path_factory.mktemp("nats"), bus.free_port(), sync="2m")
    url = server.start()
    yield server
    try:
        broken = asyncio.run(whole_log_breaks(url))
    finally:
        server.stop()
    assert not broken, f"the session's audit log does not verify: {broken[:3]}"


@pytest.fixture
def own_server(tmp_path):
    """A server of a test's own, for tests that run their own daemon or trip mesh-wide state
    (the breaker, a crisis) that would hold the session daemon's other tests back."""
    server = bus.EmbeddedServer(tmp_path / "nats", bus.free_port(), sync="2m")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def daemon(nats_url):
    nc = await connection.connect(nats_url, "improved-test-daemon")
    d = Daemon(nc, daemon_config())
    await d.start()
    yield d
    await d.stop()
    await nc.drain()


@pytest_asyncio.fixture(loop_scope="session")
async def nc(nats_url):
    conn = await connection.connect(nats_url, "improved-test-client")
    yield conn
    await conn.drain()


_counter = itertools.count()


@pytest.fixture
def svc() -> str:
    """A service name no other test uses."""
    return f"t{next(_counter)}-{uuid.uuid4().hex[:8]}"


@pytest_asyncio.fixture(loop_scope="session")
async def quorum_daemon(own_server):
    """A daemon of its own with `policy.quorum` on, trusting VOTERS' keys as quorum voters.
    The quorum is permitted as in production: by a constitution edit ALICE approved (proposed
    and approved through a daemon with the quorum off first)."""
    pid = await amendment(own_server.url)
    nc = await connection.connect(own_server.url, "quorum")
    daemon = Daemon(nc, quorum_config(pid))
    await daemon.start()
    yield nc, daemon
    await daemon.stop()
    await connection.close(nc)


@pytest_asyncio.fixture(loop_scope="session", params=MODES)
async def mesh_bus(request, tmp_path):
    """A server and daemon of the test's own, on the open bus and then with deploy/accounts.conf's
    users (`improved run --accounts`): the test runs once on each (tests/accounts.py says how
    to write one)."""
    async with started(request.param, tmp_path) as mesh:
        yield mesh


@pytest_asyncio.fixture(loop_scope="session")
async def accounts_bus(tmp_path):
    """`mesh_bus` with deploy/accounts.conf's users only."""
    async with started("accounts", tmp_path) as mesh:
        yield mesh


@pytest_asyncio.fixture(loop_scope="session")
async def skills_store(nc, svc):
    """The test's own reference skills store (service `svc`), its buckets removed after."""
    from improved_reference.skill_definitions import bucket_names
    from improved_reference.skills_store import SkillsStore

    store = SkillsStore(nc, svc)
    await store.start()
    yield store
    await store.stop()
    js = nc.jetstream()
    for bucket in bucket_names(svc):
        await js.delete_key_value(bucket)
