"""The loop's JetStream publishes, acknowledged through one subscription (`client.acks`), say
what nats-py's own publish says: the sequence stored at, a lost race as the conflict the chain
writer and the buckets read, no stream for the subject, and a timeout when no ack comes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import APIError, NoStreamResponseError

from improved.client import acks as acks_module
from improved.client import connection
from improved.client.acks import Acks
from improved.client.streams import is_conflict


@asynccontextmanager
async def _stream_and_acks(nc, svc: str, name: str) -> AsyncIterator[tuple[str, Acks]]:
    """A memory stream of `svc.<name>.>` of the test's own, and an Acks on `nc`; both gone
    after."""
    js = nc.jetstream()
    stream = f"{name.upper()}_{svc.replace('-', '_').upper()}"
    await js.add_stream(name=stream, subjects=[f"{svc}.{name}.>"],
                        storage=api.StorageType.MEMORY)
    acks = Acks(nc)
    try:
        yield stream, acks
    finally:
        await acks.close()
        await js.delete_stream(stream)


async def test_acks_give_sequences_conflicts_and_missing_streams(nc, svc):
    async with _stream_and_acks(nc, svc, "acks") as (stream, acks):
        seqs = await asyncio.gather(*(acks.publish(f"{svc}.acks.{i}", b"x", stream=stream)
                                      for i in range(50)))
        assert sorted(seqs) == list(range(1, 51))  # pipelined, each its own ack
        await acks.publish(f"{svc}.acks.cas", b"first",
                           headers={"Nats-Expected-Last-Subject-Sequence": "0"})
        with pytest.raises(APIError) as lost:
            await acks.publish(f"{svc}.acks.cas", b"second",
                               headers={"Nats-Expected-Last-Subject-Sequence": "0"})
        assert is_conflict(lost.value)
        with pytest.raises(APIError) as wrong:  # a stream that does not hold the subject
            await acks.publish(f"{svc}.acks.1", b"x", stream="NOT_THIS_ONE")
        assert not is_conflict(wrong.value)
        with pytest.raises(NoStreamResponseError):
            await acks.publish(f"{svc}.nostream", b"x")
        # the last message on a subject, by a direct get through the same subscription
        first = await acks.last(stream, f"{svc}.acks.cas")
        assert first is not None and first.data == b"first" and first.seq == 51


async def test_a_message_get_gives_the_last_message_with_its_headers_or_none(nc, svc):
    async with _stream_and_acks(nc, svc, "last") as (stream, acks):
        for value in (b"one", b"two"):
            await acks.publish(f"{svc}.last.k", value, headers={"KV-Operation": "PUT"})
        data, headers = (await acks.last(stream, f"{svc}.last.k"))[1:]
        assert data == b"two" and headers["KV-Operation"] == "PUT"
        assert await acks.last(stream, f"{svc}.last.none") is None


async def test_an_ack_that_never_comes_times_out_and_is_forgotten(nats_url, svc, monkeypatch):
    """A subject that nothing acknowledges (a core subscriber that never answers): the publish
    fails as nats-py's timeout within the deadline and its sweep, and nothing is left waiting."""
    monkeypatch.setattr(acks_module, "SWEEP_S", 0.05)
    nc = await connection.connect(nats_url, "acks-timeout")
    try:
        silent = await nc.subscribe(f"{svc}.silent")
        acks = Acks(nc, timeout=0.2)
        with pytest.raises(NatsTimeout):
            await asyncio.wait_for(acks.publish(f"{svc}.silent", b"x"), 2)
        assert acks._waiting == {} and acks._timer is None
        await silent.unsubscribe()
        await acks.close()
    finally:
        await connection.close(nc)


async def test_sends_pipelined_without_tasks_settle_in_order_and_a_failure_forgets_the_rest(
        nc, svc):
    """`send` then `settled`: what the records of one pass and the claim beside its ledger
    read use instead of a gather. The sequences come back in the order sent; the first
    failure is raised as `publish` raises it, and what was sent after it is no longer waited
    for (nothing left behind to time out unretrieved)."""
    async with _stream_and_acks(nc, svc, "sent") as (stream, acks):
        sent = [await acks.send(f"{svc}.sent.{i}", b"x", stream=stream) for i in range(5)]
        assert await acks_module.settled(sent) == [1, 2, 3, 4, 5]
        get = await acks.send_get(stream, f"{svc}.sent.3")
        found = await get.stored()
        assert found is not None and found.seq == 4
        mixed = [await acks.send(f"{svc}.sent.a", b"x", stream=stream),
                 await acks.send(f"{svc}.sent.b", b"x", stream="NOT_THIS_ONE"),
                 await acks.send(f"{svc}.sent.c", b"x", stream=stream)]
        with pytest.raises(APIError) as wrong:
            await acks_module.settled(mixed)
        assert not is_conflict(wrong.value)
        assert acks._waiting == {}  # the third is forgotten, though the stream stored it
        assert (await acks.last(stream, f"{svc}.sent.c")) is not None
