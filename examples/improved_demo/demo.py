"""`improved demo`: the whole loop, embedded and in-process, walked through for a newcomer.

One call starts everything: a `nats-server` with JetStream on a free port in a temporary
directory, the daemon (trusting a freshly generated key for `operator:demo`), the reference
skills store as service `skills`, the reference ranking store as service `search`, the
knowledge store as `memory`, the doc store as `docs` and the artefact store as `deploy`. Then
it walks the loop step by step — L1 surfaces, L2 waits for a signed approval, a grant makes L3
automatic for exactly one content hash, feedback collapse, a forbidden target, a rollback, a
CAL batch and a doc edit undone by their stores' inverses, an L4 swap — and ends by verifying
every audit chain. Each event is one line of a plain-text timeline.

Every wait is bounded: a state that does not arrive prints a FAILED line and the walk goes on;
`run` returns 1 if any step failed. Everything is stopped and the temporary directory removed
afterwards, on failure and on Ctrl-C too. With `--data-dir` the store is kept, so the same
mesh can be inspected later with `improved run --data-dir DIR` and the operator commands.

While the demo runs, the daemon's and the services' logs (structlog) go to `improved.log` in the
data directory instead of the terminal, so they do not interleave with the timeline.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, Literal, TextIO, TypeVar

import msgspec
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.aio.client import Client

from improved.client import connection
from improved.client.config import ApplySettings, Config, Trust
from improved.client.sdk import MeshClient
from improved.core import audit, authority
from improved.core.breaker import AUTONOMY_ID, from_trailer
from improved.core.signing import PAYLOAD_TYPES, keyid_of, raw_public, sign
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import (
    AnalyzerRef,
    ApplyOutcome,
    GrantCommand,
    MetricSnapshot,
    Origin,
    Proposal,
    ProposalEdit,
    ProposalState,
    Review,
    Signal,
    Summary,
    TriageDecision,
    to_json,
)
from improved.runtime import bus
from improved.runtime.daemon import Daemon, run_until_stopped
from improved.runtime.store import Store
from improved_reference import diffs
from improved_reference.artefact_store import ArtefactStore, digest_of
from improved_reference.doc_store import DocStore
from improved_reference.doc_store import digest as doc_digest
from improved_reference.knowledge_store import KnowledgeStore
from improved_reference.kv_service import KVService
from improved_reference.ranking_store import RankingStore
from improved_reference.skills_store import SkillsStore

T = TypeVar("T")

# As `improved run`: every write fsync'd before JetStream acknowledges it. "2m" (the server's
# own default) measured no faster for the few dozen trailers of the walk.
SYNC = "always"
STEP_TIMEOUT = 5.0  # how long one expected state may take to arrive
STEP_BUDGET = 30.0  # a whole step, whatever happens inside it
SETTLE = 0.3  # how long to watch for something that must NOT happen (an apply order)
CLEANUP_TIMEOUT = 10.0
DEFAULT_PACE = 0.4

OPERATOR = "operator:demo"
AGENT = "mcp:agent-7f3a:1"  # proposes the skill (an MCP runtime session, call 1)
TUNER = "mcp:tuner-51c0:1"  # proposes the ranking change
TUNER_AGAIN = "mcp:tuner-51c0:2"  # the same session, a later call: not independent
SERVICES = ("skills", "search", "deploy", "memory", "docs")  # the reference services it runs
EVALUATOR = "agent:evaluator:run-0042"  # an agent of another service, by its key: independent
SKILL = {
    "name": "summarize",
    "description": "Summarise a text in three bullet points",
    "instructions": "Read the text. Write three bullet points, most important first.",
}
EXTRA_SENTENCE = " Keep each bullet under twenty words."
RANK_KEY = "search.title_boost"
SNIPPET_KEY = "search.snippet_weight"  # set by the learn-back step, then rolled back
DEPLOYER = "agentd:release-9c1e:1"  # proposes the L4 binary swap
ARTEFACTS = {"app": '{"release": 1}', "config": '{"workers": 4}'}
PRIOR, NEW = 1.0, 1.5
FORBIDDEN = "notes/../_spec/2026-04-20-00-constitution.md"
CURATOR = "mcp:curator-2b7d:1"  # proposes the CAL batch and the doc edit
NAMESPACE = "agent:recommendations"
DUPLICATES = "\n".join(  # what an extractor wrote twice: the OMS seed's example, small
    f'ADD fact SET subject = "user:john-smith" SET relation = "preferred_activity" '
    f'SET object = "{obj}" REASON "extracted from a chat"' for obj in ("morning run", "running"))
MERGE = ('SUPERSEDE facts WHERE subject = "user:john-smith" AND relation = "preferred_activity" '
         'SET object = "morning_run_5k" REASON "merge 2 duplicate extractions"')
GUIDE = "docs/guide.md"
GUIDE_V1 = "# Guide\n\nRun the demo.\n"
GUIDE_V2 = "# Guide\n\nRun `improved demo`: the whole loop in ten seconds.\n"


def orders_schema(qty_maximum: int) -> str:
    """The JSON Schema of an order whose `qty` is at most `qty_maximum` (the seed: 100)."""
    return msgspec.json.encode({
        "type": "object", "required": ["sku"], "additionalProperties": False,
        "properties": {"sku": {"type": "string"},
                       "qty": {"type": "integer", "maximum": qty_maximum}}}).decode()


class StepFailed(Exception):
    """A step did not see what the loop promises; the text says what was missing."""


def short(pid: str) -> str:
    return pid[:12]


def short_identity(identity: str) -> str:
    name, _, sha = identity.partition(":")
    return f"{name}:{sha[:12]}"


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


class Demo:
    """The walk: the timeline it prints, the mesh it starts, and the steps."""

    def __init__(self, out: TextIO, pace: float):
        self.out = out
        self.pace = max(0.0, pace)
        self.color = bool(getattr(out, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self.failures: list[str] = []
        self._last_ms = 0
        self.ids: dict[str, str] = {}  # what the newcomer may want to `improved show`

    # -- the timeline --------------------------------------------------------------------------

    def _paint(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.color else text

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def event(self, label: str, text: str) -> None:
        elapsed = time.monotonic() - self.t0
        self.say(f"  {elapsed:6.2f}s  {label:<9} {text}")

    def ok(self, text: str) -> None:
        self.event("ok", self._paint(text, "32"))

    def failed(self, text: str) -> None:
        self.failures.append(text)
        self.event("FAILED", self._paint(text, "1;31"))

    def header(self, n: int, title: str, sentence: str) -> None:
        self.say()
        self.say(self._paint(f"Step {n}. {title}", "1"))
        self.say(f"  {sentence}")

    def expect(self, condition: bool, what: str) -> None:
        if not condition:
            raise StepFailed(what)

    async def wait(self, what: str, check: Callable[[], Awaitable[T | None]],
                   timeout: float | None = None) -> T:
        """Poll `check()` until it returns something truthy; StepFailed after `timeout`
        (default STEP_TIMEOUT)."""
        timeout = STEP_TIMEOUT if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last: T | Exception | None = None
        while True:
            try:
                last = await check()
            except Exception as exc:  # a transient read error is just "not yet"
                last = exc
            if last and not isinstance(last, Exception):
                return last
            if loop.time() >= deadline:
                seen = f" (last seen: {last!r})" if last not in (None, False) else ""
                raise StepFailed(f"{what} did not arrive within {timeout:g}s{seen}")
            await asyncio.sleep(0.05)

    def now_ms(self) -> int:
        """Strictly increasing creation times: supersession orders proposals by them."""
        self._last_ms = max(int(time.time() * 1000), self._last_ms + 1)
        return self._last_ms

    # -- the mesh ------------------------------------------------------------------------------

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
        await asyncio.wait(started, timeout=STEP_TIMEOUT * 2,
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
        self.skills_client = MeshClient(self.nc, "skills", timeout=STEP_TIMEOUT)
        self.search_client = MeshClient(self.nc, "search", timeout=STEP_TIMEOUT)
        self.deploy_client = MeshClient(self.nc, "deploy", timeout=STEP_TIMEOUT)
        self.memory_client = MeshClient(self.nc, "memory", timeout=STEP_TIMEOUT)
        self.docs_client = MeshClient(self.nc, "docs", timeout=STEP_TIMEOUT)
        self.evaluator = MeshClient(self.nc, "evaluator", timeout=STEP_TIMEOUT)
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

    # -- building blocks -----------------------------------------------------------------------

    def skill_proposal(self, change_class: str, skill: dict[str, Any] | None = None,
                       **over: Any) -> Proposal:
        fields: dict[str, Any] = dict(
            service="skills", target_ref="skill:summarize", change_class=change_class,
            scope="knowledge", origin=Origin(actor=AGENT, service="skills"),
            analyzer=AnalyzerRef(id="acme.skills/1"),
            summary=Summary(template_id="new_skill", args={"name": "summarize"}),
            proposal_data={"skill": dict(skill or SKILL)}, created_at=self.now_ms(),
        )
        fields.update(over)
        return Proposal(**fields)

    def rank_proposal(self, change_class: str, key: str, value: Any, **over: Any) -> Proposal:
        fields: dict[str, Any] = dict(
            service="search", target_ref=f"rank:{key}", change_class=change_class,
            scope="knowledge", origin=Origin(actor=TUNER, service="search"),
            analyzer=AnalyzerRef(id="acme.tuner/1"),
            summary=Summary(template_id="adjust_rank", args={"item": key, "delta": value}),
            proposal_data={"set": {"key": key, "value": value}}, created_at=self.now_ms(),
        )
        fields.update(over)
        return Proposal(**fields)

    async def propose(self, client: MeshClient, proposal: Proposal) -> str:
        reply = await client.propose(proposal)
        self.event("propose", f"{proposal.change_class} {proposal.target_ref} by "
                   f"{proposal.origin.actor} -> {short(reply.proposal_id)}, {reply.status}")
        return reply.proposal_id

    async def decision(self, client: MeshClient, pid: str) -> TriageDecision:
        """The retained TriageDecision record, as any late joiner would read it."""
        d = await self.wait(f"the triage decision of {short(pid)}",
                            lambda: client.decision(pid))
        cause = f" {d.cause}" if d.cause else ""
        self.event("triage", f"{d.verdict}/{d.gate_class}{cause}: {d.rationale}")
        return d

    async def status(self, client: MeshClient, pid: str, status: str) -> None:
        async def reached() -> ProposalState | None:
            state = await client.state(pid)
            return state if state is not None and state.status == status else None

        await self.wait(f"status {status} of {short(pid)}", reached)

    async def chain(self, svc: str, pid: str) -> list[dict[str, Any]]:
        return [body for _, body in await self.reader.read_chain(svc, pid)]

    async def signed(self, subject: str, kind: str, body: Any) -> None:
        """Sign an act with the demo operator's key and publish it into the inbound stream."""
        env = sign(PAYLOAD_TYPES[kind], to_json(body), self.operator_key)
        await self.js.publish(subject, to_json(env))

    async def review(self, svc: str, pid: str, verdict: Literal["approve", "reject", "rollback"],
                     reason: str,
                     body_digest: str | None = None) -> None:
        await self.signed(S.inbound_review(svc), "review", Review(
            proposal_id=pid, verdict=verdict, principal=OPERATOR, reason=reason,
            at=int(time.time() * 1000), body_digest=body_digest))
        self.event("operator", f"{OPERATOR} signs {verdict!r} of {short(pid)} "
                   f"(DSSE, Ed25519) -> {S.inbound_review(svc)}")

    async def why_not(self, subject: str, failure: StepFailed) -> StepFailed:
        """`failure`, with the daemon's reason when it refused the act (the chain says)."""
        with suppress(Exception):
            chain = await self.reader.read_chain_at(subject)
            last = chain[-1][1] if chain else {}
            if last.get("verdict") == "refused":
                return StepFailed(f"{failure}; the daemon refused the act: {last.get('reason')}")
        return failure

    async def no_orders(self, store: KVService[Any], before: int, svc: str) -> None:
        await asyncio.sleep(SETTLE)
        self.expect(store.orders == before,
                    f"{svc} received {store.orders - before} apply order(s); expected none")

    # -- the steps -----------------------------------------------------------------------------

    async def step_l1(self) -> None:
        before = self.skills.orders
        pid = await self.propose(self.skills_client, self.skill_proposal("L1"))
        self.ids["l1"] = pid
        d = await self.decision(self.skills_client, pid)
        self.expect((d.verdict, d.gate_class) == ("accept", "L1"),
                    f"expected accept/L1, got {d.verdict}/{d.gate_class}")
        await self.no_orders(self.skills, before, "the skills store")
        state = await self.skills_client.state(pid)
        self.expect(state is not None and state.status == "pending",
                    f"expected status pending, got {state and state.status}")
        self.ok("accept/L1: surfaced for review, status pending; the skills store got no order")

    async def step_l2(self) -> None:
        before = self.skills.orders
        pid = await self.propose(self.skills_client, self.skill_proposal("L2"))
        self.ids["l2"] = pid
        d = await self.decision(self.skills_client, pid)
        self.expect((d.verdict, d.cause, d.gate_class) == ("defer", "awaiting_operator", "L2"),
                    f"expected defer awaiting_operator/L2, got {d.verdict} {d.cause}/"
                    f"{d.gate_class}")
        l1 = self.ids.get("l1")
        if l1:
            async def superseded() -> list[dict[str, Any]] | None:
                chain = await self.chain("skills", l1)
                return chain if chain and chain[-1].get("verdict") == "superseded" else None

            await self.wait(f"the supersession of {short(l1)}", superseded)
            self.event("supersede", f"{short(l1)} (the L1) is superseded by {short(pid)}: same "
                       "dedup_key, newer content")
        self.event("waiting", f"{short(pid)} is pending, awaiting_operator; nothing is applied")
        await self.no_orders(self.skills, before, "the skills store")
        await self.review("skills", pid, "approve", "first execution looks right")
        try:
            outcome = await self.wait(f"the apply outcome of {short(pid)}",
                                      lambda: self.skills_client.outcome(pid))
        except StepFailed as exc:
            raise await self.why_not(S.audit("skills", pid), exc) from None
        self.expect(outcome.ok, f"the apply failed: {outcome.error}")
        self.event("apply", f"skills stored {short_identity(outcome.applied_id)}, authority "
                   f"{outcome.authority}, inverse {to_json(outcome.inverse).decode()}")
        await self.status(self.skills_client, pid, "applied")
        self.expect(outcome.authority == OPERATOR,
                    f"expected authority {OPERATOR}, got {outcome.authority}")
        await asyncio.sleep(SETTLE)
        self.expect(self.skills.orders == before + 1,
                    f"the skills store got {self.skills.orders - before} orders; expected 1")
        self.ok(f"approved by {OPERATOR} and applied once (1 order), status applied")

    async def step_grant(self) -> None:
        identity = canonical.skill_identity(SKILL)
        self.identity = identity
        name, sha = identity.split(":")
        self.event("identity", f"canonical.skill_identity(definition) = {identity}")
        await self.signed(S.GRANTS, "grant", GrantCommand(
            op="grant", skill=identity, principal=OPERATOR, reason="trusted after review",
            at=int(time.time() * 1000), proposal_id=self.ids["l2"]))
        self.event("operator", f"{OPERATOR} signs a grant for {short_identity(identity)}, "
                   f"naming {short(self.ids['l2'])} (its approved L2) -> {S.GRANTS}")
        try:
            await self.wait(f"an active grant for {short_identity(identity)}",
                            lambda: self.skills.check_grant_active(identity))
        except StepFailed as exc:
            raise await self.why_not(S.grant_audit(sha), exc) from None
        self.event("grant", f"active, retained on {S.grant_record(name, sha[:12])}...; the "
                   "skills store sees it too")
        self.ok(f"grant summarize:<sha256> recorded for exactly {short_identity(identity)}")

    async def step_l3(self) -> None:
        before, writes = self.skills.orders, self.skills.applies
        pid = await self.propose(self.skills_client, self.skill_proposal("L3"))
        self.ids["l3"] = pid
        d = await self.decision(self.skills_client, pid)
        self.expect((d.verdict, d.gate_class) == ("accept", "L3"),
                    f"expected accept/L3, got {d.verdict} {d.cause}/{d.gate_class}")
        outcome = await self.wait(f"the apply outcome of {short(pid)}",
                                  lambda: self.skills_client.outcome(pid))
        self.expect(outcome.ok, f"the apply failed: {outcome.error}")
        chain = await self.chain("skills", pid)
        applied = [t for t in chain if t.get("to_stage") == "apply"]
        observer = applied[-1]["observer_type"] if applied else None
        how = ("already stored under its hash: adopted, not written twice"
               if self.skills.applies == writes else "written")
        self.event("apply", f"skills applied {short_identity(outcome.applied_id)} ({how}), "
                   f"observer {observer}, authority {outcome.authority}")
        self.expect(observer == "rec:policy", f"expected observer rec:policy, got {observer}")
        self.expect(outcome.authority == "policy:auto",
                    f"expected authority policy:auto, got {outcome.authority}")
        await self.status(self.skills_client, pid, "applied")
        self.expect(self.skills.orders == before + 1,
                    f"the skills store got {self.skills.orders - before} orders; expected 1")
        self.ok("no operator involved: rec:policy auto-applied it under policy:auto")

    async def step_refine(self) -> None:
        before = self.skills.orders
        refined = await self.skills.refine(
            self.identity, {"instructions": SKILL["instructions"] + EXTRA_SENTENCE},
            service="skills", origin_actor=AGENT, analyzer_id="acme.skills/1",
            created_at=self.now_ms())
        proposal = msgspec.structs.replace(refined, change_class="L3")  # it asks for L3
        if proposal.proposal_data is None:
            raise StepFailed("the refinement carries no definition")
        new_identity = canonical.skill_identity(proposal.proposal_data["skill"])
        self.event("refine", f"instructions + {EXTRA_SENTENCE.strip()!r} -> "
                   f"{short_identity(new_identity)} (granted: {short_identity(self.identity)})")
        pid = await self.propose(self.skills_client, proposal)
        self.ids["refined"] = pid
        d = await self.decision(self.skills_client, pid)
        self.expect((d.verdict, d.cause, d.gate_class) == ("defer", "no_grant", "L2"),
                    f"expected defer no_grant/L2, got {d.verdict} {d.cause}/{d.gate_class}")
        await self.no_orders(self.skills, before, "the skills store")
        self.ok("a new hash has no grant: gated as L2 (no_grant), waiting for an operator")

    async def step_collapse(self) -> None:
        before = self.search.orders
        self_signal = Signal(kind="refine", actor=TUNER_AGAIN, service="search", positive=True,
                             at=int(time.time() * 1000))
        proposal = self.rank_proposal("L0", RANK_KEY, NEW, signals=[self_signal])
        self.event("evidence", f"its only positive signal comes from {TUNER_AGAIN}, the "
                   f"proposer's own session ({TUNER.rsplit(':', 1)[0]})")
        pid = await self.propose(self.search_client, proposal)
        self.ids["rank"] = pid
        d = await self.decision(self.search_client, pid)
        self.expect((d.verdict, d.cause) == ("defer", "feedback_collapse"),
                    f"expected defer feedback_collapse, got {d.verdict} {d.cause}")
        await self.no_orders(self.search, before, "the ranking store")
        claim = await self.evaluator.refine(Signal(
            kind="check", actor="operator:alice", service="billing", positive=True,
            at=int(time.time() * 1000), proposal_id=pid), service="search")
        self.event("signal", "an unsigned positive check claiming operator:alice of billing: "
                   f"counted={claim.counted}, independent={claim.independent} (no verified "
                   "identity: a string anyone can write)")
        self.expect(claim.counted and not claim.independent,
                    "an unsigned claim was counted as independent")
        await self.no_orders(self.search, before, "the ranking store")
        reply = await self.evaluator.refine(Signal(
            kind="check", actor=EVALUATOR, service="evaluator", positive=True,
            at=int(time.time() * 1000), proposal_id=pid), key=self.evaluator_key)
        self.event("signal", f"{EVALUATOR} signs a positive check with the key the trust store "
                   f"binds to it: counted={reply.counted}, independent={reply.independent}")
        self.expect(reply.counted and reply.independent,
                    "the evaluator's signal was not counted as independent")
        await self.status(self.search_client, pid, "applied")
        outcome = await self.search_client.outcome(pid)
        if outcome is None or not outcome.ok:
            raise StepFailed("no successful apply outcome")
        value = await self.search.value(RANK_KEY)
        self.event("apply", f"search set {RANK_KEY} {PRIOR} -> {value}, authority "
                   f"{outcome.authority}, inverse {to_json(outcome.inverse).decode()}")
        self.expect(value == NEW, f"expected {RANK_KEY} = {NEW}, found {value!r}")
        self.ok("feedback_collapse held it until a verified independent signal; then applied")

    async def step_forbidden(self) -> None:
        before = self.search.orders
        for cls, note in (("L0", "would auto-apply"), ("L4", "an operator could approve")):
            proposal = self.rank_proposal(cls, "search.freshness", 0.7, target_files=[
                "ranking/freshness.toml", FORBIDDEN])
            self.event("sneak", f"an {cls} change ({note}) lists target_files {FORBIDDEN!r}")
            pid = await self.propose(self.search_client, proposal)
            self.ids[f"forbidden-{cls}"] = pid
            d = await self.decision(self.search_client, pid)
            self.expect((d.verdict, d.cause) == ("reject", "forbidden_target"),
                        f"expected reject forbidden_target, got {d.verdict} {d.cause}")
            await self.status(self.search_client, pid, "rejected")
        await self.no_orders(self.search, before, "the ranking store")
        self.ok("rejected forbidden_target at L0 and at L4: the path is normalised first")

    async def step_rollback(self) -> None:
        pid = self.ids.get("rank")
        if pid is None:
            raise StepFailed("no ranking change from step 6 to roll back")
        await self.review("search", pid, "rollback", "title boost hurt click-through")
        try:
            await self.status(self.search_client, pid, "rolled_back")
        except StepFailed as exc:
            raise await self.why_not(S.audit("search", pid), exc) from None
        chain = await self.chain("search", pid)
        # the rollback asked, its order's dispatch recorded (by the daemon), the outcome
        tail = ", ".join("dispatched" if t.get("verdict") == "dispatched"
                         else f"{t.get('verdict')} by {t.get('actor')}" for t in chain[-3:])
        self.event("rollback", f"{short(pid)}: {tail}")
        value = await self.search.value(RANK_KEY)
        self.event("value", f"{RANK_KEY} is {value} again (it was {NEW})")
        self.expect(value == PRIOR, f"expected {RANK_KEY} back at {PRIOR}, found {value!r}")
        _, body = await self.reader.chain_head(S.autonomy_audit(AUTONOMY_ID))
        counted = len(from_trailer(body).rollbacks)
        p = self.config.policy
        self.event("breaker", f"{counted} rollback of an autonomous apply on the autonomy chain; "
                   f"{p.breaker_threshold} within {p.breaker_window_days:g} days pause autonomy "
                   f"for {p.breaker_pause_hours:g} h")
        self.expect(counted >= 1, "the autonomous rollback was not counted for the breaker")
        self.ok("rolled_back: the recorded inverse restored the prior value")

    async def step_remeasure(self) -> None:
        metric_key, baseline, worse = "metrics.ctr", 0.31, 0.22
        values = await self.nc_search.jetstream().key_value(self.search.values_bucket)
        await values.put(metric_key, to_json(baseline))
        due = self.now_ms() + 800
        proposal = self.rank_proposal("L0", SNIPPET_KEY, 0.8, metric_snapshot=MetricSnapshot(
            metric="ctr", baseline=baseline, query=metric_key, review_after=due))
        pid = await self.propose(self.search_client, proposal)
        await self.status(self.search_client, pid, "applied")
        self.event("snapshot", f"ctr was {baseline} at the proposal; the owning service is asked "
                   f"again at review_after (+0.8 s) on search.improve.measure")
        await values.put(metric_key, to_json(worse))
        self.event("world", f"meanwhile click-through fell to {worse}")
        try:
            await self.status(self.search_client, pid, "rolled_back")
        except StepFailed as exc:
            raise await self.why_not(S.audit("search", pid), exc) from None
        chain = await self.chain("search", pid)
        verdict = next((t for t in chain if t.get("verdict") in ("held", "regressed",
                                                                 "unmeasured")), None)
        self.expect(verdict is not None and verdict["verdict"] == "regressed",
                    f"expected a regressed measurement, found {verdict and verdict['verdict']}")
        refs = dict(r.split(":", 1) for r in (verdict or {}).get("refs", []) if ":" in r)
        self.event("measured", f"{short(pid)} measured by {refs.get('measured_by', '?')}: "
                   f"value {refs.get('value', '?')} against baseline {refs.get('baseline', '?')} "
                   f"-> regressed; rollback proposal "
                   f"{short(refs.get('rollback_proposal', '?'))}")
        value = await self.search.value(SNIPPET_KEY)
        self.expect(value is None, f"expected {SNIPPET_KEY} removed again, found {value!r}")
        self.event("value", f"{SNIPPET_KEY} is unset again: the recorded inverse was applied")
        self.ok("re-measured at review_after, regressed, rolled back by its recorded inverse")

    def knowledge_proposal(self, service: str, target: str, template: str,
                           **body: Any) -> Proposal:
        return Proposal(
            service=service, target_ref=target, change_class="L2", scope="knowledge",
            origin=Origin(actor=CURATOR, service=service),
            analyzer=AnalyzerRef(id="curator.duplicate_sweep/1"),
            summary=Summary(template_id=template, args={"target": target}),
            created_at=self.now_ms(), **body)

    async def approved_and_undone(self, client: MeshClient, pid: str, show: Callable[[], Any],
                                  what: str, inverse: Callable[[Any], str]) -> Any:
        """Approve `pid`, wait for its outcome, show the change, then roll it back by the
        inverse the service returned; the outcome."""
        svc = client.service
        await self.decision(client, pid)
        await self.review(svc, pid, "approve", f"the {what} looks right")
        try:
            out = await self.wait(f"the apply outcome of {short(pid)}",
                                  lambda: client.outcome(pid))
        except StepFailed as exc:
            raise await self.why_not(S.audit(svc, pid), exc) from None
        self.expect(out.ok and out.rollbackable, f"the apply failed or is not rollbackable: "
                    f"{out.error}")
        self.event("apply", f"{svc}: {await show()}; authority {out.authority}")
        self.event("inverse", inverse(out.inverse))
        await self.review(svc, pid, "rollback", f"undo the {what}")
        try:
            await self.status(client, pid, "rolled_back")
        except StepFailed as exc:
            raise await self.why_not(S.audit(svc, pid), exc) from None
        self.event("rollback", f"{svc}: {await show()}")
        return out

    async def step_knowledge(self) -> None:
        async def facts() -> str:
            live = await self.memory.recall(NAMESPACE)
            return f"{len(live)} live fact(s): " + ", ".join(
                sorted(repr(g["object"]) for g in live.values()))

        self.event("memory", f"{NAMESPACE}: {await facts()}")
        pid = await self.propose(self.memory_client, self.knowledge_proposal(
            "memory", "entity:fitness/user:john-smith", "merge_duplicate_facts",
            proposal_cal=MERGE, namespace=NAMESPACE))

        def plan(inverse: Any) -> str:
            [step] = inverse["cal_inverse"]
            return (f"supersede {step['target'][:19]}… and reinstate "
                    + ", ".join(a[:19] + "…" for a in step["restore_from"])
                    + ": the grains the batch really wrote, so a rollback can replay it")

        out = await self.approved_and_undone(self.memory_client, pid, facts, "merge", plan)
        [step] = out.inverse["cal_inverse"]
        live = await self.memory.recall(NAMESPACE)
        self.expect(sorted(live) == sorted(step["restore_from"]),
                    f"expected the 2 duplicates back, found {sorted(live)}")
        pid = await self.propose(self.docs_client, self.knowledge_proposal(
            "docs", f"doc:{GUIDE}", "edit_doc", proposal_edit=ProposalEdit(
                format="unified", base_digest=doc_digest(GUIDE_V1),
                diff=diffs.make(GUIDE_V1, GUIDE_V2, GUIDE))))

        async def guide() -> str:
            text = await self.docs.document(GUIDE) or ""
            return f"{GUIDE} line 3 reads {text.splitlines()[2]!r}"

        def reverse(inverse: Any) -> str:
            edit = inverse["edit"]
            return (f"the reverse diff on base {edit['base_digest'][:19]}… (the new head): a "
                    "later edit would make it refused, never applied over")

        await self.approved_and_undone(self.docs_client, pid, guide, "edit", reverse)
        self.expect(await self.docs.document(GUIDE) == GUIDE_V1, f"{GUIDE} is not back")
        self.ok("a CAL batch and a doc edit applied under the operator's approval, each undone "
                "by the inverse its store returned")

    def swap_proposal(self, new: dict[str, str]) -> Proposal:
        return Proposal(
            service="deploy", target_ref="binary:deploy", change_class="L4", scope="operation",
            origin=Origin(actor=DEPLOYER, service="deploy"),
            analyzer=AnalyzerRef(id="acme.release/1"),
            summary=Summary(template_id="swap_binary", args={"n": len(new)}),
            proposal_data={"artefacts": new},
            lkg=[{"artefact": name, "digest": "sha256:" + canonical.sha256_hex(text.encode()),
                  "smoke_test": "json"} for name, text in new.items()],
            created_at=self.now_ms())

    async def outcome(self, client: MeshClient, pid: str) -> ApplyOutcome:
        return await self.wait(f"the apply outcome of {short(pid)}", lambda: client.outcome(pid))

    async def step_l4(self) -> None:
        before = await self.deploy.manifest()
        bad = await self.propose(self.deploy_client, self.swap_proposal(
            {"app": '{"release": 2}', "config": "{ not json"}))
        await self.decision(self.deploy_client, bad)
        await self.review("deploy", bad, "approve", "release 2")
        out = await self.outcome(self.deploy_client, bad)
        self.event("apply", f"ok={out.ok}: {out.error}")
        self.expect(not out.ok and await self.deploy.manifest() == before,
                    "a swap with a failing artefact changed something")
        self.event("lkg", "app and config both still at their last-known-good: all or none")

        good = await self.propose(self.deploy_client, self.swap_proposal(
            {"app": '{"release": 2}', "config": '{"workers": 8}'}))
        await self.decision(self.deploy_client, good)
        await self.review("deploy", good, "approve", "release 2, fixed")
        out = await self.outcome(self.deploy_client, good)
        self.expect(out.ok, f"the healthy swap failed: {out.error}")
        chain = await self.chain("deploy", good)
        verdicts = [t.get("verdict") for t in chain]
        self.expect(verdicts.index("lkg_verified") < verdicts.index("applied"),
                    "the reversal was not recorded before the apply")
        # the reversal travels on the chain (the `revert:` ref of the lkg_verified trailer)
        checked = chain[verdicts.index("lkg_verified")]
        reversal = next(r[len("revert:"):] for r in checked["refs"] if r.startswith("revert:"))
        rid = out.revert_proposal_id
        if rid is None:
            raise StepFailed("the healthy swap's outcome names no revert_proposal_id")
        self.event("apply", f"{out.applied_id}; reversal recorded before the apply: "
                   f"revert_proposal_id {short(rid)}")
        await self.deploy_client.publish(msgspec.json.decode(reversal))
        rev = await self.outcome(self.deploy_client, rid)
        self.expect(rev.ok and rev.authority == OPERATOR,
                    f"the reversal did not run under {OPERATOR}: {rev.error or rev.authority}")
        await self.status(self.deploy_client, good, "rolled_back")
        self.expect(await self.deploy.manifest() == before, "the reversal left a new version")
        self.event("revert", f"{short(rid)} inherited the approval of "
                   f"{OPERATOR}: no second signature; both artefacts back")
        self.ok("L4: unhealthy swap refused whole; healthy swap applied, then reverted through "
                "its revert_proposal_id without a second approval")

    def schema_proposal(self, qty_maximum: int, revert: bool = True) -> Proposal:
        """`orders` with `qty` bounded by `qty_maximum`, and the revert to the seeded schema."""
        new = orders_schema(qty_maximum)
        return Proposal(
            service="deploy", target_ref="schema:deploy", change_class="L4", scope="operation",
            origin=Origin(actor=DEPLOYER, service="deploy"),
            analyzer=AnalyzerRef(id="acme.release/1"),
            summary=Summary(template_id="schema_change", args={"artefact": "orders"}),
            proposal_data={"artefacts": {"orders": new}},
            lkg=[{"artefact": "orders", "digest": digest_of(new.encode()),
                  "smoke_test": "json_schema"}],
            revert={"restore": {"orders": digest_of(orders_schema(100).encode())}} if revert else None,
            created_at=self.now_ms())

    async def step_schema(self) -> None:
        await self.deploy.seed({"orders": orders_schema(100)})
        bare = await self.propose(self.deploy_client, self.schema_proposal(1000, revert=False))
        d = await self.decision(self.deploy_client, bare)
        self.expect(d.verdict == "reject" and "schema_revert" in d.rationale,
                    "a schema change without its revert was not rejected")
        for maximum, ok in ((10, False), (1000, True)):
            p = self.schema_proposal(maximum)
            pid = await self.propose(self.deploy_client, p)
            await self.decision(self.deploy_client, pid)
            await self.review("deploy", pid, "approve", f"qty up to {maximum}",
                              authority.will_run_digest(p))
            out = await self.outcome(self.deploy_client, pid)
            self.event("apply", f"ok={out.ok}: {out.error or out.applied_id}")
            self.expect(out.ok == ok and (ok or (out.error or "").startswith("schema_backward")),
                        f"qty maximum {maximum}: expected ok={ok}, got {out.error}")
        self.ok("schema: no revert, rejected; a change that only takes away, refused though "
                "approved; a forward-compatible one, applied")

    async def step_audit(self) -> None:
        chains = await self.reader.all_chains()
        trailers = sum(len(bodies) for bodies in chains.values())
        kinds = {"proposal": 0, "grant": 0, "autonomy": 0, "other": 0}
        first_break = None
        for (svc, cid), bodies in sorted(chains.items()):
            kind = ("grant" if svc == S.GRANT_CHAINS else
                    "autonomy" if svc == S.AUTONOMY_CHAIN else
                    "other" if svc in S.MESH_CHAINS else "proposal")
            kinds[kind] += 1
            brk = audit.verify_chain(cid, bodies)
            if brk is not None and first_break is None:
                first_break = brk
        self.event("read", f"{len(chains)} chains from IMPROVE_AUDIT: {kinds['proposal']} "
                   f"proposals, {kinds['grant']} grant, {kinds['autonomy']} autonomy, "
                   f"{kinds['other']} checkpoint and policy")
        self.expect(first_break is None, f"first break: {first_break}")
        self.expect(len(chains) > 0, "no chains at all")
        self.ok(f"{len(chains)} chains, {trailers} trailers: all verified")

    STEPS: tuple[tuple[str, str, str], ...] = (
        ("step_l1", "L1: a skill is proposed, never applied",
         "An L1 proposal only surfaces an idea: it is recorded and shown to operators, and "
         "nothing is ever sent to a service."),
        ("step_l2", "L2: first execution waits for a signed approval",
         "A skill's first execution needs an operator: the proposal waits until a DSSE "
         "envelope signed by a trusted key approves it, and then runs under that principal."),
        ("step_grant", "Grant: trust exactly this content",
         "A grant binds <name>:<sha256> of the skill's definition, so the operator trusts this "
         "exact text, not the name."),
        ("step_l3", "L3: re-execution under the grant applies by itself",
         "The same content proposed at L3 finds its grant and is applied by the policy "
         "(rec:policy) without asking anyone."),
        ("step_refine", "A refinement is new content: back to L2",
         "One added sentence makes a new hash, which no grant covers, so the proposal waits "
         "for an operator again (no_grant)."),
        ("step_collapse", "Feedback collapse: no grading your own homework",
         "An L0 ranking change would apply automatically, but not while every positive signal "
         "comes from the proposer's own session; an independent evaluator releases it."),
        ("step_forbidden", "Forbidden targets: whatever the class",
         "The constitution's forbidden list is checked first, on normalised paths, so "
         "`notes/../` cannot smuggle it in."),
        ("step_rollback", "Undo: the operator rolls the ranking change back",
         "Every apply recorded the inverse the service returned; a signed rollback applies it "
         "and counts toward the circuit breaker."),
        ("step_remeasure", "Learn-back: measured again, regressed, rolled back",
         "A change carries the metric as it was and when to look again; at review_after the "
         "daemon asks the owning service to measure, and a regression proposes the inverse "
         "recorded at the apply."),
        ("step_knowledge", "OMS knowledge: a CAL batch and a doc edit, applied and undone",
         "A curator merges duplicate facts with a CAL batch and edits a guide with a diff; "
         "each store applies it under the approver's capability, in its namespace or on the "
         "doc's current head, and returns an inverse the rollback replays."),
        ("step_l4", "L4: last-known-good, all or none, and a reversal made in advance",
         "A binary swap lists its artefacts with digests and smoke tests; the owning service "
         "swaps all of them or none, and the reversal is recorded before the apply, so undoing "
         "it needs no second signature."),
        ("step_schema", "Schema changes: forward applies, backward is refused",
         "The owning service classifies a JSON Schema change against the schema it holds; a "
         "change carries the revert to that schema or is rejected."),
        ("step_audit", "The audit chains",
         "Every transition left a hash-chained trailer; re-deriving every hash and link needs "
         "nothing but the stream's contents."),
    )

    async def walk(self) -> None:
        for n, (method, title, sentence) in enumerate(self.STEPS, 1):
            if n > 1 and self.pace:
                await asyncio.sleep(self.pace)
            self.header(n, title, sentence)
            try:
                await asyncio.wait_for(getattr(self, method)(), STEP_BUDGET)
            except StepFailed as exc:
                self.failed(str(exc))
            except TimeoutError:
                self.failed(f"the step did not finish within {STEP_BUDGET:g}s")
            except Exception as exc:
                self.failed(f"{type(exc).__name__}: {exc}")

    def epilogue(self, kept: Path | None) -> None:
        self.say()
        if self.failures:
            self.say(self._paint(f"RESULT: {len(self.failures)} check(s) FAILED", "1;31"))
        else:
            self.say(self._paint("RESULT: every step behaved as the loop promises", "1;32"))
        self.say()
        self.say("Try it yourself:")
        rows: list[tuple[str, str]] = []
        if kept is not None:
            rows.append((f"improved run --data-dir {kept}", "serve this mesh again (port 4222)"))
        else:
            rows.append(("improved demo --data-dir DIR", "keep the mesh's store this time"))
            rows.append(("improved run --data-dir DIR", "serve it again (port 4222)"))
        rows.append(("improved review", "the queue waiting for an operator"))
        example = self.ids.get("refined") if kept is not None else None
        rows.append((f"improved show {example or 'ID'}",
                     "the refinement that waits (no_grant)" if example else
                     "state, decision, outcome, trailers"))
        rows.append(("improved audit verify", "re-derive every hash and link"))
        width = max(len(cmd) for cmd, _ in rows if len(cmd) < 64)
        for cmd, why in rows:
            if len(cmd) > width:
                self.say(f"  {cmd}")
                self.say(f"  {'':<{width}}  # {why}")
            else:
                self.say(f"  {cmd:<{width}}  # {why}")


def _prepare(data_dir: Path | None) -> Path | str:
    """The directory to run in: a new temporary one, or `data_dir` if it is new or empty (the
    walk needs a fresh mesh: an old grant, rollback or breaker would change what it shows);
    otherwise the reason it cannot be used."""
    if data_dir is None:
        return Path(tempfile.mkdtemp(prefix="improved-demo-"))
    root = Path(data_dir).expanduser().resolve()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        return (f"{root} is not an empty directory; the demo needs a fresh mesh (give a new "
                "or empty --data-dir)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {root}: {exc}"
    return root


def _log_to(path: Path) -> Callable[[], None]:
    """Send structlog output to `path` while the demo runs; returns the undo."""
    old = structlog.get_config()
    fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by the undo
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=fh),
        cache_logger_on_first_use=False,
    )

    def undo() -> None:
        structlog.configure(**old)
        fh.close()

    return undo


def _log_tail(path: Path, n: int = 5) -> list[str]:
    """The last warnings and errors of the demo's log, to explain a failure."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    worse = [line for line in lines if '"level": "warning"' in line
             or '"level": "error"' in line or '"level":"warning"' in line
             or '"level":"error"' in line]
    return [line[:300] for line in worse[-n:]]


async def run(out: TextIO, *, data_dir: Path | None = None, pace: float = 0.0) -> int:
    """Walk the loop on an embedded mesh; 0 when every step behaved as promised and every
    audit chain verified, 1 otherwise."""
    demo = Demo(out, pace)
    keep = data_dir is not None
    root = _prepare(data_dir)
    if isinstance(root, str):
        demo.say(f"improved demo: {root}")
        return 1
    log_path = root / "improved.log"
    undo_logging = _log_to(log_path)
    demo.say(demo._paint("improved demo: the self-improve loop, end to end, in one process",
                         "1"))
    demo.say("  Everything below runs embedded: a nats-server, the daemon and three reference "
             "services (a skills store, a ranking store, an artefact store).")
    try:
        try:
            await demo.start(root)
        except Exception as exc:
            demo.failed(f"could not start the mesh: {type(exc).__name__}: {exc}")
        else:
            await demo.walk()
        if demo.failures:
            tail = _log_tail(log_path)
            if tail:
                demo.say()
                demo.say("Last warnings in the daemon's log:")
                for line in tail:
                    demo.say(f"  {line}")
        demo.epilogue(root if keep else None)
        if keep:
            demo.say(f"  (logs of this run: {log_path})")
    finally:
        await demo.stop()
        undo_logging()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return 1 if demo.failures else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="improved demo",
        description="Walk through the self-improve loop on an embedded mesh in about ten "
                    "seconds: a nats-server, the daemon and three reference services start "
                    "in-process; a skill goes L1 -> L2 (signed approval) -> grant -> L3 "
                    "(automatic), a refinement is gated again, a ranking change meets the "
                    "feedback-collapse guard, a forbidden target is rejected, an operator rolls "
                    "back, an L4 swap is refused whole, then applied and reverted, and every "
                    "audit chain is verified. Exit 0 when every step behaved as promised.")
    p.add_argument("--pace", type=float, default=DEFAULT_PACE, metavar="SECONDS",
                   help="pause between steps (default %(default)s)")
    p.add_argument("--data-dir", type=Path, metavar="DIR",
                   help="keep the mesh's store in DIR (new or empty) instead of a temporary "
                        "directory that is removed afterwards")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.pace < 0:
        parser().error("--pace must not be negative")
    try:
        return asyncio.run(run(sys.stdout, data_dir=args.data_dir, pace=args.pace))
    except KeyboardInterrupt:
        print("\nimproved demo: interrupted; everything it started was stopped",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
