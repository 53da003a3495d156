"""Start, stop and checkpoint cost at N applied L0 proposals of history (no cost may grow with
history: issue 16). `python benchmarks/history_cost.py 20000` fills an embedded server through
an in-process daemon, then times a checkpoint, a second one, a stop, a start on the same data
directory and a checkpoint after it, then `improved audit verify` in full and `--since` the last
checkpoint, then a broker restart (the memory state cache lost): start → ready, and until the
refill after ready is done. sync 2m: the fill is not what is measured."""

import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from improved.client.sdk import MeshClient
from improved.protocol.model import ApplyResult
from improved.runtime import bus
from improved.runtime.config import Config
from improved.runtime.daemon import Daemon
from improved.testing import rank_proposal


def verify(url: str, *args: str) -> None:
    """`improved audit verify` as an operator runs it: a process reading the log."""
    done = subprocess.run([sys.executable, "-m", "improved.cli", "audit", "verify", "--nats",
                           url, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"audit verify {' '.join(args)} failed: {done.stdout}{done.stderr}")


async def timed(step) -> float:
    started = time.perf_counter()
    await step
    return time.perf_counter() - started


async def main(n: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="measure-"))
    server = bus.EmbeddedServer(tmp / "nats", bus.free_port(), sync="2m")
    url = server.start()
    nc = await bus.connect(url, "measure")
    cfg = Config(data_dir=tmp / "d", checkpoint_interval_s=0)
    d = Daemon(nc, cfg)
    await d.start()
    client = MeshClient(nc, "m")

    async def applier(order):
        return ApplyResult(ok=True, applied_id=order.proposal_id[:8])

    sub = await client.serve_apply(applier)
    ids = []
    for i in range(0, n, 500):
        ids += await asyncio.gather(*(client.publish(rank_proposal("m", key=f"k{j}"))
                                      for j in range(i, min(n, i + 500))))
    while True:
        info = await nc.jetstream().consumer_info("IMPROVE_IN", "improved-loop")
        if info.num_pending == 0 and info.num_ack_pending == 0:
            break
        await asyncio.sleep(1)
    await asyncio.sleep(2)
    cp_running = await timed(d.engine.checkpoint(d._checkpoint_key))
    cp_again = await timed(d.engine.checkpoint(d._checkpoint_key))
    await sub.unsubscribe()
    stop_s = await timed(d.stop())
    d2 = Daemon(nc, cfg)
    start_s = await timed(d2.start())
    cp2 = await timed(d2.engine.checkpoint(d2._checkpoint_key))
    info = await nc.jetstream().stream_info("IMPROVE_AUDIT")
    anchor = str(cfg.data_dir / "last-checkpoint.json")
    full = await timed(asyncio.to_thread(verify, url, "--checkpoint", anchor))
    since = await timed(asyncio.to_thread(verify, url, "--since", "--checkpoint", anchor))
    await d2.stop()
    await nc.close()
    # a broker restart: the state cache (memory storage) is gone
    server.stop()
    server.start()
    nc = await bus.connect(url, "measure")
    d3 = Daemon(nc, cfg)
    began = time.perf_counter()
    await d3.start()
    ready_s = time.perf_counter() - began
    while not await d3.store.filled(await d3.store.incarnation()):  # noqa: ASYNC110 - polls the broker
        await asyncio.sleep(0.1)
    refilled_s = time.perf_counter() - began
    print(f"N={n} trailers={info.state.messages} checkpoint(first after fill)={cp_running:.2f}s "
          f"checkpoint(next)={cp_again:.2f}s stop={stop_s:.2f}s start={start_s:.2f}s "
          f"checkpoint(after restart)={cp2:.2f}s audit verify (full)={full:.2f}s "
          f"audit verify --since={since:.2f}s broker restart: ready={ready_s:.2f}s "
          f"cache refilled (after ready)={refilled_s:.2f}s")
    await d3.stop()
    await nc.close()
    server.stop()
    shutil.rmtree(tmp, ignore_errors=True)


asyncio.run(main(int(sys.argv[1])))
