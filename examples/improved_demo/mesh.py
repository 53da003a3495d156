"""The demo's embedded mesh: a nats-server with JetStream, the daemon trusting fresh keys, the
five reference services seeded with what the walk changes, and the connection the agents, the
evaluator and the operator share.

Apart from the walk because starting and stopping are their own duty: each part on its own
connection, every start bounded, and `stop` ending everything, none of it allowed to raise.
"""

from __future__ import annotations

import asyncio
import base64
from contextlib import suppress
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.aio.client import Client

from improved.client import connection
from improved.client.config import ApplySettings, Config, Trust
from improved.client.sdk import MeshClient
from improved.core.signing import keyid_of, raw_public
from improved.protocol.model import to_json
from improved.runtime import bus
from improved.runtime.daemon import Daemon, run_until_stopped
from improved.runtime.store import Store
from improved_demo.cast import (
    ARTEFACTS,
    DUPLICATES,
    EVALUATOR,
    GUIDE,
    GUIDE_V1,
    NAMESPACE,
    OPERATOR,
    PRIOR,
    RANK_KEY,
    SERVICES,
)
from improved_demo.timeline import StepFailed, Timeline
from improved_reference.artefact_store import ArtefactStore
from improved_reference.doc_store import DocStore
from improved_reference.knowledge_store import KnowledgeStore
from improved_reference.ranking_store import RankingStore
from improved_reference.skills_store import SkillsStore

# As `improved run`: every write fsync'd before JetStream acknowledges it. "2m" (the server's
# own default) measured no faster for the few dozen trailers of the walk.
SYNC = "always"
CLEANUP_TIMEOUT = 10.0


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


class Mesh:
    """Every part the walk talks to, once `start`ed; `step_timeout` bounds the daemon's start
    and every request of the mesh's clients."""

    def __init__(self, timeline: Timeline, step_timeout: float):
        self.event = timeline.event  # its lines go on the demo's timeline
        self.step_timeout = step_timeout

    async def start(self, root: Path) -> None:
        """The whole mesh, each part on its own connection: the server, the daemon trusting
        the demo's keys, the reference services, and the agents' and operator's side."""
        url, port = self._start_server(root)
        self._trust(root, port)
        await self._start_daemon(url)
        await self._start_services(url)
        await self._connect_mesh(url)

    def _start_server(self, root: Path) -> tuple[str, int]:
        """The embedded nats-server; its URL and port."""
        port = bus.free_port()
        self.server = bus.EmbeddedServer(root, port, sync=SYNC)
        url = self.server.start()  # synchronous on purpose: a cancelled start leaves no orphan
        durable = ("every trailer fsync'd before it is acknowledged, as `improved run` does"
                   if SYNC == "always" else "the server's periodic fsync, faster, less durable")
        self.event("server", f"nats-server with JetStream on {url}, sync_interval {SYNC!r}: "
                   f"{durable}")
        self.event("store", f"data directory {root}")
        return url, port

    def _trust(self, root: Path, port: int) -> None:
        """Fresh keys for the operator, the evaluator and each service, and the daemon's
        configuration that trusts them."""
        key = Ed25519PrivateKey.generate()
        self.operator_key = key
        self.evaluator_key = Ed25519PrivateKey.generate()
        # each reference service signs its answers with a key of its own, so the daemon can
        # tell them from anyone else's on this open bus (its measurements among them)
        self.service_keys = {svc: Ed25519PrivateKey.generate() for svc in SERVICES}
        public = raw_public(key.public_key())
        signers = {EVALUATOR: b64(raw_public(self.evaluator_key.public_key()))}
        signers.update({f"service:{svc}": b64(raw_public(k.public_key()))
                        for svc, k in self.service_keys.items()})
        self.config = Config(
            data_dir=root, port=port, sync=SYNC,
            trust=Trust(operators={OPERATOR: b64(public)}, signers=signers),
            apply=ApplySettings(timeout_s=2.0, attempts=2, max_deliveries=3),
        )
        self.conns: list[Client] = []

    async def _start_daemon(self, url: str) -> None:
        """The daemon, in this process, until `stop`; StepFailed when it does not come up."""
        self.nc_daemon = await connection.connect(url, "improved-demo-daemon")
        self.conns.append(self.nc_daemon)
        self.stop_daemon = asyncio.Event()
        ready: asyncio.Future[Daemon] = asyncio.get_running_loop().create_future()

        def on_ready(daemon: Daemon) -> None:
            if not ready.done():
                ready.set_result(daemon)

        self.daemon_task = asyncio.create_task(run_until_stopped(
            self.nc_daemon, self.config, stop=self.stop_daemon, on_ready=on_ready),
            name="improved-demo-daemon")
        started: list[asyncio.Future[Daemon] | asyncio.Task[int]] = [ready, self.daemon_task]
        await asyncio.wait(started, timeout=self.step_timeout * 2,
                           return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            if self.daemon_task.done() and self.daemon_task.exception() is not None:
                raise StepFailed(f"the daemon did not start: {self.daemon_task.exception()}")
            raise StepFailed("the daemon did not become ready")
        self.daemon = ready.result()
        public = raw_public(self.operator_key.public_key())
        self.event("daemon", f"{self.daemon.actor} ready; trusts {OPERATOR} "
                   f"(fresh Ed25519 key {keyid_of(public)[:20]}...)")

    async def _start_services(self, url: str) -> None:
        """The reference services, each signing its answers, seeded with what the steps
        change."""
        self.nc_skills = await connection.connect(url, "demo-skills-store")
        self.conns.append(self.nc_skills)
        self.skills = SkillsStore(self.nc_skills, "skills")
        self.skills.use_key(self.service_keys["skills"])
        await self.skills.start()
        self.nc_search = await connection.connect(url, "demo-ranking-store")
        self.conns.append(self.nc_search)
        self.search = RankingStore(self.nc_search, "search")
        self.search.use_key(self.service_keys["search"])
        await self.search.start()
        values = await self.nc_search.jetstream().key_value(self.search.values_bucket)
        await values.put(RANK_KEY, to_json(PRIOR))
        self.nc_deploy = await connection.connect(url, "demo-artefact-store")
        self.conns.append(self.nc_deploy)
        self.deploy = ArtefactStore(self.nc_deploy, "deploy")
        self.deploy.use_key(self.service_keys["deploy"])
        await self.deploy.start()
        await self.deploy.seed(ARTEFACTS)
        self.nc_memory = await connection.connect(url, "demo-knowledge-doc-stores")
        self.conns.append(self.nc_memory)
        self.memory = KnowledgeStore(self.nc_memory, "memory")
        self.memory.use_key(self.service_keys["memory"])
        await self.memory.start()
        await self.memory.seed(NAMESPACE, DUPLICATES)
        self.docs = DocStore(self.nc_memory, "docs")
        self.docs.use_key(self.service_keys["docs"])
        await self.docs.start()
        await self.docs.put(GUIDE, GUIDE_V1)
        self.event("services", f"skills (reference skills store), search (reference ranking "
                   f"store, {RANK_KEY} = {PRIOR}), deploy (reference L4 artefact store, "
                   f"{', '.join(ARTEFACTS)} at their last-known-good), memory (reference "
                   f"knowledge store, 2 duplicate facts in {NAMESPACE}) and docs (reference doc "
                   f"store, {GUIDE}) serve <svc>.improve.apply")

    async def _connect_mesh(self, url: str) -> None:
        """The agents, the evaluator and the operator share one connection; so does the
        audit reader, which reads the chains straight from the stream, not from the daemon."""
        self.nc = await connection.connect(url, "demo-mesh")
        self.conns.append(self.nc)
        self.js = self.nc.jetstream()
        self.skills_client = MeshClient(self.nc, "skills", timeout=self.step_timeout)
        self.search_client = MeshClient(self.nc, "search", timeout=self.step_timeout)
        self.deploy_client = MeshClient(self.nc, "deploy", timeout=self.step_timeout)
        self.memory_client = MeshClient(self.nc, "memory", timeout=self.step_timeout)
        self.docs_client = MeshClient(self.nc, "docs", timeout=self.step_timeout)
        self.evaluator = MeshClient(self.nc, "evaluator", timeout=self.step_timeout)
        self.reader = Store(self.nc)

    async def stop(self) -> None:
        """Stop services, daemon, connections, server — each bounded, none allowed to raise."""
        for store in (getattr(self, "skills", None), getattr(self, "search", None),
                      getattr(self, "deploy", None), getattr(self, "memory", None),
                      getattr(self, "docs", None)):
            if store is not None:
                with suppress(Exception):
                    await asyncio.wait_for(store.stop(), CLEANUP_TIMEOUT)
        task = getattr(self, "daemon_task", None)
        if task is not None:
            self.stop_daemon.set()
            with suppress(BaseException):
                await asyncio.wait_for(task, CLEANUP_TIMEOUT * 2)
        for nc in getattr(self, "conns", ()):
            if not nc.is_closed:
                with suppress(BaseException):
                    await asyncio.wait_for(connection.close(nc), CLEANUP_TIMEOUT)
            if not nc.is_closed:
                with suppress(BaseException):
                    await nc.close()
        server = getattr(self, "server", None)
        if server is not None:
            with suppress(Exception):
                server.stop(timeout=CLEANUP_TIMEOUT)
