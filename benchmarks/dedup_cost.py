"""What the dedup bucket (`improved_dedup`, dedup_key → the newest proposal under it) keeps and
writes per proposal. `python benchmarks/dedup_cost.py 2000 [ttl=SECONDS]` fills an embedded
server through an in-process daemon with history_cost's fill (N applied L0 proposals, each
under a dedup_key of its own, and N/100 L2 proposals waiting for an operator), with
`records_ttl_days` = 0 (nothing expires: the behaviour before dedup heads had a TTL) and with
a TTL of SECONDS (default 2), and prints, for each:

- writes to the bucket per proposal (the bucket's stream sequence over N: every put, create,
  update and TTL rewrite takes one);
- keys and bytes the bucket holds per proposal right after the fill, and again once the TTL
  has run out (SECONDS and a margin later; a TTL over a minute is not waited out, so the
  heads of closed proposals are still there, each with its Nats-TTL header).
Leaves nothing behind."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.history_cost import fill
from improved.client import connection
from improved.client.config import Config
from improved.protocol import subjects as S
from improved.runtime import bus
from improved.runtime.daemon import Daemon

STREAM = f"KV_{S.BUCKET_DEDUP}"
MAX_WAIT_S = 60  # a longer TTL is not waited out: what the bucket holds before it runs out


async def measure(n: int, ttl_s: float) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="improved-dedup-"))
    server = bus.EmbeddedServer(tmp / "nats", bus.free_port(), sync="2m")
    try:
        url = server.start()
        nc = await connection.connect(url, "measure-dedup")
        cfg = Config(data_dir=tmp / "d", checkpoint_interval_s=0,
                     records_ttl_days=ttl_s / 86400)
        d = Daemon(nc, cfg)
        await d.start()
        await fill(nc, n)
        js = nc.jetstream()
        state = (await js.stream_info(STREAM)).state
        row = {"writes to the bucket per proposal": state.last_seq / n,
               "keys kept per proposal, after the fill": state.messages / n,
               "bytes kept per proposal, after the fill": state.bytes / n}
        if ttl_s and ttl_s <= MAX_WAIT_S:
            await asyncio.sleep(ttl_s + 3)
        state = (await js.stream_info(STREAM)).state
        row["keys kept per proposal, once the TTL has run out"] = state.messages / n
        row["bytes kept per proposal, once the TTL has run out"] = state.bytes / n
        await d.stop()
        await nc.close()
        return row
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


async def main(n: int, ttl_s: float) -> None:
    rows = {"no TTL (records_ttl_days = 0)": await measure(n, 0),
            f"TTL {ttl_s:g} s": await measure(n, ttl_s)}
    width = max(len(name) for row in rows.values() for name in row)
    print(f"{f'{n:,} proposals':<{width}} " + " ".join(f"{c:>30}" for c in rows))
    for name in next(iter(rows.values())):
        cells = [f"{row[name]:>30.2f}" for row in rows.values()]
        print(f"{name:<{width}} " + " ".join(cells))


if __name__ == "__main__":
    args = sys.argv[1:]
    ttl = next((float(a.split("=", 1)[1]) for a in args if a.startswith("ttl=")), 2.0)
    asyncio.run(main(next((int(a) for a in args if a.isdigit()), 2000), ttl))
