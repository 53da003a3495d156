"""A consumer's pull (`client.pulls`: the inbound consumer's, and every read of the log's)
against a real JetStream consumer: one request asks for the room the reader has, its messages
are handed over as they arrive, no request leaves while there is room for fewer than
`refill_at`, and what was delivered and not taken is handed back at the stop."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import nats
import pytest
from nats.js import api

from improved.client import connection, pulls
from improved.client.deployment import Deployment
from improved.client.pulls import Pull
from tests.bus import eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")


@asynccontextmanager
async def _consumer(nc, svc: str, messages: int) -> AsyncIterator[tuple[str, str]]:
    """A memory stream of `svc.pull.>` holding `messages` messages, and a durable pull
    consumer on it that acknowledges explicitly; both gone after."""
    js = nc.jetstream()
    stream = f"PULL_{svc.replace('-', '_').upper()}"
    await js.add_stream(name=stream, subjects=[f"{svc}.pull.>"],
                        storage=api.StorageType.MEMORY)
    await js.add_consumer(stream, api.ConsumerConfig(
        durable_name="loop", ack_policy=api.AckPolicy.EXPLICIT, max_ack_pending=1024))
    for i in range(messages):
        await js.publish(f"{svc}.pull.{i}", str(i).encode())
    try:
        yield stream, "loop"
    finally:
        await js.delete_stream(stream)


async def _take_for(pull: Pull, room, seconds: float) -> list:
    """What `take` hands over within `seconds`."""
    taken: list = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        taken.extend(await pull.take(lambda: room(len(taken)), timeout=0.1))  # noqa: B023
    return taken


async def test_one_request_brings_the_room_asked_for_and_no_more(nc, svc):
    async with _consumer(nc, svc, 100) as (stream, consumer):
        pull = Pull(nc, stream, consumer, refill_at=10)
        await pull.start()
        try:
            # room for 40: the request asks for 40, and once 35 are taken no request leaves
            # for the 5 left (fewer than refill_at): exactly 40 come, in the stream's order
            first = await _take_for(pull, lambda taken: 40 - taken, 1.0)
            assert [int(m.data) for m in first] == list(range(40))
            for msg in first:
                await msg.ack()
            # room again: the next request brings the rest
            rest = await _take_for(pull, lambda taken: 1024 - taken, 1.0)
            assert [int(m.data) for m in rest] == list(range(40, 100))
            for msg in rest:
                await msg.ack()
            # nothing waiting: a take gives nothing after its timeout, and a message
            # published meanwhile is handed over as it arrives, before the request expires
            assert await pull.take(lambda: 1024, timeout=0.2) == []
            await nc.jetstream().publish(f"{svc}.pull.late", b"late")
            started = time.monotonic()
            late = await pull.take(lambda: 1024, timeout=1.5)
            assert [m.data for m in late] == [b"late"]
            assert time.monotonic() - started < 1.0
            await late[0].ack()
        finally:
            await pull.stop()


async def test_what_was_delivered_and_not_taken_is_handed_back_at_the_stop(nc, svc):
    async with _consumer(nc, svc, 5) as (stream, consumer):
        pull = Pull(nc, stream, consumer, refill_at=1)
        await pull.start()
        await pull._ask(1024)  # a request leaves; its deliveries are not taken
        await eventually(lambda: _true(len(pull._arrived) == 5), 2, what="5 delivered")
        left = await pull.stop()
        assert [int(m.data) for m in left] == list(range(5))
        assert pull.owed == 0


async def _true(value: bool) -> bool:
    return value


async def test_after_a_broker_is_killed_the_next_request_leaves_at_once(own_server,
                                                                       monkeypatch):
    """The open request dies with the server's memory of it, and a killed server says nothing
    (a clean stop ends it with a status): on the reconnect the pull asks again at once, not
    when the lost request would have expired (made long here, so only the reconnect can
    explain a delivery)."""
    monkeypatch.setattr(pulls, "EXPIRES_S", 60.0)
    nc = await connection.connect(own_server.url, "pull-restart", persistent=True)
    js = nc.jetstream()
    await js.add_stream(name="PULL_RESTART", subjects=["restart.pull.>"])
    await js.add_consumer("PULL_RESTART", api.ConsumerConfig(
        durable_name="loop", ack_policy=api.AckPolicy.EXPLICIT))
    pull = Pull(nc, "PULL_RESTART", "loop", refill_at=1)
    await pull.start()
    connection.on_reconnect(nc, pull.reconnected)
    try:
        assert await pull.take(lambda: 10, timeout=0.1) == []  # a request is open now
        reconnected = asyncio.Event()

        async def noted() -> None:
            reconnected.set()

        connection.on_reconnect(nc, noted)
        own_server.kill()  # SIGKILL: no status tells the open request it is over
        own_server.start()
        await asyncio.wait_for(reconnected.wait(), 20)
        await js.publish("restart.pull.1", b"after")
        got: list = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = await pull.take(lambda: 10, timeout=0.5)
        assert [m.data for m in got] == [b"after"]
    finally:
        await pull.stop()
        await connection.close(nc)


async def test_a_log_read_gives_every_message_in_order_and_nothing_forged(nc, svc, nats_url):
    """`follow_messages` (every read of the log: a checkpoint, `audit verify`, a refill) pulls
    through `Pull`: more than a batch comes whole and in order, a window ends at its `upto`,
    an empty one at once. Its inbox is the reader's connection's; whoever overhears a pull
    request may publish there (on a bus that lets it: the daemon's inbox prefix it does not,
    tests/integration/test_open_bus_inbox.py): a message no stream delivered is left out, and
    one made to look delivered (a `$JS.ACK` reply subject) the server itself refuses."""
    js = nc.jetstream()
    stream = f"PULL_LOG_{svc.replace('-', '_').upper()}"
    await js.add_stream(name=stream, subjects=[f"{svc}.log.>"],
                        storage=api.StorageType.MEMORY)
    refused: list[str] = []

    async def violation(exc: Exception) -> None:
        refused.append(str(exc))

    evil = await nats.connect(nats_url, error_cb=violation)
    forged = 0

    async def answer(msg) -> None:
        nonlocal forged
        forged += 1
        await evil.publish(msg.reply, json.dumps({"hash": "forged"}).encode())
        await evil.publish(msg.reply, json.dumps({"hash": "forged"}).encode(),
                           reply=f"$JS.ACK.{stream}.c.1.{forged}.1.1700000000000000000.9")

    await evil.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>", cb=answer)
    await evil.flush()
    try:
        for i in range(1, 1201):
            await js.publish(f"{svc}.log.{i % 7}", json.dumps({"i": i}).encode())
        reader = Deployment(nc, audit_stream=stream)

        async def read(start: int, upto: int) -> list[tuple[int, object]]:
            return [(seq, (body or {}).get("i")) async for seq, _, body, _ in
                    reader.follow_messages(f"{svc}.log.>", start, upto)]

        assert await read(1, 1200) == [(i, i) for i in range(1, 1201)]
        assert forged >= 3  # the read took three requests at least, each answered falsely
        assert await read(600, 700) == [(i, i) for i in range(600, 701)]
        assert await read(1201, 1300) == []  # past the end: nothing, at once
        await eventually(lambda: _true(len(refused) >= forged), 5,
                         what="every made-up delivery refused by the server")
        assert all("permissions violation" in r and "$js.ack" in r for r in refused), refused
    finally:
        await evil.close()
        await js.delete_stream(stream)
