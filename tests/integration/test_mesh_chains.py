"""Mesh chains (autonomy, checkpoints, grants) are extended through one path,
Store.append_sealed: racing writers both land, in order, on a chain that verifies; a writer that
keeps losing says so instead of reporting success. A chain reads the same through a consumer
filtered on it (a service's read) as by message gets from the leader (the daemon's)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from improved.client import chains
from improved.core import audit
from improved.core.audit import Draft
from improved.runtime import bus
from improved.runtime.conflicts import ChainConflict, ChainKeptMoving
from improved.runtime.store import Store


@pytest.fixture
async def store(own_server):
    """A store on a server of its own: these chains are no proposal's and no mesh chain's."""
    nc = await bus.connect(own_server.url, "improved-test-mesh-chains")
    s = Store(nc)
    await s.ensure()
    yield s
    await nc.drain()


def noting(reason: str):
    def next_draft(chain, now):
        return Draft(from_stage="observe", to_stage="observe", actor="improved:test",
                     observer_type="rec:system", verdict="note", reason=reason)
    return next_draft


async def test_racing_writers_both_land_in_order_on_a_chain_that_verifies(store):
    chain_id = uuid.uuid4().hex * 2
    subject = f"improve.audit._test.{chain_id}"
    written = await asyncio.gather(*(
        store.append_sealed(subject, chain_id, "L0", "operation", noting(f"writer {i}"))
        for i in range(6)))
    chain = await store.read_chain_at(subject)
    assert sorted(t.seq for t in written) == list(range(6))
    assert [body["seq"] for _, body in chain] == list(range(6))
    assert audit.verify_chain(chain_id, [body for _, body in chain]) is None


async def test_nothing_to_add_appends_nothing(store):
    chain_id = uuid.uuid4().hex * 2
    subject = f"improve.audit._test.{chain_id}"
    assert await store.append_sealed(subject, chain_id, "L0", "operation",
                                     lambda chain, now: None) is None
    assert await store.read_chain_at(subject) == []


async def test_a_writer_that_always_loses_the_race_raises_instead_of_reporting_success(store):
    chain_id = uuid.uuid4().hex * 2
    subject = f"improve.audit._test.{chain_id}"
    attempts = []

    async def always_moved(subject, trailer, expected_seq):
        attempts.append(expected_seq)
        raise ChainConflict(subject)

    store.append_to = always_moved  # another writer wins every time
    with pytest.raises(ChainKeptMoving):
        await store.append_sealed(subject, chain_id, "L0", "operation", noting("lost"))
    assert len(attempts) > 1


async def test_a_chain_read_through_its_own_consumer_is_the_chain_the_leader_serves(store):
    """`chains.read_sequenced` (a consumer filtered on the chain, what a service may be allowed)
    reads what `chains.read_from_leader` (message gets, the daemon's) and the store read: every
    trailer with its stream sequence, none of a chain written in between; [] for no chain."""
    ids = [uuid.uuid4().hex * 2 for _ in range(2)]
    subjects = [f"improve.audit._test.{chain_id}" for chain_id in ids]
    for i in range(5):  # interleaved, so the chain's stream sequences have gaps
        for chain_id, subject in zip(ids, subjects, strict=True):
            await store.append_sealed(subject, chain_id, "L0", "operation", noting(f"n{i}"))
    leader = await chains.read_from_leader(store.js, subjects[0])
    assert len(leader) == 5 and leader == await store.read_chain_at(subjects[0])
    assert await chains.read_sequenced(store.js, subjects[0]) == leader
    assert await chains.read_chain(store.js, subjects[0]) == [body for _, body in leader]
    missing = f"improve.audit._test.{uuid.uuid4().hex * 2}"
    assert await chains.read_sequenced(store.js, missing) == []


async def test_reading_a_chain_without_an_audit_stream_finds_none(own_server):
    nc = await bus.connect(own_server.url, "improved-test-no-stream")
    try:
        js = nc.jetstream(timeout=2.0)
        assert await chains.read_sequenced(js, f"improve.audit._test.{'ab' * 32}") == []
        assert await chains.read_from_leader(js, f"improve.audit._test.{'ab' * 32}") == []
    finally:
        await nc.drain()
