"""The loop measured from outside: what a mesh sees, with nothing of the daemon's own code.

`python benchmarks/loop_from_outside.py [-n 3000] [--window 500] [--json FILE]`

One `nats-server` (JetStream, `sync_interval: always`, its monitoring port on), one daemon
started as an operator starts it (`improved run --nats URL`), and a trivial applier in a
process of its own (answers every ApplyOrder `ok` at once, writes nothing). This process
publishes N L0 proposals into JetStream (`improve.proposals.<svc>`, pipelined, at most
`--window` acknowledgements outstanding) and reads the audit stream back through an ordered
consumer: the clock runs from the first publish to the moment the last proposal's `applied`
trailer has been read back from `IMPROVE_AUDIT`, so every figure is durable. It speaks only
the wire of docs/protocol.md (a message on `improve.audit.<svc>.<id>` is one trailer, or a
commit `{"trailers": [...]}` of several); it imports nothing of `improved`.

In the same run, after the loop, on the same server: the broker's own pipelined ceiling,
the same window of JetStream publishes of the audit stream's mean message size to one
file-backed stream of one replica. The ratio is proposals/s over that ceiling's messages/s.

Also reported: the messages each stream gained per proposal (those to file storage are
fsync'd), the messages the daemon's connection sent and received per proposal (the
server's `/connz`: every exchange, acks and replies included), and each process's CPU per
proposal (`/proc/<pid>/stat`). What it leaves out: learn-back (the clock stops at the apply),
an owning service that persists anything, a network, a cluster, a second daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import nats
from nats.js import api

SVC = "outside"
APPLIER = """
import asyncio, json, nats
async def main():
    nc = await nats.connect(URL, name="outside-applier")
    async def answer(msg):
        order = json.loads(msg.data)
        await msg.respond(json.dumps({"ok": True, "applied_id": "a:" + order["proposal_id"][:12],
                                      "rollbackable": False}).encode())
    await nc.subscribe("SVC.improve.apply", cb=answer)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def proposal(i: int, t0: int) -> bytes:
    key = f"o{i}"
    return json.dumps({
        "service": SVC, "target_ref": f"rank:{key}", "change_class": "L0", "scope": "knowledge",
        "origin": {"actor": f"mcp:outside-{i % 97}:{i}", "service": SVC},
        "analyzer": {"id": "outside.tuner/1"},
        "summary": {"template_id": "adjust_rank", "args": {"item": key, "delta": 1}},
        "proposal_data": {"set": {"key": key, "value": i}}, "created_at": t0 + i,
    }).encode()


def trailers_of(data: bytes) -> list[dict[str, Any]]:
    """The trailers one audit message carries (docs/protocol.md, "Audit trailers")."""
    body = json.loads(data)
    if isinstance(body, dict) and isinstance(body.get("trailers"), list):
        return [t for t in body["trailers"] if isinstance(t, dict)]
    return [body] if isinstance(body, dict) else []


class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="improved-outside-"))
        self.port, self.http = free_port(), free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=log,
                                            stdin=subprocess.DEVNULL, env=env)

    def start(self) -> None:
        server = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")
        conf = self.tmp / "nats.conf"
        conf.write_text(f"host: 127.0.0.1\nport: {self.port}\nhttp: 127.0.0.1:{self.http}\n"
                        f"max_payload: 8MB\njetstream {{\n  store_dir: \"{self.tmp / 'js'}\"\n"
                        "  sync_interval: always\n}\n")
        self.spawn("server", [server, "-c", str(conf)])
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server did not start: see {self.tmp}") from None
                time.sleep(0.05)
        self.spawn("daemon", [sys.executable, "-m", "improved.cli", "--log-level", "warning",
                              "run", "--nats", self.url, "--data-dir", str(self.tmp / "daemon")],
                   env={k: v for k, v in os.environ.items() if k != "IMPROVED_CONFIG"})
        self.spawn("applier", [sys.executable, "-c", APPLIER.replace("URL", repr(self.url)).replace("SVC", SVC)])

    def stop(self) -> None:
        for name in ("applier", "daemon", "server"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def connz(self) -> dict[str, dict[str, int]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/connz?limit=1024") as r:
            doc = json.load(r)
        out: dict[str, dict[str, int]] = {}
        for c in doc.get("connections") or []:
            name = c.get("name") or f"cid{c['cid']}"
            agg = out.setdefault(name, {"in_msgs": 0, "out_msgs": 0})
            agg["in_msgs"] += c.get("in_msgs", 0)
            agg["out_msgs"] += c.get("out_msgs", 0)
        return out

    def cpu(self) -> dict[str, float]:
        return {**{n: cpu_s(p.pid) for n, p in self.procs.items()}, "publisher and reader":
                own_cpu_s()}

    async def ready(self, nc: nats.NATS) -> None:
        deadline = time.monotonic() + 60
        while True:
            try:
                await nc.request("improved.spec.get", b"{}", timeout=0.5)
                js = nc.jetstream()
                await js.consumer_info("IMPROVE_IN", "improved-loop")
                return
            except Exception:
                if time.monotonic() > deadline:
                    log = (self.tmp / "daemon.log").read_text()[-2000:]
                    raise RuntimeError(f"the daemon did not come up:\n{log}") from None
                await asyncio.sleep(0.2)

    async def loop(self, nc: nats.NATS) -> dict[str, Any]:
        js = nc.jetstream()
        n, t0 = self.args.n, int(time.time() * 1000)
        bodies = [proposal(i, t0) for i in range(n)]
        applied: set[str] = set()
        done = asyncio.Event()
        sizes: list[int] = []

        async def on_audit(msg: Any) -> None:
            if len(sizes) < 2000:
                sizes.append(len(msg.data))
            for t in trailers_of(msg.data):
                if t.get("to_stage") == "apply" and t.get("verdict") == "applied":
                    applied.add(t.get("proposal_id", ""))
            if len(applied) >= n:
                done.set()

        sub = await js.subscribe(f"improve.audit.{SVC}.*", cb=on_audit, ordered_consumer=True,
                                 deliver_policy=api.DeliverPolicy.NEW)
        profiler = self.profile()
        started = time.perf_counter()
        await self.pipelined(js, ((f"improve.proposals.{SVC}", body) for body in bodies))
        published = time.perf_counter() - started
        await asyncio.wait_for(done.wait(), self.args.timeout)
        elapsed = time.perf_counter() - started
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)
            profiler.wait(30)
        await sub.unsubscribe()
        return {"elapsed_s": elapsed, "published_s": published, "proposals_per_s": n / elapsed,
                "audit_message_bytes": round(sum(sizes) / max(len(sizes), 1))}

    async def pipelined(self, js: Any, messages: Iterable[tuple[str, bytes]]) -> None:
        """Publish to JetStream with at most `--window` acknowledgements outstanding."""
        window = asyncio.Semaphore(self.args.window)

        async def publish(subject: str, body: bytes) -> None:
            try:
                await js.publish(subject, body)
            finally:
                window.release()

        tasks = []
        for subject, body in messages:
            await window.acquire()
            tasks.append(asyncio.create_task(publish(subject, body)))
        await asyncio.gather(*tasks)

    def profile(self) -> subprocess.Popen[bytes] | None:
        """py-spy on the daemon while the loop runs (`--profile FILE`: raw samples)."""
        if not self.args.profile:
            return None
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        return subprocess.Popen([spy, "record", "-p", str(self.procs["daemon"].pid), "-r", "200",
                                 "-f", "raw", "-o", self.args.profile],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def ceiling(self, nc: nats.NATS, size: int) -> dict[str, Any]:
        js = nc.jetstream()
        await js.add_stream(name="CEILING", subjects=["ceiling.>"],
                            storage=api.StorageType.FILE, num_replicas=1)
        m = max(self.args.n * 3, 5000)
        payload = b"x" * size
        started = time.perf_counter()
        await self.pipelined(js, ((f"ceiling.{i % 1000}", payload) for i in range(m)))
        elapsed = time.perf_counter() - started
        await js.delete_stream("CEILING")
        return {"messages": m, "messages_per_s": m / elapsed, "message_bytes": size}

    async def streams(self, nc: nats.NATS) -> dict[str, tuple[int, bool]]:
        infos = await nc.jetstream().streams_info()
        return {i.config.name or "": (i.state.last_seq, i.config.storage == api.StorageType.FILE)
                for i in infos}

    async def run(self) -> dict[str, Any]:
        self.start()
        nc = await nats.connect(self.url, name="outside-publisher")
        try:
            await self.ready(nc)
            before_streams, before_conn, before_cpu = (await self.streams(nc), self.connz(),
                                                       self.cpu())
            result = await self.loop(nc)
            after_streams, after_conn, after_cpu = (await self.streams(nc), self.connz(),
                                                    self.cpu())
            n = self.args.n
            writes = {name: round((seq - before_streams.get(name, (0, file))[0]) / n, 2)
                      for name, (seq, file) in after_streams.items()
                      if seq > before_streams.get(name, (0, file))[0]}
            fsynced = sum(w for name, w in writes.items() if after_streams[name][1])
            conn = {name: {k: round((v - before_conn.get(name, {}).get(k, 0)) / n, 2)
                           for k, v in c.items()} for name, c in after_conn.items()}
            cpu = {name: round((after_cpu[name] - before_cpu[name]) * 1000 / n, 3)
                   for name in after_cpu}
            result["ceiling"] = await self.ceiling(nc, result["audit_message_bytes"])
            result["ratio_to_ceiling"] = (result["proposals_per_s"]
                                          / result["ceiling"]["messages_per_s"])
            result.update(n=n, writes_per_proposal=writes, fsynced_per_proposal=fsynced,
                          messages_per_proposal=conn, cpu_ms_per_proposal=cpu)
            return result
        finally:
            await nc.close()
            self.stop()


def report(r: dict[str, Any]) -> str:
    daemon = r["messages_per_proposal"].get("improved", {})
    lines = [
        f"proposals          {r['n']} L0, published in {r['published_s']:.2f} s",
        f"end to end         {r['proposals_per_s']:.1f} proposals/s (applied trailer read back "
        f"from IMPROVE_AUDIT; {r['elapsed_s']:.2f} s)",
        f"ceiling            {r['ceiling']['messages_per_s']:,.0f} messages/s pipelined, one "
        f"stream, {r['ceiling']['message_bytes']} B each (same run)",
        f"ratio              {r['ratio_to_ceiling']:.3f} proposals per ceiling message",
        f"fsync'd writes     {r['fsynced_per_proposal']:.2f} per proposal: "
        + ", ".join(f"{k} {v}" for k, v in sorted(r["writes_per_proposal"].items())),
        f"daemon exchanges   {daemon.get('in_msgs', 0)} sent, {daemon.get('out_msgs', 0)} "
        "received per proposal (server /connz)",
        "CPU per proposal   " + ", ".join(f"{k} {v} ms"
                                          for k, v in r["cpu_ms_per_proposal"].items()),
    ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=3000, help="L0 proposals (3000)")
    p.add_argument("--window", type=int, default=500,
                   help="publishes awaiting their acknowledgement at once (500)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--profile", metavar="FILE",
                   help="sample the daemon with py-spy while the loop runs (raw, to FILE)")
    args = p.parse_args()
    result = asyncio.run(Run(args).run())
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
