"""What another daemon replica buys: `improved bench` on a 3-node cluster with R3 streams.

`python benchmarks/replica_scaling.py [-n 2000] [-c 200] [--replicas 1,2,3] [--json FILE]`

For each replica count, a fresh cluster of three `nats-server` nodes on this machine (the
routes and JetStream of deploy/nats-cluster, `sync_interval: always`, no users: the bench's
own connections are not deploy/accounts.conf's), then `improved bench --nats <the three>
--replicas N --stream-replicas 3`: every stream and bucket of the loop R3, N daemons sharing
the inbound consumer. CPU per proposal counts the three nodes together as the broker and the
daemons together. What it leaves out: a network between the nodes (they share this
machine's cores with the daemons, the applier and the publisher, so a replica here competes
with the others for the same two cores: the figure is what another process buys, not what
another machine would).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

IMPROVED = [sys.executable, "-m", "improved.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """Three JetStream nodes routed to each other, each with a store of its own."""

    def __init__(self, base: Path):
        self.base = base
        self.client = [free_port() for _ in range(3)]
        self.routes = [free_port() for _ in range(3)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> str:
        server = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")
        routes = ", ".join(f"nats://127.0.0.1:{p}" for p in self.routes)
        for n in range(3):
            conf = self.base / f"n{n}.conf"
            conf.write_text(
                f"server_name: n{n}\nlisten: 127.0.0.1:{self.client[n]}\nmax_payload: 8MB\n"
                f"jetstream {{\n  store_dir: \"{self.base / f'n{n}'}\"\n"
                "  sync_interval: always\n}\n"
                f"cluster {{\n  name: bench\n  listen: 127.0.0.1:{self.routes[n]}\n"
                f"  routes: [{routes}]\n}}\n")
            log = open(self.base / f"n{n}.log", "ab")  # noqa: SIM115
            self.procs.append(subprocess.Popen([server, "-c", str(conf)], stdout=log,
                                               stderr=log, stdin=subprocess.DEVNULL))
        for port in self.client:
            deadline = time.monotonic() + 20
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), 0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"a node did not start: see {self.base}") from None
                    time.sleep(0.05)
        time.sleep(5)  # the meta leader elected
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.client)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def run(n: int, concurrency: int, replicas: int) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="improved-replicas-"))
    cluster = Cluster(base)
    try:
        url = cluster.start()
        out = base / "bench.json"
        argv = [*IMPROVED, "bench", "--nats", url, "-n", str(n), "-c", str(concurrency),
                "--replicas", str(replicas), "--stream-replicas", "3", "--json", str(out)]
        for proc in cluster.procs:
            argv += ["--broker-pid", str(proc.pid)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                              env={k: v for k, v in os.environ.items()
                                   if k != "IMPROVED_CONFIG"})
        if done.returncode != 0:
            raise RuntimeError(f"bench failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        r: dict[str, Any] = json.loads(out.read_text())
        return r
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=2000, help="proposals per run (2000)")
    p.add_argument("-c", type=int, default=200, help="in flight at once (200)")
    p.add_argument("--replicas", default="1,2,3", help="daemon counts to run (1,2,3)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args()
    rows = []
    print("daemons  proposals/s  CPU per proposal: daemons, broker (3 nodes), applier and "
          "clock, publisher (ms)   writes by the loop")
    for replicas in (int(x) for x in args.replicas.split(",")):
        r = run(args.n, args.c, replicas)
        cpu = r["cpu_ms_per_proposal"]
        row = {"replicas": replicas, "proposals_per_s": r["proposals_per_s"], "cpu": cpu,
               "writes": r["writes"]["fsyncd_loop_per_proposal"],
               "duplicate_applies": r["duplicate_applies"]}
        rows.append(row)
        print(f"{replicas:7}  {r['proposals_per_s']:11.1f}  {cpu.get('daemon', 0):.2f}, "
              f"{cpu.get('broker', float('nan')):.2f}, {cpu.get('applier and clock', 0):.2f}, "
              f"{cpu.get('publisher', 0):.2f}   {row['writes']:.2f} "
              f"(duplicate applies {r['duplicate_applies']})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
