"""What a bench run wrote to the broker's streams, and the broker's own rate for that pattern.

Apart from the drive because this is the yardstick, not the loop: stream sequence deltas give
the writes per proposal (those to file storage are the fsync'd ones), and the ceiling is the
same pattern published straight to JetStream, on the same server and sync setting.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import NotFoundError

ATOMIC_BATCH = 100  # messages per atomic batch in the atomic ceiling (the server allows 1000)
ATOMIC_IN_FLIGHT = 4  # batches in flight per stream at once (the server allows 50)


async def streams(js: JetStreamContext) -> dict[str, dict[str, Any]]:
    """Every stream's last sequence and storage type, by name."""
    return {info.config.name or "": {"last_seq": info.state.last_seq,
                                     "file": info.config.storage == jsapi.StorageType.FILE}
            for info in await js.streams_info()}


async def mean_size(js: JetStreamContext, stream: str, last_seq: int,
                    first_seq: int) -> int:
    """The mean size (payload and headers) of up to 50 of the stream's newest messages that
    the run wrote (some may be gone: retained records keep the newest per subject)."""
    sizes: list[int] = []
    seq = last_seq
    while seq > first_seq and len(sizes) < 50 and last_seq - seq < 500:
        try:
            msg = await js.get_msg(stream, seq=seq)
            head = sum(len(k) + len(v) + 4 for k, v in (msg.headers or {}).items())
            sizes.append(len(msg.data or b"") + head)
        except NotFoundError:
            pass
        seq -= 1
    return round(sum(sizes) / len(sizes)) if sizes else 256


async def writes(js: JetStreamContext, before: dict[str, dict[str, Any]], proposals: int,
                 applier_streams: set[str]) -> dict[str, Any]:
    """The messages each stream gained during the run, per proposal; those to file storage
    are the fsync'd writes (with sync always). The applier's own streams are counted apart."""
    after = await streams(js)
    per_stream = {}
    for name, state in after.items():
        gained = state["last_seq"] - before.get(name, {"last_seq": 0})["last_seq"]
        if gained > 0:
            per_stream[name] = {"messages": gained, "file": state["file"],
                                "per_proposal": round(gained / max(proposals, 1), 2),
                                "by": "applier" if name in applier_streams else "loop",
                                "mean_bytes": await mean_size(
                                    js, name, state["last_seq"], state["last_seq"] - gained)}
    fsyncd = sum(v["messages"] for v in per_stream.values() if v["file"])
    fsyncd_loop = sum(v["messages"] for v in per_stream.values()
                      if v["file"] and v["by"] == "loop")
    return {"streams": per_stream,
            "fsyncd_per_proposal": round(fsyncd / max(proposals, 1), 2),
            "fsyncd_loop_per_proposal": round(fsyncd_loop / max(proposals, 1), 2),
            "fsyncd_loop_messages": fsyncd_loop,
            "loop_messages": sum(v["messages"] for v in per_stream.values()
                                 if v["by"] == "loop")}


async def ceiling(nc: Client, pattern: dict[str, dict[str, Any]], total: int,
                  atomic: bool = False) -> dict[str, Any]:
    """The broker's rate for the loop's write pattern, on this server and sync setting:
    publishes to as many streams as the loop wrote, in parallel, each stream with its share
    of the messages, of the size and storage type that stream received. Pipelined; or,
    with `atomic`, in atomic batches of ATOMIC_BATCH (`allow_atomic`, one commit each),
    ATOMIC_IN_FLIGHT batches in flight per stream."""
    loop = {name: v for name, v in pattern.items() if v["by"] == "loop"}
    weight = sum(v["messages"] for v in loop.values()) or 1
    tasks = []
    names = []
    counted = 0
    for i, (_, v) in enumerate(sorted(loop.items())):
        stream = f"IMPROVED_BENCH_CEILING_{'A' if atomic else 'P'}{i}"
        subject = f"improved.bench.ceiling.{stream.lower()}"
        storage = jsapi.StorageType.FILE if v["file"] else jsapi.StorageType.MEMORY
        js = nc.jetstream(publish_async_max_pending=2000)
        await js.add_stream(jsapi.StreamConfig(name=stream, subjects=[f"{subject}.>"],
                                               storage=storage, allow_atomic=atomic))
        names.append(stream)
        count = max(1, round(total * v["messages"] / weight))
        counted += count
        payload = os.urandom(v["mean_bytes"] // 2 + 1).hex().encode()[:v["mean_bytes"]]
        if atomic:
            tasks += [atomic_batches(nc, f"{subject}.{k}", payload, count // ATOMIC_IN_FLIGHT)
                      for k in range(ATOMIC_IN_FLIGHT)]
        else:
            tasks.append(publish_many(js, f"{subject}.p", payload, count))
    started = time.perf_counter()
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - started
    js = nc.jetstream()
    for stream in names:
        await js.delete_stream(stream)
    return {"messages_per_s": round(counted / elapsed), "messages": counted,
            "streams": len(names), "storage_mirrors_the_loop": True,
            "pattern": (f"atomic batches of {ATOMIC_BATCH}, {ATOMIC_IN_FLIGHT} in flight "
                        "per stream" if atomic else "pipelined")}


async def publish_many(js: JetStreamContext, subject: str, payload: bytes,
                       count: int) -> None:
    futures = [await js.publish_async(subject, payload) for _ in range(count)]
    await asyncio.gather(*futures)


async def atomic_batches(nc: Client, subject: str, payload: bytes, count: int) -> None:
    """`count` messages in atomic batches of ATOMIC_BATCH, one batch after the other: each
    message but the last published with the batch headers, the last one committing it and
    waiting for its PubAck (ADR-50)."""
    for start in range(0, count, ATOMIC_BATCH):
        size = min(ATOMIC_BATCH, count - start)
        batch = nc.new_inbox().rsplit(".", 1)[-1]
        for seq in range(1, size):
            await nc.publish(subject, payload, headers={
                "Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(seq)})
        reply = await nc.request(subject, payload, timeout=30, headers={
            "Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(size),
            "Nats-Batch-Commit": "1"})
        ack = msgspec.json.decode(reply.data)
        if "error" in ack:
            raise RuntimeError(f"atomic batch refused: {ack['error']}")
