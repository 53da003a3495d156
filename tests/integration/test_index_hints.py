"""The indexes are hints, the chains decide (issue 29): on the open embedded bus anyone may
tombstone or purge an index entry, or rewrite it. The review index and the measurement index
only say where to look; what they list is confirmed by its chain, and what they omit is found
from the chains: every checkpoint counts the members of each index (daemon-signed), a reader
checks what it read against that count and reads the chains after the last epoch seal when it
falls short, and the daemon rewrites what the index lost after each checkpoint it signs."""

from __future__ import annotations

import time

import msgspec
import pytest
import structlog

from improved.cli.queries import review_view
from improved.client import connection
from improved.client.sdk import MeshClient
from improved.core.indexes import INDEXES
from improved.core.policy import Policy
from improved.protocol import subjects as S
from improved.protocol.model import MeasureDue, MetricSnapshot, to_json
from improved.runtime.daemon import Daemon
from improved_reference.ranking_store import RankingStore
from tests.bus import daemon_config, eventually, measurement, trailers
from tests.factories import rank_proposal, skill_proposal

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(90)]

SVC = "hintsvc"
YEAR_MS = 365 * 86_400_000


async def _listed(url: str, svc: str = SVC) -> tuple[set[str], str]:
    queue, source = await review_view(url, Policy())
    return {q["proposal_id"] for q in queue if q["service"] == svc}, source


async def _entry(nc, subject: str):
    try:
        return await nc.jetstream().get_msg(S.STREAM_RECORDS, subject=subject, direct=True)
    except Exception:
        return None


async def _waiting_and_counted(own_server, name: str) -> tuple[Daemon, object, set[str]]:
    """A daemon of its own with two L2 proposals waiting for an operator, and a checkpoint
    signed after both (the checkpoint timer's, taken at once)."""
    nc = await connection.connect(own_server.url, name)
    daemon = Daemon(nc, daemon_config())
    await daemon.start()
    client = MeshClient(nc, SVC)
    waiting = {(await client.propose(skill_proposal(SVC, name=n))).proposal_id
               for n in ("first", "second")}
    assert await _listed(own_server.url) == (waiting, "index")
    assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None  # noqa: SLF001
    return daemon, nc, waiting


async def test_a_tombstoned_review_entry_hides_no_waiting_proposal(own_server):
    daemon, nc, waiting = await _waiting_and_counted(own_server, "tombstone-daemon")
    try:
        hidden = sorted(waiting)[0]
        # anyone on the embedded bus: an empty message on the entry's subject, as the daemon
        # writes when an item leaves the queue; a tombstone still names the proposal, whose
        # chain says it waits
        await nc.jetstream().publish(S.review_entry(SVC, hidden), b"", stream=S.STREAM_RECORDS)
        assert not [e for e in await daemon.store.read_index() if e.proposal_id == hidden]
        assert await _listed(own_server.url) == (waiting, "index")

        # the daemon's check after its next checkpoint names the loss and rewrites the entry
        with structlog.testing.capture_logs() as logs:
            await daemon.index_checks.check_indexes()  # what runs after each checkpoint
        errors = [e for e in logs if e["log_level"] == "error"]
        assert [e.get("index") for e in errors] == ["review"], logs
        assert hidden in str(errors[0])
        assert (await _entry(nc, S.review_entry(SVC, hidden))).data
        assert await _listed(own_server.url) == (waiting, "index")
    finally:
        await daemon.stop()
        await connection.close(nc)


async def _purge(nc, subject_filter: str) -> None:
    """A purge through the JetStream API, as any bus participant may ask for it."""
    reply = await nc.request(f"$JS.API.STREAM.PURGE.{S.STREAM_RECORDS}",
                             to_json({"filter": subject_filter}), timeout=2)
    assert msgspec.json.decode(reply.data).get("success"), reply.data


@pytest.mark.parametrize("purged", ["the service's entries", "every entry, the marker put back"])
async def test_a_purge_of_review_entries_hides_no_waiting_proposal(own_server, purged):
    daemon, nc, waiting = await _waiting_and_counted(own_server, "purge-daemon")
    try:
        if purged == "the service's entries":
            await _purge(nc, f"{S.REVIEW}.{SVC}.*")
        else:
            marker = await _entry(nc, S.FILLED_MARKER)
            await _purge(nc, f"{S.REVIEW}.>")
            await nc.jetstream().publish(S.FILLED_MARKER, marker.data, stream=S.STREAM_RECORDS)
        assert await daemon.store.filled()  # the marker still vouches for the index
        assert not [e for e in await daemon.store.read_index() if e.service == SVC]
        assert await _listed(own_server.url) == (waiting, "chains")
        await daemon.index_checks.check_indexes()
        assert await _listed(own_server.url) == (waiting, "index")
    finally:
        await daemon.stop()
        await connection.close(nc)


def _later(ms: int) -> int:
    return int(time.time() * 1000) + ms


async def _signed_ranking(server, svc: str, name: str):
    """(config, connection, a started daemon, a started ranking store of `svc` whose
    signed answers that daemon trusts)."""
    config, key = _answering(svc)
    nc = await connection.connect(server.url, name)
    daemon = Daemon(nc, config)
    await daemon.start()
    store = RankingStore(nc, svc)
    store.use_key(key)
    await store.start()
    return config, nc, daemon, store


def _answering(svc: str):
    """A daemon configuration that trusts a key as `service:<svc>`, and that key: the
    service's signed answers to `<svc>.improve.measure` are then its own (core.boundary)."""
    import base64

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from improved.core import signing

    key = Ed25519PrivateKey.generate()
    config = daemon_config()
    trust = config.trust
    signers = {**trust.signers,
               f"service:{svc}": base64.b64encode(signing.raw_public(key.public_key())).decode()}
    return msgspec.structs.replace(config, trust=msgspec.structs.replace(
        trust, signers=signers)), key


@pytest.mark.parametrize("done_to_it", ["tombstoned", "moved a year ahead"])
async def test_an_owed_measurement_is_asked_after_a_restart_whatever_its_due_entry_says(
        own_server, done_to_it):
    svc = "duesvc"
    config, nc, daemon, store = await _signed_ranking(own_server, svc, "due-daemon")
    again = None
    try:
        kv = await store.js.key_value(store.values_bucket)
        await kv.put("metrics.ctr", to_json(0.5))
        due_at = _later(4000)
        proposal = rank_proposal(svc, value=5, metric_snapshot=MetricSnapshot(
            metric="ctr", baseline=0.5, query="metrics.ctr", review_after=due_at))
        pid = (await MeshClient(nc, svc).propose(proposal)).proposal_id
        subject = S.due_entry(svc, pid)

        async def indexed():
            msg = await _entry(nc, subject)
            return msg is not None and bool(msg.data)

        await eventually(indexed)
        await daemon.stop()
        if done_to_it == "tombstoned":
            await nc.jetstream().publish(subject, b"", stream=S.STREAM_RECORDS)
        else:
            await nc.jetstream().publish(subject, to_json(MeasureDue(
                proposal_id=pid, service=svc, review_after=due_at + YEAR_MS)),
                stream=S.STREAM_RECORDS)

        again = Daemon(nc, config)  # a restart: nothing remembered but the chains and indexes
        await again.start()
        trailer = await measurement(again, svc, pid, timeout=20)
        assert trailer["verdict"] == "held"
        assert trailer["at"] >= due_at
    finally:
        if again is not None:
            await again.stop()
        await store.stop()
        await connection.close(nc)


async def test_every_checkpoint_counts_what_the_chains_say(own_server, capsys):
    """The counts a checkpoint signs are the index refs of every trailer added up, from the
    checkpoint before: the same as replaying every chain, and carried on by another daemon
    (another data directory: its base is the checkpoint on the stream). Each chain's refs are
    what its replay says (`improved audit verify ID`)."""
    from improved.cli.audit import _verify
    from improved.client import indexing
    from improved.core import signing
    from tests.bus import daemon_key, publish
    from tests.factories import now_ms, review

    svc = "countsvc"
    config, nc, daemon, store = await _signed_ranking(own_server, svc, "count-daemon")
    again = None
    try:
        kv = await store.js.key_value(store.values_bucket)
        await kv.put("metrics.ctr", to_json(0.5))
        client = MeshClient(nc, svc)

        def watched(key: str, after_ms: int, cls: str = "L0"):
            return rank_proposal(svc, key=key, change_class=cls, metric_snapshot=MetricSnapshot(
                metric="ctr", baseline=0.5, query="metrics.ctr", review_after=_later(after_ms)))

        owed = (await client.propose(watched("owed", YEAR_MS))).proposal_id
        done = (await client.propose(watched("done", 0))).proposal_id  # measured at once
        approved = (await client.propose(watched("approved", YEAR_MS, "L2"))).proposal_id
        rejected = (await client.propose(skill_proposal(svc, name="rejected"))).proposal_id
        waits = (await client.propose(skill_proposal(svc, name="waits"))).proposal_id
        surfaced = (await client.propose(skill_proposal(svc, name="idea",
                                                        change_class="L1"))).proposal_id
        old = (await client.propose(skill_proposal(svc, name="old", instructions="v1")))
        newer = (await client.propose(skill_proposal(svc, name="old", instructions="v2",
                                                     created_at=now_ms() + 1))).proposal_id
        await publish(nc, S.inbound_review(svc), review(approved))
        await publish(nc, S.inbound_review(svc), review(rejected, verdict="reject"))

        async def settled():
            states = {p: (await client.state(p)) for p in (owed, done, approved, rejected)}
            chain = await trailers(daemon, svc, done)
            return (all(s is not None for s in states.values())
                    and states[approved].status == "applied"
                    and states[rejected].status == "rejected"
                    and any(t.get("verdict") == "held" for t in chain))

        await eventually(settled, timeout=20)
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None  # noqa: SLF001
        counted = daemon.engine.checkpoints.counted
        records, _ = await indexing.from_chains(daemon.store, 1, counted.last_seq, None,
                                                Policy())
        assert counted.members == indexing.counts_of(records) == {"review": 3, "due": 2}
        members = {name: {r.proposal_id for r in records.values() if index.member(r)}
                   for name, index in INDEXES.items()}
        assert members == {"review": {waits, surfaced, newer}, "due": {owed, approved}}
        assert old.proposal_id not in members["review"]  # superseded by `newer`

        again = Daemon(nc, _answering(svc)[0])  # another data directory: the stream's checkpoint
        await again.start()
        assert again.engine.checkpoints.counted.members == counted.members

        trusted = {signing.keyid_of(signing.raw_public(daemon_key().public_key()))}
        for pid in (owed, done, approved, rejected, waits, surfaced, newer):
            assert await _verify(own_server.url, pid, None, trusted, daemon_config()) == 0
        assert "BROKEN" not in capsys.readouterr().out
    finally:
        if again is not None:
            await again.stop()
        await daemon.stop()
        await store.stop()
        await connection.close(nc)


async def test_a_checkpoint_older_than_the_tombstones_still_checks_the_index_if_nothing_moved(
        own_server):
    """A daemon stopped cleanly signs a checkpoint on the way out; while none runs, nothing
    moves an index, so however old that checkpoint is, a reader checks the index against it
    (it reads the few trailers after it to know). Once members moved since, an old
    checkpoint cannot vouch for the tombstones: the chains are read."""
    from improved.cli.queries import queued_records
    from improved.core.indexes import MARGIN_S
    from improved.runtime.store import Store
    from tests.bus import publish
    from tests.factories import review

    config = msgspec.structs.replace(daemon_config(), checkpoint_interval_s=60.0)
    nc = await connection.connect(own_server.url, "stopped-daemon")
    daemon = Daemon(nc, config)
    await daemon.start()
    client = MeshClient(nc, SVC)
    waiting = [(await client.propose(skill_proposal(SVC, name=n))).proposal_id
               for n in ("a", "b")]
    await daemon.stop()  # its last checkpoint, on the way out, counts both
    store = Store(nc)

    async def read():  # as if that checkpoint were older than the tombstones live
        records, found = await queued_records(store, Policy(), ttl_s=MARGIN_S)
        return {r.proposal_id for r in records}, found.source

    try:
        assert await read() == (set(waiting), "index")
        again = Daemon(nc, msgspec.structs.replace(config, checkpoint_interval_s=0.0))
        await again.start()  # no checkpoint but the one at start, before the approval
        await publish(nc, S.inbound_review(SVC), review(waiting[0]))

        async def approved():
            state = await client.state(waiting[0])
            return state is not None and state.status == "approved"

        await eventually(approved)
        await again.stop()
        assert await read() == ({waiting[1]}, "chains")
    finally:
        await connection.close(nc)
