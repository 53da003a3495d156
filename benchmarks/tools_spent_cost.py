"""What the tool ledger (`improved_tools`) keeps per granted call. `python
benchmarks/tools_spent_cost.py 2000 [window=SECONDS]` runs N calls of an L4 tool on an
autonomous runtime, each under a grant of its own living SECONDS (default 1) with a margin of
one second for the replicas' clocks, against an embedded server: once with spent keys kept for
good (the behaviour before they carried a TTL) and once with their TTL, and prints, for each,
the keys and bytes the bucket holds per call right after the calls, and again once window +
margin (and a few seconds for the server's sweep) have passed. Leaves nothing behind."""

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
from improved_reference.tool_runtime import JetStreamLedger

STREAM = f"KV_{S.BUCKET_TOOLS}"
MARGIN_MS = 1000
SWEEP_S = 3  # how long past the last TTL the server is given to remove the keys


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def measure(n: int, window_s: float, ttl: bool) -> dict[str, float]:
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
        ledger = await JetStreamLedger.open(js)
        ledger.ttl = ttl
        rt.ledger = ledger
        started = time.monotonic()
        for i in range(n):
            args = {"n": i}
            env = sign_grant(key, "operator:alice", token, "deploy", args, "bench", now_ms(),
                             int(window_s * 1000), nonce=secrets.token_hex(16))
            reply = await rt.invoke("deploy", args, env, now_ms())
            assert reply.get("ok") is True, reply
        took = time.monotonic() - started
        state = (await js.stream_info(STREAM)).state
        row = {"calls per second": n / took,
               "keys kept per call, after the calls": state.messages / n,
               "bytes kept per call, after the calls": state.bytes / n}
        await asyncio.sleep(window_s + MARGIN_MS / 1000 + SWEEP_S)
        state = (await js.stream_info(STREAM)).state
        row["keys kept per call, once window + margin passed"] = state.messages / n
        row["bytes kept per call, once window + margin passed"] = state.bytes / n
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
    rows = {"spent keys kept for good (before)": asyncio.run(measure(n, window_s, ttl=False)),
            f"spent keys with their TTL ({window_s:g} s window + {MARGIN_MS / 1000:g} s)":
                asyncio.run(measure(n, window_s, ttl=True))}
    print(f"{n} granted calls")
    for label, row in rows.items():
        print(f"\n{label}")
        for what, value in row.items():
            print(f"  {what}: {value:.2f}")


if __name__ == "__main__":
    main()
