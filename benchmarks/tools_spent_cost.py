"""What the tool runtimes' spent marks (`IMPROVE_TOOLS_SPENT`) keep per granted call. `python
benchmarks/tools_spent_cost.py 2000 [window=SECONDS]` runs N calls of an L4 tool on an
autonomous runtime, each under a grant of its own living SECONDS (default 1) with a margin of
one second for the replicas' clocks, against an embedded server, and prints the marks and bytes
the stream holds per call right after the calls, and again once window + margin (and a few
seconds for the server's sweep) have passed; the stream's sentinel, one message kept for good,
is not counted. Leaves nothing behind."""

from __future__ import annotations

import asyncio
import base64
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.core import signing
from improved.core.tools import Provider, Runtime, grant_token, sign_grant
from improved.protocol import subjects as S
from improved.runtime import bus
from improved.runtime.provisioning import tools_ledger_configs
from improved.runtime.store import Store
from improved_reference.tool_gate import ToolGate
from improved_reference.tool_runtime import JetStreamLedger

STREAM = S.STREAM_TOOLS_SPENT
MARGIN_MS = 1000
SWEEP_S = 3  # how long past the last TTL the server is given to remove the marks


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def measure(n: int, window_s: float) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="improved-tools-"))
    server = bus.EmbeddedServer(tmp / "nats", bus.free_port(), sync="2m")
    try:
        url = server.start()
        nc = await bus.connect(url, "measure-tools")
        js = nc.jetstream()
        key = Ed25519PrivateKey.generate()
        public = base64.b64encode(signing.raw_public(key.public_key())).decode()
        rt = Runtime("agent", trust=signing.TrustStore.from_config({"operator:alice": public}),
                     spent_margin_ms=MARGIN_MS)
        deploy = Provider("deploy", "L4", "", lambda args: "ran", "1")
        token = rt.register(deploy)
        assert token == grant_token(deploy)
        for cfg in tools_ledger_configs():
            await Store(nc).ensure_stream(cfg)  # the spent marks' sentinel first
        sentinel = (await js.stream_info(STREAM)).state
        gate = ToolGate(rt, await JetStreamLedger.open(js, "agent"))
        started = time.monotonic()
        for i in range(n):
            args = {"n": i}
            env = sign_grant(key, "operator:alice", token, "deploy", args, "bench", now_ms(),
                             int(window_s * 1000), nonce=secrets.token_hex(16))
            reply = await gate.invoke("deploy", args, env, now_ms())
            assert reply.get("ok") is True, reply
        took = time.monotonic() - started
        state = (await js.stream_info(STREAM)).state
        row = {"calls per second": n / took,
               "marks kept per call, after the calls": (state.messages - 1) / n,
               "bytes kept per call, after the calls": (state.bytes - sentinel.bytes) / n}
        await asyncio.sleep(window_s + MARGIN_MS / 1000 + SWEEP_S)
        state = (await js.stream_info(STREAM)).state
        row["marks kept per call, once window + margin passed"] = (state.messages - 1) / n
        row["bytes kept per call, once window + margin passed"] = \
            (state.bytes - sentinel.bytes) / n
        await nc.close()
        return row
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    window_s = 1.0
    for arg in sys.argv[2:]:
        if arg.startswith("window="):
            window_s = float(arg.removeprefix("window="))
    row = asyncio.run(measure(n, window_s))
    print(f"{n} granted calls, spent marks with their TTL ({window_s:g} s window + "
          f"{MARGIN_MS / 1000:g} s)")
    for what, value in row.items():
        print(f"  {what}: {value:.2f}")


if __name__ == "__main__":
    main()
