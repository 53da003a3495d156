"""What one tool call costs the reference tool runtime: `python benchmarks/tools_call_cost.py
[N=500]` starts an embedded server, makes the loop's streams as a daemon without accounts makes
them, and times N calls of each kind through `ToolRuntimeService.answer` (the decision, the
ledger, the trailer on the runtime's chain, the tool): a mounted L0 tool, an L4 tool under a
grant of its own, and an L4 tool under a session upgrade with a proof of its own. It prints,
per kind, the mean and the 50th/95th percentile in milliseconds and the requests the runtime
sent per call (JetStream API requests and publishes, counted on its connection).

What it leaves out: the agent's request/reply hop to the runtime (the same whatever the
runtime does), a cluster (where each request goes to the stream's leader, perhaps on another
node, and an R3 publish waits for a quorum), other load on the server, and contention between
replicas. One connection, one call at a time. Leaves nothing behind."""

from __future__ import annotations

import asyncio
import base64
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.client import connection
from improved.core import signing
from improved.core.tools import (
    Provider,
    Runtime,
    public_key_b64,
    sign_grant,
    sign_proof,
    sign_upgrade,
    upgrade_id,
)
from improved.protocol.model import to_json
from improved.runtime import bus
from improved.runtime.store import Store
from improved_reference.tool_runtime import ToolRuntimeService

OPERATOR = "operator:alice"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Counted:
    """Counts the requests a connection sends (nats-py sends every JetStream API call and
    every JetStream publish as one request)."""

    def __init__(self, nc):
        self.n = 0
        inner = nc.request

        async def request(*args, **kw):
            self.n += 1
            return await inner(*args, **kw)

        nc.request = request


async def measure(n: int) -> dict[str, tuple[float, float, float, float]]:
    tmp = Path(tempfile.mkdtemp(prefix="improved-calls-"))
    server = bus.EmbeddedServer(tmp / "nats", bus.free_port(), sync="2m")
    try:
        url = server.start()
        nc = await connection.connect(url, "measure-calls")
        await Store(nc).ensure()
        key = Ed25519PrivateKey.generate()
        session = Ed25519PrivateKey.generate()
        public = base64.b64encode(signing.raw_public(key.public_key())).decode()
        rt = Runtime("agent", trust=signing.TrustStore.from_config({OPERATOR: public}))
        rt.register(Provider("read", "L0", "", lambda args: "read", "1"))
        deploy = rt.register(Provider("deploy", "L4", "", lambda args: "ran", "1"))
        service = ToolRuntimeService(nc, rt, Ed25519PrivateKey.generate())
        await service.start()
        counted = Counted(nc)
        up = sign_upgrade(key, OPERATOR, "agent", "s-1", "bench", now_ms(), 3_600_000,
                          nonce=secrets.token_hex(16), session_key=public_key_b64(session),
                          classes=["L4"])

        def mounted(i: int) -> dict:
            return {"tool": "read", "args": {"n": i}}

        def granted(i: int) -> dict:
            args = {"n": i}
            return {"tool": "deploy", "args": args, "grant": sign_grant(
                key, OPERATOR, deploy, "deploy", args, "bench", now_ms(),
                nonce=secrets.token_hex(16), runtime="agent")}

        def upgraded(i: int) -> dict:
            args = {"n": i}
            return {"tool": "deploy", "args": args, "session": "s-1", "upgrade": up,
                    "proof": sign_proof(session, "agent", "deploy", args, upgrade_id(up),
                                        now_ms(), nonce=secrets.token_hex(16))}

        out = {}
        for kind, make in (("mounted L0", mounted), ("granted L4", granted),
                           ("upgraded L4", upgraded)):
            bodies = [to_json(make(i)) for i in range(n)]  # signed before the clock starts
            await service.answer(bodies[0])  # warm
            took, sent = [], counted.n
            for body in bodies[1:]:
                started = time.perf_counter()
                reply = msgspec.json.decode(await service.answer(body))
                took.append((time.perf_counter() - started) * 1000)
                assert reply.get("ok") is True, reply
            q = statistics.quantiles(took, n=20)
            out[kind] = (statistics.fmean(took), q[9], q[18], (counted.n - sent) / len(took))
        await service.stop()
        await connection.close(nc)
        return out
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    print(f"{n} calls of each kind, one at a time, on an embedded server")
    print(f"{'call':<13} {'mean ms':>8} {'p50 ms':>8} {'p95 ms':>8} {'requests':>9}")
    for kind, (mean, p50, p95, requests) in asyncio.run(measure(n)).items():
        print(f"{kind:<13} {mean:>8.2f} {p50:>8.2f} {p95:>8.2f} {requests:>9.1f}")


if __name__ == "__main__":
    main()
