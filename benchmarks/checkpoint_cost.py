"""What the loop's throughput figures leave out: the daemon reads every trailer back and
verifies it once more at its next checkpoint (every `checkpoint_interval_s`, and at stop), and
each checkpoint also scrubs as many older trailers again (`client.checkpointing.scrub`). That
is CPU the daemon spends per proposal, later.

`python benchmarks/checkpoint_cost.py 5000` starts an embedded server (sync 2m: the fill is
not what is measured) and an in-process daemon (checkpoint interval 300 s, so no checkpoint
runs by itself), then, `--rounds` times: fills N applied L0 proposals (and N/100 waiting L2),
and times one checkpoint — the process's CPU, and within it the read and check of what is new
(`verify_since`) and the scrub. The first round's scrub has nothing covered yet to re-read;
from the second on a checkpoint is what a daemon that runs for long pays. Leaves nothing
behind.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from improved.client import checkpointing, connection
from improved.client.config import Config
from improved.runtime import bus
from improved.runtime.daemon import Daemon

sys.path.insert(0, str(Path(__file__).parent))
from history_cost import fill  # noqa: E402


def _timed(into: dict[str, float], name: str,
           step: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def run(*args: Any, **kwargs: Any) -> Any:
        started = time.process_time()
        try:
            return await step(*args, **kwargs)
        finally:
            into[name] = into.get(name, 0.0) + time.process_time() - started
    return run


async def measure(n: int, rounds: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="improved-checkpoint-cost-"))
    server = bus.EmbeddedServer(tmp / "nats", bus.free_port(), sync="2m")
    try:
        url = server.start()
        nc = await connection.connect(url, "checkpoint-cost")
        daemon = Daemon(nc, Config(data_dir=tmp / "daemon", checkpoint_interval_s=300))
        await daemon.start()
        await daemon.settled.wait()
        print(f"{'round':>5} {'proposals':>9} {'checkpoint CPU (s)':>18} "
              f"{'ms/proposal':>11} {'verify new (s)':>14} {'scrub (s)':>9}")
        verify, scrub = checkpointing.verify_since, checkpointing.scrub
        try:
            for r in range(1, rounds + 1):
                await fill(nc, n)
                parts: dict[str, float] = {}
                checkpointing.verify_since = _timed(parts, "verify", verify)
                checkpointing.scrub = _timed(parts, "scrub", scrub)
                started = time.process_time()
                problem = await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key)
                cpu = time.process_time() - started
                checkpointing.verify_since, checkpointing.scrub = verify, scrub
                if problem:
                    raise SystemExit(f"the checkpoint found a problem: {problem}")
                print(f"{r:>5} {n:>9} {cpu:>18.2f} {cpu / n * 1000:>11.3f} "
                      f"{parts.get('verify', 0):>14.2f} {parts.get('scrub', 0):>9.2f}")
        finally:
            checkpointing.verify_since, checkpointing.scrub = verify, scrub
            await daemon.stop()
            await nc.close()
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", type=int, nargs="?", default=5000,
                        help="L0 proposals filled before each checkpoint (5000)")
    parser.add_argument("--rounds", type=int, default=3, help="fills and checkpoints (3)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(measure(args.n, args.rounds))


if __name__ == "__main__":
    main()
