"""The cost of one observed signal (a signal that names no proposal, which only the analyzers
read). `python benchmarks/observe_cost.py 3000` starts an embedded server (sync 2m) and an
in-process daemon, then measures
  1. the observe stage alone: `InboundConsumer.observe` awaited once per signal, N negative metric
     signals about N/3 targets from three sessions (so every third one completes a window and
     proposes an L1), mean and p50/p99 per signal; then N signals each about a target of its
     own;
  2. end to end: N more such signals published into the inbound stream at once, until the
     shared consumer is idle: signals per second through the daemon's consumer; then N
     signals each about a target of its own (no window completes, nothing is proposed).
"""

import asyncio
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import structlog

from improved.client import connection
from improved.client.config import Config
from improved.client.sdk import MeshClient
from improved.protocol.model import Signal
from improved.runtime import bus
from improved.runtime.daemon import Daemon


def negatives(svc: str, n: int, tag: str, per_target: int = 3) -> list[Signal]:
    at = int(time.time() * 1000)
    return [Signal(kind="metric", actor=f"mcp:watch-{i % 3}:1", service=svc, positive=False,
                   at=at + i, target_ref=f"rank:{tag}.{i // per_target}", name="ctr", value=0.1)
            for i in range(n)]


async def through_the_bus(nc, svc: str, sigs: list[Signal]) -> float:
    """Signals per second from the first publish until the shared consumer is idle."""
    client = MeshClient(nc, svc)
    began = time.perf_counter()
    for i in range(0, len(sigs), 500):
        await asyncio.gather(*(client.signal(s) for s in sigs[i:i + 500]))
    await idle(nc)
    return len(sigs) / (time.perf_counter() - began)


async def idle(nc) -> None:
    while True:
        info = await nc.jetstream().consumer_info("IMPROVE_IN", "improved-loop")
        if info.num_pending == 0 and info.num_ack_pending == 0:
            return
        await asyncio.sleep(0.2)


async def alone(d: Daemon, sigs: list[Signal]) -> list[float]:
    """Seconds `InboundConsumer.observe` took for each signal, sorted."""
    took = []
    for sig in sigs:
        started = time.perf_counter()
        await d.inbound.observe(sig.service, sig)
        took.append(time.perf_counter() - started)
    return sorted(took)


def ms(took: list[float]) -> str:
    return (f"mean {statistics.mean(took) * 1e3:.3f} ms, p50 {took[len(took) // 2] * 1e3:.3f} "
            f"ms, p99 {took[int(len(took) * 0.99)] * 1e3:.3f} ms")


async def main(n: int) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    tmp = Path(tempfile.mkdtemp(prefix="observe-cost-"))
    server = bus.EmbeddedServer(tmp / "nats", bus.free_port(), sync="2m")
    url = server.start()
    nc = await connection.connect(url, "observe-cost")
    d = Daemon(nc, Config(data_dir=tmp / "d", checkpoint_interval_s=0))
    await d.start()
    try:
        took = await alone(d, negatives("direct", n, "direct"))
        lone_took = await alone(d, negatives("single", n, "single", per_target=1))
        await idle(nc)  # the proposals observe made are registered before the next part
        rate = await through_the_bus(nc, "bus", negatives("bus", n, "bus"))
        lone = await through_the_bus(nc, "lone", negatives("lone", n, "lone", per_target=1))
        print(f"N={n} observe alone: {ms(took)} per signal ({ms(lone_took)} each about a "
              f"target of its own); end to end (publish → consumer idle, {n // 3} proposals among "
              f"them): {rate:.0f} signals/s; each about a target of its own (no proposal): "
              f"{lone:.0f} signals/s")
    finally:
        await d.stop()
        await nc.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000))
