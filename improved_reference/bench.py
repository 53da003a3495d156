"""`improved bench`: the loop measured against the broker's own limit, in one run.

It starts an embedded nats-server (or uses --nats), measures the raw pipelined JetStream publish
rate with messages the size of a proposal, starts daemon processes and an in-process reference
applier, drives N proposals at concurrency C through the whole loop — a mix of L0, L3 with a
grant, L2 approved by a signing bench operator, and proposals rejected at triage — and reports
end-to-end proposals/s, audited transitions/s, per-stage latencies, the daemon/broker ratio,
audit verify and rebuild rates, and the daemons' peak RSS. Trailers are watched as they are
written (a core subscription on `improve.audit.>`), so stage latencies come from the chain.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import signal as signals
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.js import api as jsapi

from improved.client import acceptance
from improved.core import audit, evidence, propose, signing
from improved.core.policy import Policy
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import (
    AnalyzerRef,
    ApplyOrder,
    ApplyResult,
    GrantCommand,
    Origin,
    Proposal,
    Review,
    Summary,
    to_json,
)
from improved.runtime import bus, keys
from improved.runtime.store import Store

SVC = "bench"
OPERATOR = "operator:bench"
KINDS = ("l0", "l3", "l2", "reject")
FINAL = {"l0": "applied", "l3": "applied", "l2": "applied", "reject": "rejected"}


def parse_mix(text: str) -> dict[str, float]:
    mix = {}
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
    common = dict(
        service=SVC, scope="knowledge", created_at=t0 + i,
        origin=Origin(actor=f"mcp:bench-agent-{i % 97}:{i}", service=SVC),
    )
    if kind == "l0":
        key = f"k{i}"
        return Proposal(target_ref=f"rank:{key}", change_class="L0",
                        analyzer=AnalyzerRef(id="bench.tuner/1"),
                        summary=Summary(template_id="adjust_rank", args={"item": key, "delta": 1}),
                        proposal_data={"set": {"key": key, "value": i}}, **common)
    if kind in ("l3", "l2"):
        return Proposal(target_ref=f"skill:{SKILL['name']}", change_class=kind.upper(),
                        analyzer=AnalyzerRef(id=f"bench.skills{i}/1"),
                        summary=Summary(template_id="new_skill", args={"name": SKILL["name"]}),
                        proposal_data={"skill": SKILL}, **common)
    return Proposal(target_ref=f"skill:{SKILL['name']}", change_class="L0",  # class_mismatch
                    analyzer=AnalyzerRef(id=f"bench.bad{i}/1"),
                    summary=Summary(template_id="new_skill", args={"name": SKILL["name"]}),
                    proposal_data={"skill": SKILL}, **common)


async def _is(read, value) -> bool:
    return await read() == value


class Applier:
    """The reference applier of the bench: answers every ApplyOrder, counts them per id. With
    `js`, it first verifies on the audit chain that the order was accepted (what a conformant
    L2+ service does, improved/client/acceptance.py), each order in a task of its own."""

    def __init__(self, js=None):
        self.orders: Counter[str] = Counter()
        self.refused = 0
        self.decoder = msgspec.json.Decoder(ApplyOrder)
        self.js = js
        self.tasks: set[asyncio.Task] = set()

    async def handle(self, msg) -> None:
        if self.js is None:
            await self._answer(msg)
            return
        task = asyncio.create_task(self._answer(msg))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, msg) -> None:
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


@dataclass
class Track:
    kind: str
    published: float
    stages: dict[str, int] = field(default_factory=dict)  # to_stage → trailer `at` (ms)
    final: float | None = None
    decided: float | None = None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


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


def peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Bench:
    def __init__(self, args):
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="improved-bench-"))
        self.server: bus.EmbeddedServer | None = None
        self.daemons: list[subprocess.Popen] = []
        self.key = Ed25519PrivateKey.generate()

    # -- setup ----------------------------------------------------------------------------------

    def start_server(self) -> str:
        if self.args.nats:
            return self.args.nats
        self.server = bus.EmbeddedServer(self.tmp / "nats", bus.free_port(), sync=self.args.sync)
        return self.server.start()

    def start_daemons(self, url: str, replicas: int) -> None:
        public = base64.b64encode(signing.raw_public(self.key.public_key())).decode()
        config = self.tmp / "bench.toml"
        config.write_text(f'records_storage = "{self.args.records}"\n\n'
                          f'[trust.operators]\n"{OPERATOR}" = "{public}"\n')
        env = {**os.environ, "IMPROVED_CONFIG": str(config)}
        for i in range(replicas):
            log = open(self.tmp / f"daemon-{i}.log", "ab")  # noqa: SIM115
            self.daemons.append(subprocess.Popen(
                [sys.executable, "-m", "improved.cli", "--log-level", "warning", "run",
                 "--nats", url, "--data-dir", str(self.tmp / "daemon")],
                stdout=log, stderr=log, env=env, stdin=subprocess.DEVNULL))

    async def wait_ready(self, nc) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                await nc.request(S.SPEC_GET, b"{}", timeout=0.5)
                return
            except Exception:
                await asyncio.sleep(0.1)
        raise RuntimeError(f"the daemon did not come up; see {self.tmp}/daemon-*.log")

    def stop(self) -> None:
        for d in self.daemons:
            d.send_signal(signals.SIGTERM)
        for d in self.daemons:
            try:
                d.wait(30)
            except subprocess.TimeoutExpired:
                d.kill()
        if self.server is not None:
            self.server.stop()

    # -- the broker's own rate --------------------------------------------------------------------

    async def raw_rate(self, nc, size: int, count: int) -> float:
        """Pipelined JetStream publishes of `size`-byte messages: acknowledged messages/s."""
        js = nc.jetstream(publish_async_max_pending=4000)
        name = "IMPROVED_BENCH_RAW"
        await js.add_stream(jsapi.StreamConfig(name=name, subjects=["improved.bench.raw"],
                                               storage=jsapi.StorageType.FILE))
        payload = os.urandom(size // 2).hex().encode()[:size]
        started = time.perf_counter()
        futures = [await js.publish_async("improved.bench.raw", payload) for _ in range(count)]
        await asyncio.gather(*futures)
        elapsed = time.perf_counter() - started
        await js.delete_stream(name)
        return count / elapsed

    # -- the run ----------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        a = self.args
        url = self.start_server()
        nc = await bus.connect(url, "improved-bench")
        try:
            mix = parse_mix(a.mix)
            t0 = int(time.time() * 1000)
            kinds = random.Random(7).choices(list(mix), weights=list(mix.values()), k=a.n)
            proposals = [make_proposal(k, i, t0) for i, k in enumerate(kinds)]
            size = len(to_json(proposals[0]))
            raw = await self.raw_rate(nc, size, max(a.n * 4, 5000))
            self.start_daemons(url, a.replicas)
            await self.wait_ready(nc)
            applier = Applier(nc.jetstream() if a.verify_acceptance else None)
            await nc.subscribe(S.apply_request(SVC), cb=applier.handle)
            await self.grant(nc, t0)
            result = await self.drive(nc, proposals, kinds, a.concurrency)
            result["broker"] = {"raw_js_publish_per_s": round(raw), "message_bytes": size,
                                "sync": a.sync if self.server else "external server",
                                "records_storage": a.records}
            result["ratio_transitions_to_raw"] = round(
                result["audited_transitions_per_s"] / raw, 3)
            result["duplicate_applies"] = sum(1 for c in applier.orders.values() if c > 1)
            result["applier"] = {"verifies_acceptance": bool(a.verify_acceptance),
                                 "refused_unaccepted": applier.refused}
            result["verify"] = await self.verify_and_rebuild(nc)
            result["peak_rss_mb"] = [round(peak_rss_mb(d.pid), 1) for d in self.daemons]
            if a.paced:
                rate = result["proposals_per_s"] / 2
                paced = await self.paced(nc, rate, t0 + a.n + 1)
                result["paced_half_peak"] = paced
            result["machine"] = machine()
            return result
        finally:
            await bus.close(nc)
            self.stop()

    async def grant(self, nc, t0: int) -> None:
        """Before the clock starts, as SPEC 09 §3 has it: the skill's first execution approved
        and applied at L2, then a grant naming that proposal (the L3 share runs under it)."""
        first = msgspec.structs.replace(make_proposal("l2", 0, t0 - 1), created_at=t0 - 1)
        pid, _ = propose.identify(first)
        js = nc.jetstream()
        await js.publish(S.inbound_proposal(SVC), to_json(first))
        store = Store(nc)
        await store.bind()

        async def until(what: str, done) -> None:
            deadline = time.monotonic() + 10
            while not await done():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"bench setup: {what} did not happen")
                await asyncio.sleep(0.05)

        async def status() -> str | None:
            record, _ = await store.load(SVC, pid)
            return record.status if record is not None and record.decision else None

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

    async def drive(self, nc, proposals, kinds, concurrency: int) -> dict[str, Any]:
        js = nc.jetstream(publish_async_max_pending=max(concurrency * 2, 256))
        tracks: dict[str, Track] = {}
        ids = [propose.identify(p)[0] for p in proposals]
        kind_of = dict(zip(ids, kinds, strict=True))
        done = asyncio.Event()
        slots = asyncio.Semaphore(concurrency)
        finished = 0
        transitions = 0
        started = time.perf_counter()

        async def approve(pid: str) -> None:
            body = Review(proposal_id=pid, verdict="approve", principal=OPERATOR,
                          reason="bench", at=int(time.time() * 1000))
            env = signing.sign(signing.PAYLOAD_TYPES["review"], to_json(body), self.key)
            await js.publish_async(S.inbound_review(SVC), to_json(env))

        async def on_trailer(msg) -> None:
            nonlocal finished, transitions
            t = msgspec.json.decode(msg.data)
            track = tracks.get(t["proposal_id"])
            if track is None:
                return
            transitions += 1
            now = time.perf_counter()
            # an approval and an order's dispatch (the intent before it) are kept apart, so
            # `apply` is the outcome and gate→apply spans the service's answer
            verdict = t.get("verdict")
            stage = verdict if verdict in ("approve", "dispatched") else t["to_stage"]
            track.stages.setdefault(stage, t["at"])
            if t["to_stage"] == "triage" and track.decided is None:
                track.decided = now
            if t.get("cause") == "awaiting_operator" and track.kind == "l2":
                await approve(t["proposal_id"])
            status = {"apply": "applied" if t.get("verdict") == "applied" else None,
                      "triage": "rejected" if t.get("verdict") == "reject" else None}.get(
                t["to_stage"])
            if status == FINAL[track.kind] and track.final is None:
                track.final = now
                finished += 1
                slots.release()
                progress(finished, len(proposals), started)
                if finished == len(proposals):
                    done.set()

        async def feed() -> None:
            for pid, p in zip(ids, proposals, strict=True):
                await slots.acquire()
                tracks[pid] = Track(kind_of[pid], time.perf_counter())
                data = to_json(p)
                await js.publish_async(S.inbound_proposal(SVC), data,
                                       headers={"Nats-Msg-Id": S.message_id(pid, data)})

        sub = await nc.subscribe(f"{S.AUDIT}.{SVC}.*", cb=on_trailer)
        feeder = asyncio.create_task(feed())
        try:
            await asyncio.wait_for(done.wait(), timeout=self.args.timeout)
        except TimeoutError:
            sys.stderr.write(f"\n  timed out with {finished}/{len(proposals)} final\n")
        feeder.cancel()
        elapsed = time.perf_counter() - started
        await sub.unsubscribe()
        ms = 1000.0
        e2e = [(t.final - t.published) * ms for t in tracks.values() if t.final]
        to_decision = [(t.decided - t.published) * ms for t in tracks.values() if t.decided]
        stage_lat = defaultdict(list)
        for t in tracks.values():
            s = t.stages
            if "propose" in s and "triage" in s:
                stage_lat["propose→triage"].append(s["triage"] - s["propose"])
            if "apply" in s and ("approve" in s or "triage" in s):
                stage_lat["gate→apply"].append(s["apply"] - s.get("approve", s["triage"]))
            if "approve" in s and "triage" in s:
                stage_lat["defer→approve"].append(s["approve"] - s["triage"])

        def lat(values):
            return {"p50_ms": round(percentile(values, 50), 2),
                    "p99_ms": round(percentile(values, 99), 2), "n": len(values)}

        return {
            "proposals": len(proposals), "concurrency": concurrency,
            "replicas": self.args.replicas, "mix": Counter(kinds),
            "completed": finished, "elapsed_s": round(elapsed, 3),
            "proposals_per_s": round(finished / elapsed, 1),
            "audited_transitions": transitions,
            "audited_transitions_per_s": round(transitions / elapsed, 1),
            "latency": {"publish→decision": lat(to_decision), "publish→final": lat(e2e),
                        **{k: lat(v) for k, v in stage_lat.items()}},
        }

    async def paced(self, nc, rate: float, t0: int) -> dict[str, Any]:
        """Publish→decision latency at a fixed rate (half the measured peak)."""
        n = max(int(rate * 5), 200)
        proposals = [make_proposal("l0", i, t0 + i) for i in range(n)]
        ids = [propose.identify(p)[0] for p in proposals]
        sent: dict[str, float] = {}
        decided: dict[str, float] = {}
        done = asyncio.Event()

        async def on_trailer(msg) -> None:
            t = msgspec.json.decode(msg.data)
            pid = t["proposal_id"]
            if t["to_stage"] == "triage" and pid in sent and pid not in decided:
                decided[pid] = time.perf_counter()
                if len(decided) == n:
                    done.set()

        sub = await nc.subscribe(f"{S.AUDIT}.{SVC}.*", cb=on_trailer)
        js = nc.jetstream()
        interval = 1.0 / rate
        start = time.perf_counter()
        for i, (pid, p) in enumerate(zip(ids, proposals, strict=True)):
            delay = start + i * interval - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent[pid] = time.perf_counter()
            data = to_json(p)
            await js.publish_async(S.inbound_proposal(SVC), data,
                                   headers={"Nats-Msg-Id": S.message_id(pid, data)})
        try:
            await asyncio.wait_for(done.wait(), timeout=self.args.timeout)
        except TimeoutError:
            pass
        await sub.unsubscribe()
        lats = [(decided[p] - sent[p]) * 1000 for p in decided]
        return {"rate_per_s": round(rate, 1), "proposals": n, "decided": len(decided),
                "publish→decision_p50_ms": round(percentile(lats, 50), 2),
                "publish→decision_p99_ms": round(percentile(lats, 99), 2)}

    def chain_trust(self) -> evidence.ChainTrust:
        """What an auditor of this run trusts: the daemons' key, the bench operator's key."""
        daemon = keys.load_key(self.tmp / "daemon" / "checkpoint.pem")
        own = signing.keyid_of(signing.raw_public(daemon.public_key()))
        public = base64.b64encode(signing.raw_public(self.key.public_key())).decode()
        keyset = evidence.KeySet.from_config({OPERATOR: public}, {})
        return evidence.ChainTrust(frozenset({own}), evidence.History(fallback=keyset))

    async def verify_and_rebuild(self, nc) -> dict[str, Any]:
        """Read every chain once, verify it, and rebuild every record from its chain alone."""
        from improved.core.propose import rebuild_record

        store = Store(nc)
        started = time.perf_counter()
        chains = await store.all_chains()
        read_s = time.perf_counter() - started
        n = sum(len(c) for c in chains.values())
        started = time.perf_counter()
        linked = {key: audit.verify_links(key[1], c) for key, c in chains.items()}
        verify_s = time.perf_counter() - started
        trust = self.chain_trust()
        started = time.perf_counter()
        broken = sum(1 for key, c in chains.items()
                     if linked[key] or audit.verify_writers(key[1], c, trust))
        writers_s = time.perf_counter() - started
        decoder = msgspec.json.Decoder(audit.Trailer)
        proposals = {(svc, pid): c for (svc, pid), c in chains.items() if svc == SVC}
        started = time.perf_counter()
        statuses: Counter[str] = Counter()
        for bodies in proposals.values():
            trailers = [decoder.decode(msgspec.json.encode(b)) for b in bodies]
            statuses[rebuild_record(trailers, list(range(1, len(trailers) + 1)),
                                    Policy()).status] += 1
        rebuild_s = time.perf_counter() - started
        rebuilt = sum(len(c) for c in proposals.values())
        return {"trailers": n, "chains": len(chains), "broken": broken,
                "read_s": round(read_s, 3),
                "verify_trailers_per_s": round(n / max(verify_s, 1e-9)),
                "verify_writers_per_s": round(n / max(writers_s, 1e-9)),
                "rebuild_trailers_per_s": round(rebuilt / max(rebuild_s, 1e-9)),
                "rebuilt_statuses": dict(statuses)}


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
    lines = [
        f"machine              {r['machine']['cpu']} ({r['machine']['cores']} cores), "
        f"python {r['machine']['python']}",
        f"proposals            {r['completed']}/{r['proposals']} at concurrency "
        f"{r['concurrency']}, {r['replicas']} daemon(s), mix {dict(r['mix'])}",
        f"end to end           {r['proposals_per_s']:,.1f} proposals/s",
        f"audited transitions  {r['audited_transitions_per_s']:,.1f}/s "
        f"({r['audited_transitions']} trailers)",
        f"raw JetStream        {r['broker']['raw_js_publish_per_s']:,}/s pipelined, "
        f"{r['broker']['message_bytes']} B, sync {r['broker']['sync']}, retained records in "
        f"{r['broker']['records_storage']}",
        f"daemon / broker      {r['ratio_transitions_to_raw']:.1%}",
    ]
    for name, v in r["latency"].items():
        lines.append(f"{name:<21}p50 {v['p50_ms']:8.2f} ms   p99 {v['p99_ms']:8.2f} ms   "
                     f"(n={v['n']})")
    if "paced_half_peak" in r:
        p = r["paced_half_peak"]
        lines.append(f"at half peak         {p['rate_per_s']}/s: publish→decision p50 "
                     f"{p['publish→decision_p50_ms']} ms, p99 {p['publish→decision_p99_ms']} ms")
    v = r["verify"]
    lines += [
        f"audit verify         {v['verify_trailers_per_s']:,} trailers/s hashes and links, "
        f"{v['verify_writers_per_s']:,}/s daemon signatures and signed acts "
        f"({v['trailers']} trailers, {v['chains']} chains, {v['broken']} broken)",
        f"rebuild              {v['rebuild_trailers_per_s']:,} trailers/s",
        f"duplicate applies    {r['duplicate_applies']}",
        "applier              "
        + ("verified acceptance on the audit chain for every order "
           f"({r['applier']['refused_unaccepted']} refused)"
           if r["applier"]["verifies_acceptance"] else "trusted the bus (no acceptance check)"),
        f"daemon peak RSS      {', '.join(f'{m} MB' for m in r['peak_rss_mb'])}",
    ]
    return "\n".join(lines)


def main(args) -> int:
    bench = Bench(args)
    result = asyncio.run(bench.run())
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
        print(f"\nJSON written to {args.json}")
    return 0 if (result["duplicate_applies"] == 0 and result["completed"] == args.n
                 and result["applier"]["refused_unaccepted"] == 0) else 1
