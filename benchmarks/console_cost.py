"""What the console's pages cost at N applied L0 proposals (and N/100 L2 waiting): `python
benchmarks/console_cost.py 2000 20000` fills an embedded server per N as history_cost.py does,
signs a checkpoint, proposes 100 more after it, then starts `improved console` on the daemon's
data directory (as an operator on its host) and times, over HTTP as a browser asks:

- `/audit` on load (the log verified since the last checkpoint), the median of 5;
- `/` (the newest 50 of every retained proposal) and `/mesh`, the median of 5;
- the whole log's verify asked for by the page's POST, until the page shows its verdict.

Prints one table, the sizes side by side. Leaves nothing behind."""

from __future__ import annotations

import asyncio
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from history_cost import fill  # type: ignore[import-not-found]
from improved.client import connection
from improved.client.config import Config
from improved.client.sdk import MeshClient
from improved.runtime import bus
from improved.runtime.daemon import Daemon
from improved.testing import skill_proposal

CLI = [sys.executable, "-m", "improved.cli"]


def fetch(url: str, form: dict[str, str] | None = None) -> str:
    data = urllib.parse.urlencode(form).encode() if form is not None else None
    with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=3600) as r:
        return str(r.read().decode())


def median_s(url: str, times: int = 5) -> float:
    spent = []
    for _ in range(times):
        started = time.perf_counter()
        fetch(url)
        spent.append(time.perf_counter() - started)
    return statistics.median(spent)


def pages(base: str) -> dict[str, float]:
    row = {"`/audit` on load: verified since the checkpoint (s)": median_s(f"{base}audit"),
           "`/` the newest 50 proposals, with the mesh line (s)": median_s(base),
           "`/mesh` (s)": median_s(f"{base}mesh")}
    audit = fetch(f"{base}audit")
    since = re.search(r'<p id=since class="verdict [a-z]+">([A-Z ]+)</p>', audit)
    token = re.search(r'name=csrf value="([^"]+)"', audit)
    assert since and since.group(1) == "OK" and token, audit[-2000:]
    started = time.perf_counter()
    fetch(f"{base}audit/verify", {"csrf": token.group(1)})
    while "id=full-lines" not in (page := fetch(f"{base}audit")):
        time.sleep(0.5)
    row["whole-log verify on request, until its verdict shows (s)"] = \
        time.perf_counter() - started
    full = re.search(r'<p id=full class="verdict [a-z]+">([A-Z ]+)</p>', page)
    assert full and full.group(1) == "OK", page[-2000:]
    return row


def served(url: str, config: Path) -> dict[str, float]:
    """`improved console` started on `config`, its pages timed, then stopped."""
    proc = subprocess.Popen([*CLI, "console", "--nats", url, "--config", str(config),
                             "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        found = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert found, line
        return pages(found.group(0))
    finally:
        proc.terminate()
        proc.wait(15)


async def measure(n: int) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="improved-console-"))
    server = bus.EmbeddedServer(tmp / "nats", bus.free_port(), sync="2m")
    try:
        url = server.start()
        nc = await connection.connect(url, "measure")
        cfg = Config(data_dir=tmp / "d", checkpoint_interval_s=0)
        d = Daemon(nc, cfg)
        await d.start()
        await fill(nc, n)
        await d.engine.checkpoints.checkpoint(d._checkpoint_key)
        client = MeshClient(nc, "m")
        await asyncio.gather(*(client.publish(skill_proposal("m", name=f"after{j}"))
                               for j in range(100)))
        await asyncio.sleep(3)
        await d.stop()
        await nc.close()
        config = tmp / "console.toml"
        config.write_text(f'data_dir = "{cfg.data_dir}"\n')
        return await asyncio.to_thread(served, url, config)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


async def main(sizes: list[int]) -> None:
    rows = {n: await measure(n) for n in sizes}
    names = list(next(iter(rows.values())))
    width = max(len(name) for name in names)
    print(f"{'proposals':<{width}} " + " ".join(f"{n:>10,}" for n in sizes))
    for name in names:
        print(f"{name:<{width}} " + " ".join(f"{rows[n][name]:>10.2f}" for n in sizes))


if __name__ == "__main__":
    asyncio.run(main([int(a) for a in sys.argv[1:] if a.isdigit()] or [2000]))
