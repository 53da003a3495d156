"""The mesh side of `improved bench`, in a process of its own: it publishes the proposals through
JetStream, signs the operator's approval of each L2 proposal when the daemon asks for it, and
sends one independent learn-back signal for each applied proposal, as the mesh would. The
bench's own process (the owning service and the clock) shares no event loop with it.

Either closed loop (`concurrency`: at most that many proposals unfinished at once) or open loop
(`rate`: proposals per second, whatever the daemon does). A proposal is finished when its last
trailer is written: the learn-back trailer of its signal for an applied one (or the apply when
signals are off), the rejection for a rejected one.

Run as `python -m improved_bench.publisher PLAN.json`; it writes to the plan's `out`
the wall-clock time (time.time()) each proposal was published at, by id, and the CPU seconds
it used from its first publish to its end.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.aio.msg import Msg
from nats.js.api import PubAck

from improved.client import connection
from improved.client.chain_writer import trailers_of
from improved.client.keys import load_key
from improved.core import propose, signing
from improved.protocol import subjects as S
from improved.protocol.model import Review, Signal, Trailer, to_json
from improved_bench.bench import (
    FINAL,
    OPERATOR,
    SVC,
    Plan,
    Published,
    make_proposal,
)

OBSERVER = "mcp:bench-observer:1"  # the learn-back signals' actor: never a proposer


async def publish(plan: Plan, key: Ed25519PrivateKey) -> Published:
    nc = await connection.connect(plan.url, "improved-bench-mesh")
    js = nc.jetstream(publish_async_max_pending=4096)
    kinds = plan.kinds
    proposals = [make_proposal(k, plan.first + i, plan.t0) for i, k in enumerate(kinds)]
    ids = [propose.identify(p)[0] for p in proposals]
    kind_of = dict(zip(ids, kinds, strict=True))
    published: dict[str, float] = {}
    finished: set[str] = set()
    done = asyncio.Event()
    slots = asyncio.Semaphore(plan.concurrency or len(ids))
    pending: set[asyncio.Future[PubAck]] = set()

    def keep(future: asyncio.Future[PubAck]) -> None:
        pending.add(future)
        future.add_done_callback(pending.discard)

    async def on_trailer(msg: Msg) -> None:
        for t in trailers_of(msg.data):  # one trailer, or a commit of several
            await see(t)

    async def see(t: Trailer) -> None:
        pid = t.proposal_id
        kind = kind_of.get(pid)
        if kind is None or pid in finished:
            return
        if t.cause == "awaiting_operator" and kind == "l2":
            review = Review(proposal_id=pid, verdict="approve", principal=OPERATOR,
                            reason="bench", at=int(time.time() * 1000))
            env = signing.sign(signing.PAYLOAD_TYPES["review"], to_json(review), key)
            keep(await js.publish_async(S.inbound_review(SVC), to_json(env)))
            return
        applied = t.to_stage == "apply" and t.verdict == "applied"
        rejected = t.to_stage == "triage" and t.verdict == "reject"
        if applied and plan.learn_back:
            signal = Signal(kind="metric", actor=OBSERVER, service=SVC, positive=True,
                            at=int(time.time() * 1000), proposal_id=pid,
                            name="bench_quality", value=1.0)
            data = to_json(signal)
            digest = propose.signal_digest(signal)
            keep(await js.publish_async(S.inbound_outcome(SVC), data,
                                        headers={"Nats-Msg-Id": S.message_id(digest, data)}))
            return
        last = (t.to_stage == "learn-back" if plan.learn_back and FINAL[kind] == "applied"
                else applied or rejected)
        if last:
            finished.add(pid)
            slots.release()
            if len(finished) == len(ids):
                done.set()

    sub = await nc.subscribe(f"{S.AUDIT}.{SVC}.*", cb=on_trailer)
    await nc.flush()
    cpu_start = time.process_time()
    interval = 1.0 / plan.rate if plan.rate else 0.0
    start = time.perf_counter()
    for i, (pid, p) in enumerate(zip(ids, proposals, strict=True)):
        if interval:
            delay = start + i * interval - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        await slots.acquire()
        published[pid] = time.time()
        data = to_json(p)
        keep(await js.publish_async(S.inbound_proposal(SVC), data,
                                    headers={"Nats-Msg-Id": S.message_id(pid, data)}))
    try:
        await asyncio.wait_for(done.wait(), timeout=plan.timeout)
    except TimeoutError:
        pass
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    cpu_s = time.process_time() - cpu_start
    await sub.unsubscribe()
    await connection.close(nc)
    return Published(published=published, cpu_s=cpu_s)


def main(argv: list[str]) -> int:
    plan = msgspec.json.decode(Path(argv[0]).read_bytes(), type=Plan)
    key = load_key(Path(plan.key))
    Path(plan.out).write_bytes(msgspec.json.encode(asyncio.run(publish(plan, key))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
