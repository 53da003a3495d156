"""Fixtures: a real nats-server with JetStream (session-scoped, free port, temporary store) and
an in-process daemon bound to it. Tests isolate themselves by service name."""

from __future__ import annotations

import asyncio
import base64
import itertools
import tempfile
import uuid
from pathlib import Path

import pytest
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.core import signing
from improved.runtime import bus
from improved.runtime.config import ApplySettings, Config, Trust
from improved.runtime.daemon import Daemon

# The session daemon trusts alice; mallory's key is not in its trust store.
ALICE = ("operator:alice", Ed25519PrivateKey.generate())
MALLORY = ("operator:mallory", Ed25519PrivateKey.generate())
# Quorum voters, trusted by `quorum_daemon` only.
VOTERS = {name: Ed25519PrivateKey.generate() for name in ("agent-a", "agent-b", "agent-c",
                                                          "agent-d")}



@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    """One nats-server for the session; `sync` left at the server default for speed (the
    embedded daemon server's `always` is exercised by the CLI tests)."""
    server = bus.EmbeddedServer(tmp_path_factory.mktemp("nats"), bus.free_port(), sync="2m")
    server.start()
    yield server
    server.stop()


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


_KEYS = Path(tempfile.mkdtemp(prefix="improved-test-keys-"))


def daemon_config(**overrides) -> Config:
    apply = overrides.pop("apply", ApplySettings(timeout_s=1.0, attempts=2, max_deliveries=3))
    public = base64.b64encode(signing.raw_public(ALICE[1].public_key())).decode()
    trust = overrides.pop("trust", Trust(operators={ALICE[0]: public}))
    # each daemon signs checkpoints with a key of its own, kept out of the work tree
    overrides.setdefault("checkpoint_key", _KEYS / f"checkpoint-{uuid.uuid4().hex[:8]}.pem")
    return Config(apply=apply, trust=trust, **overrides)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def daemon(nats_url):
    nc = await bus.connect(nats_url, "improved-test-daemon")
    d = Daemon(nc, daemon_config())
    await d.start()
    yield d
    await d.stop()
    await nc.drain()


@pytest_asyncio.fixture(loop_scope="session")
async def nc(nats_url):
    conn = await bus.connect(nats_url, "improved-test-client")
    yield conn
    await conn.drain()


_counter = itertools.count()


@pytest.fixture
def svc() -> str:
    """A service name no other test uses."""
    return f"t{next(_counter)}-{uuid.uuid4().hex[:8]}"


async def eventually(check, timeout: float = 10.0, interval: float = 0.05):
    """Await `check()` until it returns something truthy; fail with its last value."""
    deadline = asyncio.get_running_loop().time() + timeout
    last = None
    while asyncio.get_running_loop().time() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s (last: {last!r})")




@pytest_asyncio.fixture(loop_scope="session")
async def quorum_daemon(own_server):
    """A daemon of its own with `policy.quorum` on, trusting VOTERS' keys as quorum voters."""
    from msgspec.structs import replace

    nc = await bus.connect(own_server.url, "quorum")
    base = daemon_config()
    voters = {n: base64.b64encode(signing.raw_public(k.public_key())).decode()
              for n, k in VOTERS.items()}
    config = replace(
        base, policy=replace(base.policy, quorum=True),
        trust=Trust(operators=base.trust.operators, quorum=voters))
    daemon = Daemon(nc, config)
    await daemon.start()
    yield nc, daemon
    await daemon.stop()
    await bus.close(nc)
