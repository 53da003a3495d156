"""Start, stop, checkpoint and review cost at N applied L0 proposals of history, with N/100
L2 proposals waiting for an operator (no cost may grow with history: issue 16).
`python benchmarks/history_cost.py 20000` fills an embedded server through an in-process
daemon, then times a checkpoint, a second one, `improved review` (its query, in process), a
stop, a start on the same data directory and a checkpoint after it, then `improved audit
verify` in full and `--since` the last checkpoint, then a broker restart (the memory state
cache lost): start → ready, `review` right after ready (and where it read from), and until the
records are known whole (a refill after ready, if the daemon did one). With `memory` after N
the retained records are in memory storage, so the restart loses them and the daemon refills
them (and the review index) from the chains. sync 2m: the fill is not what is measured."""

import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from improved.cli.queries import review_view
from improved.client.sdk import MeshClient
from improved.core.policy import Policy
from improved.protocol.model import ApplyResult
from improved.runtime import bus
from improved.runtime.config import Config
from improved.runtime.daemon import Daemon
from improved.testing import rank_proposal, skill_proposal


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


async def review(url: str) -> tuple[float, int, str]:
    """`improved review`'s query: (seconds, proposals listed, where it read them)."""
    started = time.perf_counter()
    queue, source = await review_view(url, Policy())
    return time.perf_counter() - started, len(queue), source


async def main(n: int, records: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="measure-"))
    server = bus.EmbeddedServer(tmp / "nats", bus.free_port(), sync="2m")
    url = server.start()
    nc = await bus.connect(url, "measure")
    cfg = Config(data_dir=tmp / "d", checkpoint_interval_s=0, records_storage=records)
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
    waiting = n // 100
    await asyncio.gather(*(client.publish(skill_proposal("m", name=f"s{j}"))
                           for j in range(waiting)))
    while True:
        info = await nc.jetstream().consumer_info("IMPROVE_IN", "improved-loop")
        if info.num_pending == 0 and info.num_ack_pending == 0:
            break
        await asyncio.sleep(1)
    await asyncio.sleep(2)
    cp_running = await timed(d.engine.checkpoint(d._checkpoint_key))
    cp_again = await timed(d.engine.checkpoint(d._checkpoint_key))
    review_s, listed, source = await review(url)
    assert listed == waiting, (listed, waiting)
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
    refills = 0
    republish_all = d3.engine.republish_all

    async def counted(*args, **kw):
        nonlocal refills
        refills += 1
        return await republish_all(*args, **kw)

    d3.engine.republish_all = counted  # type: ignore[method-assign]
    began = time.perf_counter()
    await d3.start()
    ready_s = time.perf_counter() - began
    review2_s, listed2, source2 = await review(url)
    while not await d3.store.filled():  # noqa: ASYNC110 - polls the broker
        await asyncio.sleep(0.1)
    whole_s = time.perf_counter() - began
    review3_s, listed3, source3 = await review(url)
    assert listed2 == listed3 == waiting, (listed2, listed3, waiting)
    print(f"N={n} records={records} waiting={waiting} trailers={info.state.messages} "
          f"checkpoint(first after fill)={cp_running:.2f}s checkpoint(next)={cp_again:.2f}s "
          f"review={review_s:.2f}s ({source}) stop={stop_s:.2f}s start={start_s:.2f}s "
          f"checkpoint(after restart)={cp2:.2f}s audit verify (full)={full:.2f}s "
          f"audit verify --since={since:.2f}s broker restart: ready={ready_s:.2f}s "
          f"review right after ready={review2_s:.2f}s ({source2}) "
          f"records whole={whole_s:.2f}s after start (refills={refills}) "
          f"review then={review3_s:.2f}s ({source3})")
    await d3.stop()
    await nc.close()
    server.stop()
    shutil.rmtree(tmp, ignore_errors=True)


asyncio.run(main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "file"))
