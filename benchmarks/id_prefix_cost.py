"""What naming a proposal by a prefix of its id costs (issue 18.2). `python
benchmarks/id_prefix_cost.py 2000 20000` fills an embedded server per N through an in-process
daemon (as history_cost.py does), then measures the prefix lookup (`improved.cli.ids`: the
audit stream's chain subjects, listed by the server, matched here) in process, median of 5,
and `improved show` end to end with the full id and with the 12-digit prefix the demo prints.
Leaves nothing behind."""

from __future__ import annotations

import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from history_cost import fill  # type: ignore[import-not-found]

from improved.cli import ids
from improved.cli.common import configure_logging
from improved.runtime import bus
from improved.runtime.config import Config
from improved.runtime.daemon import Daemon

CLI = [sys.executable, "-m", "improved.cli"]


def show(url: str, pid: str) -> float:
    started = time.perf_counter()
    done = subprocess.run([*CLI, "show", "--nats", url, pid], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"improved show {pid} failed: {done.stderr}")
    return time.perf_counter() - started


async def measure(n: int) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="improved-ids-"))
    server = bus.EmbeddedServer(tmp / "nats", bus.free_port(), sync="2m")
    try:
        url = server.start()
        nc = await bus.connect(url, "measure")
        d = Daemon(nc, Config(data_dir=tmp / "d", checkpoint_interval_s=0))
        await d.start()
        await fill(nc, n)
        await d.stop()
        pid = next(p for _, p in await ids.with_prefix(nc, ""))
        row: dict[str, float] = {}
        for digits in (4, 12):
            times = []
            for _ in range(5):
                started = time.perf_counter()
                await ids.with_prefix(nc, pid[:digits])
                times.append(time.perf_counter() - started)
            row[f"prefix lookup, {digits} digits, in process (ms)"] = \
                statistics.median(times) * 1000
        await nc.close()
        row["`improved show` full id (s)"] = statistics.median(show(url, pid) for _ in range(3))
        row["`improved show` 12-digit prefix (s)"] = statistics.median(
            show(url, pid[:12]) for _ in range(3))
        return row
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


async def main(sizes: list[int]) -> None:
    rows = {n: await measure(n) for n in sizes}
    names = list(next(iter(rows.values())))
    width = max(len(name) for name in names)
    print(f"{'':{width}}  " + "  ".join(f"{n:>10,}" for n in sizes))
    for name in names:
        print(f"{name:{width}}  " + "  ".join(f"{rows[n][name]:>10.3f}" for n in sizes))


if __name__ == "__main__":
    configure_logging("warning", json_logs=True)
    asyncio.run(main([int(a) for a in sys.argv[1:]] or [2000, 20000]))
