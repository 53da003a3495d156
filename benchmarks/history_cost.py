"""What grows with history (issue 16): start, stop, checkpoint, review, verify and a broker
restart at N applied L0 proposals, with N/100 L2 proposals waiting for an operator.
`python benchmarks/history_cost.py 2000 20000` fills an embedded server per N through an
in-process daemon (sync 2m: the fill is not what is measured), then, each as an operator would
see it, in a process of its own:

- checkpoint: the first after the fill, the next one, and one after a restart (in process);
- `improved run` on the same data directory: spawn → "ready" (Python's imports included),
  peak RSS when ready and after its after-ready work, and SIGTERM → exit (the final
  checkpoint included);
- `improved review`, `improved audit verify` (full) and `--since`: wall time and peak RSS;
- naming a proposal by a prefix of its id (`cli.ids`): the lookup in process, and `improved
  show` by full id and by the 12 digits the demo prints;
- sealing the whole log as one epoch, `improved audit archive --remove` of it, and `improved
  audit verify --archive` after it (every epoch checked exactly against its seal);
- a broker restart: `improved run` spawn → ready again (on the archived stream), `review`
  right after ready (and where it read from: the review index, or every chain), and until the
  records are known whole (whether the daemon refilled them: the retained records are in
  memory storage, the default, so the restart loses them; with `file` among the arguments
  they are kept); the refill itself, in process, from the chains after the seal and, as
  before, from every chain;
- bytes per proposal: every stream's bytes on disk over N.
Prints one table, the sizes side by side. Leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from improved.cli import ids
from improved.cli.queries import review_view
from improved.client import connection, indexing
from improved.client.config import Config
from improved.client.keys import load_key
from improved.client.sdk import MeshClient
from improved.core.policy import Policy
from improved.protocol.model import ApplyResult
from improved.runtime import archive, bus
from improved.runtime.daemon import Daemon
from improved.runtime.store import Store
from improved.testing import rank_proposal, skill_proposal

CLI = [sys.executable, "-m", "improved.cli"]


def run_cli(*args: str) -> tuple[float, int, str]:
    """(seconds, peak RSS in MB, stdout) of one `improved` command; it must succeed."""
    started = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "maxrss=%M", *CLI, *args],
                          capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"improved {' '.join(args)} failed: {done.stdout}{done.stderr}")
    rss = int(done.stderr.rsplit("maxrss=", 1)[1].split()[0]) // 1024
    return seconds, rss, done.stdout


def peak_rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    return 0


async def daemon_process(url: str, data_dir: Path, settle_s: float = 3.0, config: str = "",
                         during=None) -> dict[str, float]:
    """`improved run` against `url`: spawn → ready, peak RSS then and after `settle_s` of its
    after-ready work (or `during(started)`, awaited once it is ready), and SIGTERM → exit;
    `refills`: whether it logged a refill of the records."""
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *CLI, "run", "--nats", url, "--data-dir", str(data_dir), "--metrics-port", "0",
        *(("--config", config) if config else ()),
        stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL)
    assert proc.stderr is not None
    while True:
        line = await asyncio.wait_for(proc.stderr.readline(), 600)
        if not line:
            raise SystemExit("improved run exited before ready")
        if b"improved: ready" in line:
            break
    ready_s = time.perf_counter() - started
    rss_ready = peak_rss_mb(proc.pid)

    refills = 0

    async def drain() -> None:
        nonlocal refills
        while line := await proc.stderr.readline():
            refills += b"refilled from the audit chains" in line

    draining = asyncio.create_task(drain())
    seen = await during(started) if during is not None else {}
    if during is None:
        await asyncio.sleep(settle_s)
    rss_settled = peak_rss_mb(proc.pid)
    stopping = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    await proc.wait()
    stop_s = time.perf_counter() - stopping
    await draining
    return {"ready_s": ready_s, "rss_ready": rss_ready, "rss_settled": rss_settled,
            "stop_s": stop_s, "refills": refills, **seen}


async def timed(step) -> float:
    started = time.perf_counter()
    await step
    return time.perf_counter() - started


async def fill(nc, n: int) -> None:
    client = MeshClient(nc, "m")

    async def applier(order):
        return ApplyResult(ok=True, applied_id=order.proposal_id[:8])

    sub = await client.serve_apply(applier)
    for i in range(0, n, 500):
        await asyncio.gather(*(client.publish(rank_proposal("m", key=f"k{j}"))
                               for j in range(i, min(n, i + 500))))
    await asyncio.gather(*(client.publish(skill_proposal("m", name=f"s{j}"))
                           for j in range(n // 100)))  # waiting for an operator
    while True:
        info = await nc.jetstream().consumer_info("IMPROVE_IN", "improved-loop")
        if info.num_pending == 0 and info.num_ack_pending == 0:
            break
        await asyncio.sleep(1)
    await asyncio.sleep(2)
    await sub.unsubscribe()


async def seal_and_archive(url: str, cfg: Config, tmp: Path, n: int) -> dict[str, float]:
    """Seal everything the last checkpoint covered as one epoch (as the daemon does when one
    is due), then export and remove it with `improved audit archive --remove`."""
    nc = await connection.connect(url, "measure-seal")
    store = Store(nc)
    store.signer = load_key(cfg.data_dir / "checkpoint.pem")
    kept = json.loads((cfg.data_dir / "last-checkpoint.json").read_text())
    row: dict[str, float] = {}
    started = time.perf_counter()
    seal = await archive.seal_if_due(store, store.signer, "improved:measure", kept["last_seq"],
                                     int(time.time() * 1000), 1, 1e6, 0.0, {kept["keyid"]})
    row["seal an epoch of the whole log (s)"] = time.perf_counter() - started
    assert seal is not None
    # what a daemon refills when its records are lost (memory storage across a broker
    # restart): the chains after the last seal, against every chain as before
    d = Daemon(nc, cfg)
    await d.start()
    start, _ = await indexing.chains_start(d.store, {kept["keyid"]})
    row["refill of lost records: the chains after the seal, in process (s)"] = await timed(
        d.engine.publisher.republish_all(start))
    row["  … every chain of the log, as before (s)"] = await timed(
        d.engine.publisher.republish_all(1))
    await d.stop()
    config = tmp / "improved.toml"
    config.write_text(f'data_dir = "{cfg.data_dir}"\n')
    seconds, rss, _ = run_cli("audit", "archive", str(tmp / "archive"), "--remove", "--nats",
                              url, "--config", str(config))
    row["`audit archive --remove` of it (s)"] = seconds
    row["`audit archive` peak RSS (MB)"] = rss
    seconds, rss, _ = run_cli("audit", "verify", "--archive", str(tmp / "archive"), "--nats",
                              url, "--config", str(config))
    row["`audit verify --archive`, after it (s)"] = seconds
    row["`audit verify --archive` peak RSS (MB)"] = rss
    total = sum(info.state.bytes for info in await nc.jetstream().streams_info())
    row["bytes on disk per proposal, after the archive"] = total / n
    await nc.close()
    return row


async def after_restart(url: str, started: float) -> dict[str, float]:
    """While a daemon runs after a broker restart: `review` right after ready (its query, in
    process, and where it read from), and when the records are known whole again."""
    began = time.perf_counter()
    queue, source = await review_view(url, Policy())
    seen = {"review_s": time.perf_counter() - began, "listed": len(queue),
            "from_index": float(source == "index")}
    nc = await connection.connect(url, "measure-restart")
    store = Store(nc)
    while not await store.filled():  # noqa: ASYNC110 - polls the broker
        await asyncio.sleep(0.1)
    seen["whole_s"] = time.perf_counter() - started
    await nc.close()
    return seen


async def purged_review(url: str, config: Path, n: int) -> float:
    """`improved review` once the review index is purged (a subject-filtered purge, as any bus
    participant may ask for): it falls short of the checkpoint's count and reads the chains
    after the last seal instead; every waiting proposal is still listed."""
    nc = await connection.connect(url, "measure-purge")
    await nc.jetstream().purge_stream("IMPROVE_RECORDS", subject="improve.review.m.*")
    await nc.close()
    seconds, _, out = run_cli("review", "--nats", url, "--config", str(config),
                              "--format", "json")
    assert len(json.loads(out)) == n // 100, (out[:200], n)
    return seconds


async def measure(n: int, records: str) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="improved-history-"))
    server = bus.EmbeddedServer(tmp / "nats", bus.free_port(), sync="2m")
    config = tmp / "records.toml"
    config.write_text(f'records_storage = "{records}"\n')
    try:
        url = server.start()
        nc = await connection.connect(url, "measure")
        cfg = Config(data_dir=tmp / "d", checkpoint_interval_s=0, records_storage=records)
        keyed = tmp / "keyed.toml"  # an operator's config on the daemon's host: its key
        keyed.write_text(f'data_dir = "{cfg.data_dir}"\n')
        d = Daemon(nc, cfg)
        await d.start()
        await d.settled.wait()  # its work after ready done: the fill's checkpoint alone is timed
        await fill(nc, n)
        row: dict[str, float] = {}
        row["checkpoint, first after the fill (s)"] = await timed(
            d.engine.checkpoints.checkpoint(d._checkpoint_key))
        row["checkpoint, the next (s)"] = await timed(d.engine.checkpoints.checkpoint(d._checkpoint_key))
        await d.stop()
        d2 = Daemon(nc, cfg)
        await d2.start()
        row["checkpoint after a restart (s)"] = await timed(
            d2.engine.checkpoints.checkpoint(d2._checkpoint_key))
        row["start-up check of both indexes against the checkpoint (s)"] = await timed(
            d2.index_checks.check_indexes())
        row["index members read from every chain, no seal (the upgrade's count) (s)"] = \
            await timed(indexing.from_chains(d2.store, 1, None, None, Policy()))
        await d2.stop()
        js = nc.jetstream()
        per_stream = {info.config.name: info.state.bytes for info in await js.streams_info()}
        total = sum(per_stream.values())
        trailers = (await js.stream_info("IMPROVE_AUDIT")).state.messages
        pid = (await ids.with_prefix(nc, ""))[0][1]
        row["prefix lookup of a proposal id, in process (ms)"] = 1000 * await timed(
            ids.with_prefix(nc, pid[:12]))
        await nc.close()

        run = await daemon_process(url, cfg.data_dir, config=str(config))
        row["start → ready, `improved run` (s)"] = run["ready_s"]
        row["peak RSS at ready (MB)"] = run["rss_ready"]
        row["peak RSS after its after-ready work (MB)"] = run["rss_settled"]
        row["stop: SIGTERM → exit (s)"] = run["stop_s"]
        row["`improved show` by full id (s)"] = run_cli("show", "--nats", url, pid)[0]
        row["`improved show` by a 12-digit prefix (s)"] = run_cli("show", "--nats", url,
                                                                  pid[:12])[0]
        seconds, rss, _ = run_cli("review", "--nats", url)
        row["`improved review` (s)"], row["`improved review` peak RSS (MB)"] = seconds, rss
        row["  … with the daemon's key (signatures checked) (s)"] = run_cli(
            "review", "--nats", url, "--config", str(keyed))[0]
        anchor = str(cfg.data_dir / "last-checkpoint.json")
        seconds, rss, _ = run_cli("audit", "verify", "--nats", url, "--checkpoint", anchor)
        row["`audit verify`, full (s)"], row["`audit verify`, full, peak RSS (MB)"] = seconds, rss
        row["`audit verify --since` (s)"] = run_cli("audit", "verify", "--since", "--nats", url,
                                                    "--checkpoint", anchor)[0]
        row.update(await seal_and_archive(url, cfg, tmp, n))
        server.stop()
        server.start()
        run = await daemon_process(url, cfg.data_dir, config=str(config),
                                   during=lambda started: after_restart(url, started))
        row["broker restart: start → ready (s)"] = run["ready_s"]
        row["  `review` right after ready (s)"] = run["review_s"]
        row["  … read from the review index (1) or every chain (0)"] = run["from_index"]
        row["  records known whole, after the spawn (s)"] = run["whole_s"]
        row["  refills of the records"] = run["refills"]
        assert run["listed"] == n // 100, (run["listed"], n)
        row["`improved review`, its index purged: the chains after the seal (s)"] = \
            await purged_review(url, keyed, n)
        row["trailers"] = trailers
        row["bytes on disk per proposal, all streams"] = total / n
        for name in sorted(per_stream):
            row[f"  of which {name}"] = per_stream[name] / n
        return row
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


async def main(sizes: list[int], records: str) -> None:
    rows = {n: await measure(n, records) for n in sizes}
    names = list(next(iter(rows.values())))
    width = max(len(name) for name in names)
    print(f"{'proposals':<{width}} " + " ".join(f"{n:>10,}" for n in sizes))
    for name in names:
        cells = []
        for n in sizes:
            value = rows[n][name]
            cells.append(f"{value:>10.2f}" if isinstance(value, float) and value < 1000
                         else f"{value:>10,.0f}")
        print(f"{name:<{width}} " + " ".join(cells))


if __name__ == "__main__":
    asyncio.run(main([int(a) for a in sys.argv[1:] if a.isdigit()] or [2000],
                     "file" if "file" in sys.argv[1:] else "memory"))
