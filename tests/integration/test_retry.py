"""A late service is served: an apply that gave up after its delivery budget is retried on a slow
backoff by the daemon itself, writing nothing on the chain while nothing serves the apply, and
`improved retry` resumes one at once and says the outcome."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest

from improved.client import connection
from improved.client.config import ApplySettings
from improved.client.sdk import MeshClient
from improved.protocol.model import ApplyResult
from improved.runtime.daemon import Daemon
from improved.runtime.store import Store
from improved.testing import rank_proposal, skill_proposal
from tests.bus import daemon_config, eventually
from tests.cli import improved

pytestmark = pytest.mark.asyncio(loop_scope="session")


def cli(*args: str):
    return asyncio.to_thread(improved, *args)


class Late:
    """The owning service, started late: applies each proposal id once."""

    def __init__(self) -> None:
        self.applied: list[str] = []

    async def __call__(self, order) -> ApplyResult:
        if order.proposal_id not in self.applied:
            self.applied.append(order.proposal_id)
        return ApplyResult(ok=True, applied_id=order.proposal_id)


@asynccontextmanager
async def gives_up_fast(url: str, tmp_path, retry_max_s: float):
    """A daemon of its own that gives an unreachable apply two deliveries, then retries it
    slowly (at most every `retry_max_s`); yields a client connection."""
    conn = await connection.connect(url, "retry-daemon")
    daemon = Daemon(conn, daemon_config(
        data_dir=tmp_path / "data",
        apply=ApplySettings(timeout_s=0.3, attempts=1, max_deliveries=2,
                            retry_max_s=retry_max_s)))
    await daemon.start()
    nc = await connection.connect(url, "retry-client")
    try:
        yield nc
    finally:
        await nc.drain()
        await daemon.stop()
        await conn.drain()


async def _gave_up(client: MeshClient, pid: str) -> None:
    async def unreachable():
        out = await client.outcome(pid)
        return out if out is not None and (out.error or "").startswith("unreachable") else None

    await eventually(unreachable, timeout=20)


async def test_a_service_that_starts_after_the_daemon_gave_up_is_served(own_server, tmp_path):
    async with gives_up_fast(own_server.url, tmp_path, retry_max_s=0.5) as nc:
        client = MeshClient(nc, "latesvc")
        pid = (await client.propose(rank_proposal("latesvc"))).proposal_id
        await _gave_up(client, pid)
        store = Store(nc)
        before = len(await store.read_chain("latesvc", pid))
        await asyncio.sleep(1.5)  # several slow retries while nothing serves the apply
        assert len(await store.read_chain("latesvc", pid)) == before  # nothing written
        assert (await client.state(pid)).status == "pending"

        late = Late()
        sub = await client.serve_apply(late)  # nobody types anything

        async def applied():
            out = await client.outcome(pid)
            return out if out is not None and out.ok else None

        assert (await eventually(applied, timeout=15)).applied_id == pid
        assert late.applied == [pid] and (await client.state(pid)).status == "applied"
        await sub.unsubscribe()


async def test_improved_retry_resumes_one_at_once(own_server, tmp_path):
    async with gives_up_fast(own_server.url, tmp_path, retry_max_s=3600.0) as nc:
        client = MeshClient(nc, "retrysvc")
        pid = (await client.propose(rank_proposal("retrysvc"))).proposal_id
        await _gave_up(client, pid)
        still = await cli("retry", pid[:12], "--nats", own_server.url)
        assert still.returncode == 1 and len(still.stderr.splitlines()) == 1, still.stderr
        assert f"improved retry: refused: no service took {pid}" in still.stderr

        late = Late()
        sub = await client.serve_apply(late)
        done = await cli("retry", pid[:12], "--nats", own_server.url)
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"accepted: {pid} applied by its service\n"
        assert late.applied == [pid]
        again = await cli("retry", pid, "--nats", own_server.url)
        assert again.returncode == 0 and "applied already: nothing to retry" in again.stdout
        await sub.unsubscribe()

        waiting = (await client.propose(skill_proposal("retrysvc"))).proposal_id
        early = await cli("retry", waiting, "--nats", own_server.url)
        assert early.returncode == 1 and "nothing to retry" in early.stderr
        assert "improved approve|reject" in early.stderr
