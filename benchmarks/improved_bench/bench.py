"""`improved bench`: the loop measured against the broker's own limit, in one run.

It starts an embedded nats-server (or uses --nats), starts daemon processes and the owning
service in process — by default the project's persisting reference stores (RankingStore for the
`rank:` L0 proposals, SkillsStore for the `skill:` L2/L3 ones, both in JetStream KV, each order
applied exactly once through its ledger), or with `--applier instant` an applier that answers at
once and writes nothing — and drives N proposals at concurrency C through the whole loop: a mix
of L0, L3 with a grant, L2 approved by a signing bench operator, and proposals rejected at
triage.

The clock stops when the last proposal's outcome is durably stored: after a core subscriber
has seen its final trailer, the bench reads that trailer back from the audit stream and the
retained record of the outcome from the records stream, and the time of that read is the end.
Trailers are watched as they are written (a core subscription on `improve.audit.>`), so stage
latencies come from the chain.

The ceiling is measured in the same run, on the same server and sync setting, after the loop:
pipelined publishes spread over as many streams as the daemon wrote to (audit, records,
inbound), in parallel, with messages of the mean size each of those streams received during the
run. The messages every stream gained during the run (stream sequence deltas) give the writes
per proposal; those to file storage are the fsync'd ones.

Everything the bench creates lives under one temporary directory, removed when it ends, also
on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import json
import logging
import os
import random
import re
import signal as signals
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from improved.client import acceptance, connection
from improved.client.chain_writer import trailers_of
from improved.client.sdk import MeshClient
from improved.core import propose, signing
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import (
    AnalyzerRef,
    ApplyOrder,
    ApplyResult,
    ChangeClass,
    GrantCommand,
    Origin,
    Proposal,
    Review,
    Summary,
    Trailer,
    to_json,
)
from improved.runtime.store import Store
from improved_bench import broker
from improved_bench.processes import BenchProcesses, peak_rss_mb
from improved_reference.ranking_store import RankingStore
from improved_reference.skills_store import SkillsStore

SVC = "bench"
OPERATOR = "operator:bench"
KINDS = ("l0", "l3", "l2", "reject")
FINAL = {"l0": "applied", "l3": "applied", "l2": "applied", "reject": "rejected"}
INTERRUPT_AGAIN_S = 0.2  # a Ctrl-C cancels the run again this often until it is stopping


def parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        if name.strip() not in KINDS:
            raise ValueError(f"--mix: unknown kind {name!r} (one of {', '.join(KINDS)})")
        mix[name.strip()] = float(weight)
    total = sum(mix.values())
    if total <= 0:
        raise ValueError("--mix: the weights add up to nothing")
    return {k: v / total for k, v in mix.items()}


SKILL = {"name": "bench_summarize", "description": "summarise a text for the bench",
         "instructions": "Read the text; write three bullet points, most important first."}


def make_proposal(kind: str, i: int, t0: int) -> Proposal:
    """Proposal `i` of `kind`: an L0 `rank:` change, an L3 or L2 skill, or a skill filed as L0
    (`reject`: triage refuses it, class_mismatch)."""
    change_class: ChangeClass
    if kind == "l0":
        key = f"k{i}"
        target, change_class, analyzer = f"rank:{key}", "L0", "bench.tuner/1"
        summary = Summary(template_id="adjust_rank", args={"item": key, "delta": 1})
        data: dict[str, Any] = {"set": {"key": key, "value": i}}
    else:
        target = f"skill:{SKILL['name']}"
        change_class, analyzer = (("L3", f"bench.skills{i}/1") if kind == "l3" else
                                  ("L2", f"bench.skills{i}/1") if kind == "l2" else
                                  ("L0", f"bench.bad{i}/1"))
        summary = Summary(template_id="new_skill", args={"name": SKILL["name"]})
        data = {"skill": SKILL}
    return Proposal(service=SVC, target_ref=target, change_class=change_class, scope="knowledge",
                    origin=Origin(actor=f"mcp:bench-agent-{i % 97}:{i}", service=SVC),
                    analyzer=AnalyzerRef(id=analyzer), summary=summary, proposal_data=data,
                    created_at=t0 + i)


async def _is(read: Callable[[], Awaitable[object]], value: object) -> bool:
    return await read() == value


class InstantApplier:
    """The instant applier: answers every ApplyOrder at once and writes nothing (a lower bound on
    the owning service's cost), counts them per id. With `js`, it first verifies on the audit
    chain that the order was accepted (what a conformant L2+ service does,
    improved/client/acceptance.py), each order in a task of its own."""

    NAME = "instant"
    LABEL = "instant (answers at once, writes nothing)"

    def __init__(self, js: JetStreamContext | None = None):
        self.orders: Counter[str] = Counter()
        self.refused = 0
        self.decoder = msgspec.json.Decoder(ApplyOrder)
        self.js = js
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self, nc: Client) -> None:
        await nc.subscribe(S.apply_request(SVC), cb=self.handle)

    async def handle(self, msg: Msg) -> None:
        if self.js is None:
            await self._answer(msg)
            return
        task = asyncio.create_task(self._answer(msg))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, msg: Msg) -> None:
        order = self.decoder.decode(msg.data)
        self.orders[order.proposal_id] += 1
        if self.js is not None:
            refusal = await acceptance.check(self.js, order)
            if refusal is not None:
                self.refused += 1
                await msg.respond(to_json(ApplyResult(ok=False, error=refusal)))
                return
        result = ApplyResult(ok=True, applied_id=f"bench:{order.proposal_id[:12]}",
                             inverse={"undo": order.proposal_id[:12]}, rollbackable=True)
        await msg.respond(to_json(result))


class StoreApplier:
    """The owning service as the project's persisting reference stores: RankingStore applies
    the `rank:` orders (L0), SkillsStore the `skill:` ones (L2, L3), each exactly once through
    its ledger in JetStream KV (ledger create, value write, ledger update), as a real owning
    service does before it answers. One subscription routes each order by its target."""

    NAME = "ranking"
    LABEL = ("reference stores (RankingStore for rank: L0, SkillsStore for skill: L2/L3; "
             "JetStream KV, exactly once)")

    def __init__(self, nc: Client, verify_acceptance: bool):
        self.ranking = RankingStore(nc, SVC, verify_acceptance=verify_acceptance)
        self.skills = SkillsStore(nc, SVC, verify_acceptance=verify_acceptance)
        self.client = MeshClient(nc, SVC)
        self.orders: Counter[str] = Counter()
        self.refused = 0

    async def start(self, nc: Client) -> None:
        await self.ranking.open()
        await self.skills.open()
        await self.client.serve_apply(self.apply)

    async def apply(self, order: ApplyOrder) -> ApplyResult:
        self.orders[order.proposal_id] += 1
        store = self.ranking if order.proposal.target_ref.startswith("rank:") else self.skills
        result = await store.apply(order)
        if not result.ok:
            self.refused += 1
        return result


APPLIERS = {"instant": InstantApplier, "ranking": StoreApplier}


@dataclass
class Track:
    """One proposal as the bench saw it; times are wall-clock seconds (time.time()), the
    publisher process's and this one's alike."""

    kind: str
    published: float | None = None  # when the publisher process sent it
    stages: dict[str, int] = field(default_factory=dict)  # to_stage → trailer `at` (ms)
    decided: float | None = None  # its triage trailer seen
    applied: float | None = None  # its apply outcome trailer seen
    final: float | None = None  # its last trailer seen
    final_seq: int = 0  # the chain position of the final trailer


class Watch:
    """The chains of one drive as they are written (a core subscription on the bench
    service's audit subjects): each proposal's Track, the trailers seen, and `done` once the
    last proposal is final."""

    def __init__(self, tracks: dict[str, Track], learn_back: bool, concurrency: int | None):
        self.tracks = tracks
        self.learn_back = learn_back
        self.concurrency = concurrency  # closed loop: progress is shown
        self.done = asyncio.Event()
        self.finished = 0
        self.transitions = 0
        self.last: str | None = None  # the proposal that was final last
        self.started = time.perf_counter()

    async def on_trailer(self, msg: Msg) -> None:
        for t in trailers_of(msg.data):  # one trailer, or a commit of several
            self.see(t)

    def see(self, t: Trailer) -> None:
        track = self.tracks.get(t.proposal_id)
        if track is None:
            return
        self.transitions += 1
        now = time.time()
        # an approval and an order's dispatch (the intent before it) are kept apart, so
        # `apply` is the outcome and gate→apply spans the service's answer
        verdict = t.verdict
        stage: str = verdict if verdict in ("approve", "dispatched") else t.to_stage
        track.stages.setdefault(stage, t.at)
        if t.to_stage == "triage" and track.decided is None:
            track.decided = now
        applied = t.to_stage == "apply" and verdict == "applied"
        if applied and track.applied is None:
            track.applied = now
        final = (t.to_stage == "learn-back"
                 if self.learn_back and FINAL[track.kind] == "applied"
                 else applied or (t.to_stage == "triage" and verdict == "reject"))
        if final and track.final is None:
            track.final = now
            track.final_seq = t.seq
            self.last = t.proposal_id
            self.finished += 1
            if self.concurrency:
                progress(self.finished, len(self.tracks), self.started)
            if self.finished == len(self.tracks):
                self.done.set()


class Plan(msgspec.Struct, kw_only=True):
    """What one drive asks of the publisher process (improved_bench.publisher), in
    a file of the run's: where, with which key, what to publish and how fast, where to report."""

    url: str
    key: str  # the bench operator's PEM file, to approve the L2 proposals
    kinds: list[str]
    t0: int
    first: int
    concurrency: int | None  # closed loop: at most this many unfinished at once
    rate: float | None  # open loop: proposals per second
    learn_back: bool
    timeout: float
    out: str  # where the Published report goes


class Published(msgspec.Struct, kw_only=True):
    """The publisher's report: when (time.time()) it published each proposal, by id, and the
    CPU seconds it used from its first publish to its end."""

    published: dict[str, float] = {}
    cpu_s: float = float("nan")



PACED_SHARES = (0.25, 0.5, 0.9)  # the paced runs' rates, as shares of the measured peak


def lat(values: Sequence[float]) -> dict[str, Any]:
    return {"p50_ms": round(percentile(values, 50), 2),
            "p99_ms": round(percentile(values, 99), 2), "n": len(values)}


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def progress(done: int, total: int, started: float) -> None:
    if not sys.stderr.isatty() and done not in (total,) and done % max(total // 10, 1):
        return
    width = 30
    filled = int(width * done / max(total, 1))
    rate = done / max(time.perf_counter() - started, 1e-9)
    sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                     f"{rate:,.0f}/s ")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


class Bench:
    """One `improved bench` run: the loop driven and measured on the processes it starts
    (BenchProcesses), against the broker's own rate (broker)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.processes = BenchProcesses(args)
        self.tmp = self.processes.tmp
        self.stopping = False  # the run reached its cleanup: a Ctrl-C need not cancel it again
        self.interrupted = False  # a Ctrl-C or SIGTERM came
        self.publisher_cpu_s: dict[int, float] = {}  # its CPU seconds while publishing, by run
        self.key = Ed25519PrivateKey.generate()
        self.key_file = self.tmp / "operator.pem"  # the bench operator's, for the publisher
        self.key_file.write_bytes(self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        self.mix: dict[str, float] = parse_mix(args.mix)

    # -- the run ----------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        a = self.args
        # Ctrl-C and SIGTERM cancel the task; `finally` stops everything. nats-py swallows a
        # cancellation that lands while a publish waits on its flusher (Client._flush_pending),
        # so one cancel can be lost and the run goes on: cancel again until `finally` is reached
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()

        def interrupt() -> None:
            self.interrupted = True
            if not self.stopping and not task.done():
                task.cancel()
                loop.call_later(INTERRUPT_AGAIN_S, interrupt)

        for sig in (signals.SIGINT, signals.SIGTERM):
            loop.add_signal_handler(sig, interrupt)
        url = self.processes.start_server()
        nc = await connection.connect(url, "improved-bench")
        service = await connection.connect(url, "improved-bench-applier")  # the owning service's own
        try:
            t0 = int(time.time() * 1000)
            kinds = random.Random(7).choices(list(self.mix), weights=list(self.mix.values()),
                                             k=a.n)
            public = base64.b64encode(signing.raw_public(self.key.public_key())).decode()
            self.processes.start_daemons(url, a.replicas, OPERATOR, public)
            await self.processes.wait_ready(nc)
            applier: InstantApplier | StoreApplier
            if a.applier == "instant":
                applier = InstantApplier(service.jetstream() if a.verify_acceptance else None)
            else:
                applier = StoreApplier(service, bool(a.verify_acceptance))
            await applier.start(service)
            await self.grant(nc, t0)
            js = nc.jetstream()
            before = await broker.streams(js)
            applier_streams = {name for name in before if name.startswith("KV_")
                               and name.removeprefix("KV_").endswith(f"_{SVC}")}
            cpu_before = self.processes.cpu()
            result = await self.drive(nc, url, kinds, t0, 1, concurrency=a.concurrency)
            cpu_after = self.processes.cpu()
            per = 1000 / max(result["completed"], 1)
            result["cpu_ms_per_proposal"] = {
                **{who: round((cpu_after[who] - s) * per, 3) for who, s in cpu_before.items()},
                "publisher": round(self.publisher_cpu_s.get(1, float("nan")) * per, 3)}
            result["writes"] = await broker.writes(js, before, result["completed"],
                                                   applier_streams)
            total = min(max(result["writes"]["loop_messages"], 4000), 20000)
            ceiling = await broker.ceiling(nc, result["writes"]["streams"], total)
            atomic = await broker.ceiling(nc, result["writes"]["streams"], total, atomic=True)
            loop_writes_per_s = result["writes"]["loop_messages"] / result["elapsed_s"]
            result["broker"] = {"ceiling": ceiling, "atomic_ceiling": atomic,
                                "sync": "external server" if a.nats else a.sync,
                                "records_storage": a.records}
            result["ratio_transitions_to_ceiling"] = round(
                result["audited_transitions_per_s"] / ceiling["messages_per_s"], 3)
            result["ratio_loop_writes_to_ceiling"] = round(
                loop_writes_per_s / ceiling["messages_per_s"], 3)
            result["ratio_loop_writes_to_atomic_ceiling"] = round(
                loop_writes_per_s / atomic["messages_per_s"], 3)
            result["duplicate_applies"] = sum(1 for c in applier.orders.values() if c > 1)
            result["applier"] = {"name": applier.NAME, "label": applier.LABEL,
                                 "verifies_acceptance": bool(a.verify_acceptance),
                                 "refused": applier.refused}
            result["verify"] = await self.verify_and_rebuild(url)
            result["peak_rss_mb"] = [round(peak_rss_mb(d.pid), 1) for d in self.processes.daemons]
            if a.paced:
                result["paced"] = await self.paced(nc, url, result["proposals_per_s"], t0,
                                                   a.n + 1)
            result["machine"] = machine()
            return result
        finally:
            self.stopping = True
            try:  # an interrupted close (Ctrl-C cancels this task) must not skip the stop
                for conn in (service, nc):
                    # interrupted, nothing is left to flush: a drain would wait on callbacks
                    # the cancel cut short, up to nats-py's drain timeout (30 s)
                    await (conn.close() if self.interrupted else connection.close(conn))
            finally:
                self.processes.stop()

    async def grant(self, nc: Client, t0: int) -> None:
        """Before the clock starts, as SPEC 09 §3 has it: the skill's first execution approved
        and applied at L2, then a grant naming that proposal (the L3 share runs under it)."""
        first = msgspec.structs.replace(make_proposal("l2", 0, t0 - 1), created_at=t0 - 1)
        pid, _ = propose.identify(first)
        js = nc.jetstream()
        await js.publish(S.inbound_proposal(SVC), to_json(first))
        store = Store(nc)
        await store.bind()
        client = MeshClient(nc, SVC)  # the proposal's retained records

        async def until(what: str, done: Callable[[], Awaitable[object]]) -> None:
            deadline = time.monotonic() + 10
            while not await done():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"bench setup: {what} did not happen")
                await asyncio.sleep(0.05)

        async def status() -> str | None:
            state = await client.state(pid)
            return state.status if state is not None and await client.decision(pid) else None

        await until("the first L2's triage", status)
        review = Review(proposal_id=pid, verdict="approve", principal=OPERATOR,
                        reason="bench: first execution", at=int(time.time() * 1000))
        await js.publish(S.inbound_review(SVC), to_json(
            signing.sign(signing.PAYLOAD_TYPES["review"], to_json(review), self.key)))
        await until("the first L2's apply", lambda: _is(status, "applied"))
        identity = canonical.skill_identity(SKILL)
        cmd = GrantCommand(op="grant", skill=identity, principal=OPERATOR, reason="bench",
                           at=int(time.time() * 1000), proposal_id=pid)
        env = signing.sign(signing.PAYLOAD_TYPES["grant"], to_json(cmd), self.key)
        await js.publish(S.GRANTS, to_json(env))
        await until("the grant", lambda: store.grant_active(identity, int(time.time() * 1000)))

    async def drive(self, nc: Client, url: str, kinds: list[str], t0: int, first: int, *,
                    concurrency: int | None = None, rate: float | None = None,
                    ) -> dict[str, Any]:
        """Publish `kinds` from the publisher process (closed loop at `concurrency`, or open
        loop at `rate`) and watch every chain as it is written; stop the clock when the last
        proposal's final trailer and outcome are read back."""
        learn_back = bool(self.args.learn_back)
        ids = [propose.identify(make_proposal(k, first + i, t0))[0] for i, k in enumerate(kinds)]
        watch = Watch({pid: Track(kind) for pid, kind in zip(ids, kinds, strict=True)},
                      learn_back, concurrency)
        sub = await nc.subscribe(f"{S.AUDIT}.{SVC}.*", cb=watch.on_trailer)
        await nc.flush()
        out = self.tmp / f"published-{first}.json"
        plan = self.tmp / f"plan-{first}.json"
        plan.write_bytes(msgspec.json.encode(Plan(
            url=url, key=str(self.key_file), kinds=kinds, t0=t0, first=first,
            concurrency=concurrency, rate=rate, learn_back=learn_back,
            timeout=self.args.timeout, out=str(out))))
        publisher = self.processes.spawn("publisher", "improved_bench.publisher", str(plan))
        try:
            await asyncio.wait_for(watch.done.wait(), timeout=self.args.timeout)
        except TimeoutError:
            sys.stderr.write(f"\n  timed out with {watch.finished}/{len(ids)} final\n")
        seen = time.time()
        durable = False
        if watch.last is not None and watch.finished == len(ids):
            durable = await self.read_back(nc, watch.last, watch.tracks[watch.last])
        end = time.time()
        await sub.unsubscribe()
        await asyncio.get_running_loop().run_in_executor(None, self.processes.reap, publisher)
        report = (msgspec.json.decode(out.read_bytes(), type=Published) if out.exists()
                  else Published())
        self.publisher_cpu_s[first] = report.cpu_s
        for pid, at in report.published.items():
            watch.tracks[pid].published = at
        started = min(report.published.values(), default=end)
        return self.figures(watch, kinds, concurrency, rate, elapsed=max(end - started, 1e-9),
                            seen_to_read_back_s=end - seen, durable=durable)

    def figures(self, watch: Watch, kinds: list[str], concurrency: int | None,
                rate: float | None, *, elapsed: float, seen_to_read_back_s: float,
                durable: bool) -> dict[str, Any]:
        """What one drive measured: rates over `elapsed` (from the first publish to the read
        back), the latencies from each proposal's publish and between its stages (from its
        chain), in all and by kind."""
        tracks = watch.tracks
        ms = 1000.0

        def since_publish(attr: str, kind: str | None = None) -> list[float]:
            return [(getattr(t, attr) - t.published) * ms for t in tracks.values()
                    if getattr(t, attr) and t.published and (kind is None or t.kind == kind)]

        stage_lat: defaultdict[str, list[int]] = defaultdict(list)
        for t in tracks.values():
            s = t.stages
            if "propose" in s and "triage" in s:
                stage_lat["propose→triage"].append(s["triage"] - s["propose"])
            if "apply" in s and ("approve" in s or "triage" in s):
                stage_lat["gate→apply"].append(s["apply"] - s.get("approve", s["triage"]))
            if "approve" in s and "triage" in s:
                stage_lat["defer→approve"].append(s["approve"] - s["triage"])
        by_kind = {kind: {"publish→decision": lat(since_publish("decided", kind)),
                          "publish→applied": lat(since_publish("applied", kind))}
                   for kind in sorted(set(kinds))}
        learn_back, finished = watch.learn_back, watch.finished
        return {
            "proposals": len(tracks), "concurrency": concurrency, "rate": rate,
            "replicas": self.args.replicas, "mix": Counter(kinds), "learn_back": learn_back,
            "completed": finished, "elapsed_s": round(elapsed, 3),
            "clock_stop": ("the last proposal's final trailer "
                           + ("(its learn-back signal, or its rejection) " if learn_back else "")
                           + f"read back from {S.STREAM_AUDIT} and its retained outcome from "
                           f"{S.STREAM_RECORDS}" if durable else
                           "the timeout or the last final trailer seen: not every outcome was "
                           "read back (the run fails)"),
            "clock_start": "the publisher process's first publish",
            "durable_read_back": durable,
            "seen_to_read_back_ms": round(seen_to_read_back_s * 1000, 2),
            "proposals_per_s": round(finished / elapsed, 1),
            "audited_transitions": watch.transitions,
            "audited_transitions_per_s": round(watch.transitions / elapsed, 1),
            "latency": {"publish→decision": lat(since_publish("decided")),
                        "publish→applied": lat(since_publish("applied")),
                        "publish→final": lat(since_publish("final")),
                        **{k: lat(v) for k, v in stage_lat.items()}},
            "latency_by_kind": by_kind,
        }

    async def read_back(self, nc: Client, pid: str, track: Track) -> bool:
        """Read the proposal's outcome back through JetStream until it is stored: the chain's
        last trailer at or past the final one seen, and the retained record of the outcome
        (the apply outcome, ok, for an applied proposal; the triage decision for a rejected
        one). True once both are read; False after 10 s."""
        js = nc.jetstream()
        record = (S.apply_outcome(SVC, pid) if FINAL[track.kind] == "applied"
                  else S.triage_decision(SVC, pid))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                trailer = await js.get_msg(S.STREAM_AUDIT, subject=S.audit(SVC, pid),
                                           direct=True)
                stored = await js.get_msg(S.STREAM_RECORDS, subject=record, direct=True)
            except NotFoundError:
                await asyncio.sleep(0.001)
                continue
            body = msgspec.json.decode(stored.data or b"")
            if (trailers_of(trailer.data or b"")[-1].seq >= track.final_seq
                    and (FINAL[track.kind] != "applied" or body.get("ok") is True)):
                return True
            await asyncio.sleep(0.001)
        return False

    async def paced(self, nc: Client, url: str, peak: float, t0: int, first: int
                    ) -> list[dict[str, Any]]:
        """The same mix published at a fixed rate, at 25, 50 and 90 % of the measured peak:
        publish→decision and publish→applied, in all and by class."""
        out = []
        for share in PACED_SHARES:
            rate = max(peak * share, 1.0)
            n = max(self.args.paced_n, 20)  # each run long enough for a stable p99
            kinds = random.Random(first).choices(list(self.mix), weights=list(self.mix.values()),
                                                 k=n)
            r = await self.drive(nc, url, kinds, t0, first, rate=rate)
            first += n
            out.append({"share_of_peak": share, "rate_per_s": round(rate, 1), "proposals": n,
                        "completed": r["completed"], "latency": r["latency"],
                        "latency_by_kind": r["latency_by_kind"]})
        return out

    async def verify_and_rebuild(self, url: str) -> dict[str, Any]:
        """`improved audit verify` (the whole log, from the first trailer) and `improved audit
        rebuild`, run as an operator runs them, timed from start to exit: reading the log is
        part of the figure."""
        loop = asyncio.get_running_loop()
        nc = await connection.connect(url, "improved-bench-count")
        try:
            info = await nc.jetstream().stream_info(S.STREAM_AUDIT)
        finally:
            await connection.close(nc)
        messages = info.state.messages
        out: dict[str, Any] = {"messages": messages, "trailers": messages}
        trailers = messages  # until `audit verify` says how many trailers they carry
        for what in ("verify", "rebuild"):
            argv = [sys.executable, "-m", "improved.cli", "--log-level", "warning", "audit",
                    what, "--nats", url]
            started = time.perf_counter()
            done = await loop.run_in_executor(None, functools.partial(
                subprocess.run, argv, env={**os.environ, "IMPROVED_CONFIG": str(self.processes.config)},
                capture_output=True, text=True, timeout=600))
            elapsed = time.perf_counter() - started
            said = re.search(r"chains verified, (\d+) trailers", done.stdout)
            if what == "verify" and said:
                trailers = out["trailers"] = int(said.group(1))
            out[what] = {"s": round(elapsed, 2), "exit": done.returncode,
                         "trailers_per_s": round(trailers / max(elapsed, 1e-9)),
                         "said": (done.stdout.strip().splitlines() or [""])[-1][:200]}
        return out


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0]}


def table(r: dict[str, Any]) -> str:
    b = r["broker"]
    lines = [
        f"machine              {r['machine']['cpu']} ({r['machine']['cores']} cores), "
        f"python {r['machine']['python']}",
        f"proposals            {r['completed']}/{r['proposals']} at concurrency "
        f"{r['concurrency']}, {r['replicas']} daemon(s), mix {dict(r['mix'])}, published by "
        "a separate process"
        + (", one independent learn-back signal per applied proposal" if r["learn_back"]
           else ", no learn-back signals"),
        f"applier              {r['applier']['label']}",
        f"end to end           {r['proposals_per_s']:,.1f} proposals/s (applier "
        f"{r['applier']['name']}; clock from {r['clock_start']} to {r['clock_stop']}, "
        f"{r['seen_to_read_back_ms']} ms after it was seen)",
        f"audited transitions  {r['audited_transitions_per_s']:,.1f}/s "
        f"({r['audited_transitions']} trailers)",
        f"writes per proposal  {r['writes']['fsyncd_per_proposal']} to file storage (fsync'd "
        f"with sync always), {r['writes']['fsyncd_loop_per_proposal']} of them by the loop: "
        + ", ".join(f"{name} {v['per_proposal']}{'' if v['file'] else ' (memory)'}"
                    for name, v in sorted(r["writes"]["streams"].items())),
        "CPU per proposal     " + ", ".join(f"{who} {ms:.2f} ms"
                                            for who, ms in r["cpu_ms_per_proposal"].items()),
        f"ceiling              {b['ceiling']['messages_per_s']:,}/s pipelined, "
        f"{b['atomic_ceiling']['messages_per_s']:,}/s in {b['atomic_ceiling']['pattern']}; to "
        f"{b['ceiling']['streams']} streams in parallel (the loop's streams, message sizes and "
        f"storage), same run, sync {b['sync']}, retained records in {b['records_storage']}",
        f"loop / ceiling       {r['ratio_loop_writes_to_ceiling']:.1%} of the pipelined, "
        f"{r['ratio_loop_writes_to_atomic_ceiling']:.1%} of the atomic-batch ceiling (the "
        f"loop's own writes to those streams); audited transitions "
        f"{r['ratio_transitions_to_ceiling']:.1%} of the pipelined",
    ]
    for name, v in r["latency"].items():
        lines.append(f"{name:<21}p50 {v['p50_ms']:8.2f} ms   p99 {v['p99_ms']:8.2f} ms   "
                     f"(n={v['n']})")
    for p in r.get("paced", []):
        lines.append(f"paced {p['share_of_peak']:.0%} of peak   {p['rate_per_s']}/s, "
                     f"{p['completed']}/{p['proposals']} done:")
        for kind, v in p["latency_by_kind"].items():
            d, a = v["publish→decision"], v["publish→applied"]
            lines.append(f"  {kind:<7}            decision p50 {d['p50_ms']:7.2f} p99 "
                         f"{d['p99_ms']:7.2f} ms"
                         + (f"   applied p50 {a['p50_ms']:7.2f} p99 {a['p99_ms']:7.2f} ms"
                            if a["n"] else ""))
    v = r["verify"]
    lines += [
        f"audit verify (CLI)   {v['verify']['trailers_per_s']:,} trailers/s, whole log from "
        f"the first trailer, read included ({v['trailers']} trailers in "
        f"{v['verify']['s']} s, exit {v['verify']['exit']})",
        f"audit rebuild (CLI)  {v['rebuild']['trailers_per_s']:,} trailers/s "
        f"({v['rebuild']['s']} s, exit {v['rebuild']['exit']})",
        f"duplicate applies    {r['duplicate_applies']}",
        "acceptance           "
        + ("verified on the audit chain for every order "
           f"({r['applier']['refused']} refused)"
           if r["applier"]["verifies_acceptance"]
           else f"trusted the bus (no check; {r['applier']['refused']} refused)"),
        f"daemon peak RSS      {', '.join(f'{m} MB' for m in r['peak_rss_mb'])}",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    # the in-process stores log each apply at info: on the bench's CPU and screen, not wanted
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    bench = Bench(args)
    try:
        try:
            result = asyncio.run(bench.run())
        except (KeyboardInterrupt, asyncio.CancelledError):
            sys.stderr.write("\n  interrupted: the daemons and the server stopped, "
                             f"{bench.tmp} removed\n")
            return 130
        except BaseException:
            tail = bench.processes.daemon_log_tail()
            if tail:
                sys.stderr.write(f"the daemons' logs ended with:\n{tail}\n")
            raise
    finally:
        bench.processes.stop()  # already done unless the run was cut short before its own stop
        bench.processes.cleanup()
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
        print(f"\nJSON written to {args.json}")
    return 0 if (result["duplicate_applies"] == 0 and result["completed"] == args.n
                 and result["applier"]["refused"] == 0
                 and result["durable_read_back"]) else 1
