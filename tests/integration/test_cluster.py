"""The loop on deploy/nats-cluster's three nodes (R3, deploy/accounts.conf's users): what a
clustered JetStream answers differently from a single server. Every test here starts the
cluster, so the module is marked slow."""

from __future__ import annotations

import asyncio
import base64
import collections
import subprocess
import time

import nats
import pytest
import pytest_asyncio
import structlog

from improved.client import connection
from improved.client.chain_writer import ChainConflict
from improved.client.sdk import ImproveError, MeshClient, inbox_prefix
from improved.client.streams import LOOK_ATTEMPTS, NeedsProvision
from improved.core import audit, authority, signing
from improved.core.authority import Act
from improved.core.record import ChainHead
from improved.protocol import subjects as S
from improved.protocol.model import DedupHead, GrantCommand, to_json
from improved.runtime.conflicts import kv_create
from improved.runtime.daemon import Daemon
from improved.runtime.store import Store
from improved.testing import rank_proposal
from tests.bus import daemon_config, eventually
from tests.cli import improved
from tests.cluster import Cluster
from tests.factories import now_ms
from tests.keys import ALICE

pytestmark = pytest.mark.slow


def running(base):
    """A cluster on `base`, healthy, stopped afterwards (a fixture's body)."""
    c = Cluster(base)
    c.start()
    try:
        c.wait_healthy()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from running(tmp_path_factory.mktemp("cluster"))


async def provisioned(cluster: Cluster) -> None:
    """The loop's streams and buckets made R3 as improved-admin, retried while the cluster
    elects its leaders."""
    nc = await connection.connect(cluster.url(1, "improved-admin"), "test-provision", persistent=False)
    try:
        async def ensured():
            try:
                await Store(nc, replicas=3).ensure()
                return True
            except Exception:  # a leader not elected yet
                return False

        await eventually(ensured, timeout=60, interval=0.5)
    finally:
        await connection.close(nc)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def on_cluster(cluster):
    """Two daemon replicas as user `improved`, on nodes 1 and 2, the streams provisioned R3:
    the first one."""
    await provisioned(cluster)
    daemons = []
    for n in (1, 2):
        nc = await connection.connect(cluster.url(n, "improved"), f"test-daemon-{n}")
        daemons.append(Daemon(nc, daemon_config(replicas=3)))
        await daemons[-1].start()
    yield daemons[0]
    for daemon in daemons:
        await daemon.stop()
        await connection.close(daemon.nc)


async def as_operator(cluster: Cluster, n: int):
    return await nats.connect(cluster.url(n, "operator"), connect_timeout=2,
                              inbox_prefix=inbox_prefix("operator"))


async def test_concurrent_proposals_on_a_cluster_all_get_a_verdict(cluster, on_cluster):
    """Many proposals at once through two nodes, to two daemon replicas: each sent twice at
    the same moment (the replicas race to register it on its chain) and several under one
    dedup_key (they race for its head). Every request is answered with the proposal's id and
    a status, none with an internal error, and both copies of a proposal get the same id."""
    conns = [await as_operator(cluster, n) for n in (2, 3)]
    try:
        svc = "clusterload"
        # L1: surfaced, never applied (no owning service runs here)
        proposals = [rank_proposal(svc, key=f"k{i % 5}", value=i, change_class="L1")
                     for i in range(40)]

        async def propose(i: int, copy: int):
            client = MeshClient(conns[copy], svc, timeout=30)
            try:
                reply = await client.propose(proposals[i])
                return reply.proposal_id, reply.status
            except ImproveError as exc:
                return None, f"error:{exc.code}: {exc}"

        answers = await asyncio.gather(*(propose(i, copy) for i in range(len(proposals))
                                         for copy in (0, 1)))
    finally:
        for nc in conns:
            await nc.close()
    errors = [status for _, status in answers if status.startswith("error")]
    assert errors == [], collections.Counter(errors)
    ids = [pid for pid, _ in answers]
    assert all(ids[2 * i] == ids[2 * i + 1] for i in range(len(proposals)))
    assert len(set(ids)) == len(proposals)


def grant_draft(identity: str, n: int):
    """ALICE's signed grant of `identity`, as the trailer its grant chain would get next."""
    cmd = GrantCommand(op="grant", skill=identity, principal=ALICE[0], reason=f"race {n}",
                       at=now_ms() + n)
    env = signing.sign(signing.PAYLOAD_TYPES["grant"], to_json(cmd), ALICE[1])
    trust = signing.TrustStore.from_config(
        {ALICE[0]: base64.b64encode(signing.raw_public(ALICE[1].public_key())).decode()})
    verified = trust.verify(env, signing.PAYLOAD_TYPES["grant"])
    return authority.grant_act([], Act(verified.digest, n + 1), verified, cmd, None,
                               "improved:test")


async def test_two_appends_racing_on_one_chain_give_one_conflict(cluster, on_cluster):
    """Two writers extend one chain (a grant chain, R3) from the same head at once, twenty
    times over: each time one append lands and the other is a chain conflict, never an
    error, and the chain holds one trailer per round, every one verifying."""
    store = on_cluster.store
    sha = "cd" * 32
    subject = S.grant_audit(sha)
    head = ChainHead(length=0, last_hash="", stream_seq=0)
    for round_ in range(20):
        trailers = [audit.seal_next(grant_draft(f"race:{sha}", 2 * round_ + i), sha, head,
                                    "L3", "knowledge", now_ms()) for i in (0, 1)]
        results = await asyncio.gather(*(store.append_to(subject, t, head.stream_seq)
                                         for t in trailers), return_exceptions=True)
        landed = [(r, t) for r, t in zip(results, trailers, strict=True) if isinstance(r, int)]
        lost = [r for r in results if not isinstance(r, int)]
        assert len(landed) == 1 and len(lost) == 1, (round_, results)
        assert isinstance(lost[0], ChainConflict), repr(lost[0])
        seq, won = landed[0]
        head = ChainHead(length=won.seq + 1, last_hash=won.hash, stream_seq=seq)
    chain = await store.read_chain_at(subject)
    assert [body["seq"] for _, body in chain] == list(range(20))


async def test_racing_first_writes_to_the_buckets_give_one_conflict(cluster, on_cluster):
    """Two first creates of one key in a bucket (R3) at once: one wins, the other is a
    conflict (`kv_create`), never another error; and two proposals claiming one dedup_key at
    once both get an answer, the newer left as its head."""
    store = on_cluster.store
    for round_ in range(20):
        results = await asyncio.gather(*(kv_create(store.dedup, f"clustersave.race{round_}",
                                                   b"{}") for _ in range(2)),
                                       return_exceptions=True)
        assert sorted(type(r).__name__ for r in results) == \
            ["KeyWrongLastSequenceError", "int"], results
        a, b = f"{2 * round_:064x}", f"{2 * round_ + 1:064x}"
        heads = await asyncio.gather(store.set_dedup_head("clustersave", f"d{round_}", a, 1),
                                     store.set_dedup_head("clustersave", f"d{round_}", b, 2),
                                     return_exceptions=True)
        assert not [h for h in heads if isinstance(h, BaseException)], heads
        assert heads[0] in (None, DedupHead(proposal_id=b, created_at=2)), heads
        assert heads[1] in (None, DedupHead(proposal_id=a, created_at=1)), heads

        async def newest(key=f"d{round_}", want=b):  # any replica, once it has caught up
            return (await store.dedup_head("clustersave", key)).proposal_id == want

        await eventually(newest)


async def test_writers_racing_on_one_key_each_get_an_answer(cluster, on_cluster):
    """A clustered stream refuses a compare-and-set at once while another write to the same
    subject is still being replicated ("wrong last sequence", before the winner is readable
    anywhere). Four writers claiming one dedup_key at once: every one gets an answer, none
    gives up, and the newest is left as the head."""
    store = on_cluster.store
    for round_ in range(15):
        key = f"crowd{round_}"
        pids = [f"{4 * round_ + i:064x}" for i in range(4)]
        heads = await asyncio.gather(*(store.set_dedup_head("clustersave", key, pid, i + 1)
                                       for i, pid in enumerate(pids)),
                                     return_exceptions=True)
        assert not [h for h in heads if isinstance(h, BaseException)], (round_, heads)

        async def newest(key=key, want=pids[-1]):
            return (await store.dedup_head("clustersave", key)).proposal_id == want

        await eventually(newest)


# -- a cluster that restarts, a raised replica count ------------------------------------------


@pytest.fixture
def fresh_cluster(tmp_path):
    """A cluster of the test's own, for a test that stops and starts it."""
    yield from running(tmp_path)


def provision(cluster: Cluster, *args: str) -> subprocess.CompletedProcess:
    """`improved provision` as improved-admin, retried while the cluster elects leaders."""
    deadline = time.monotonic() + 60
    while True:
        done = improved("provision", "--nats", cluster.url(1, "improved-admin"), *args)
        if done.returncode == 0 or time.monotonic() > deadline:
            return done
        time.sleep(0.5)


async def test_provision_brings_r1_streams_and_buckets_to_r3(fresh_cluster):
    """A deployment provisioned R1, then `replicas = 3`: `improved provision` updates every
    stream and every KV bucket to three replicas and says so; the daemon, as user improved,
    refuses to start before that and starts after it."""
    first = provision(fresh_cluster, "--replicas", "1")
    assert first.returncode == 0, first.stdout + first.stderr
    nc = await connection.connect(fresh_cluster.url(1, "improved"), "test-daemon")
    try:
        with pytest.raises(NeedsProvision, match="improved provision"):
            await Daemon(nc, daemon_config(replicas=3)).start()
    finally:
        await connection.close(nc)
    raised = provision(fresh_cluster, "--replicas", "3")
    assert raised.returncode == 0, raised.stdout + raised.stderr
    for bucket in (S.BUCKET_DEDUP, S.BUCKET_LEDGER, S.BUCKET_LEARNED):
        assert f"updated bucket {bucket} (replicas 1 -> 3)" in raised.stdout, raised.stdout
    # the windows bucket's stream is the store's own config, compared whole
    assert f"updated bucket {S.BUCKET_WINDOWS} (num_replicas)" in raised.stdout, raised.stdout
    assert "updated stream IMPROVE_AUDIT (num_replicas)" in raised.stdout, raised.stdout
    nc = await connection.connect(fresh_cluster.url(2, "improved"), "test-daemon")
    daemon = Daemon(nc, daemon_config(replicas=3))
    try:
        await daemon.start()
        js = nc.jetstream()
        for stream in (S.STREAM_AUDIT, f"KV_{S.BUCKET_DEDUP}", f"KV_{S.BUCKET_LEDGER}",
                       f"KV_{S.BUCKET_WINDOWS}", f"KV_{S.BUCKET_LEARNED}"):
            assert (await js.stream_info(stream)).config.num_replicas == 3, stream
    finally:
        await daemon.stop()
        await connection.close(nc)
    again = provision(fresh_cluster, "--replicas", "3")
    assert again.returncode == 0 and "nothing changed" in again.stdout, again.stdout


async def test_a_daemon_starting_with_a_restarted_cluster_waits_for_its_leaders(fresh_cluster):
    """Every node stopped and started again, and the daemon started at once: while the
    cluster elects its stream leaders JetStream answers nothing; the daemon says so on a log
    line per try and starts serving once they are elected, instead of dying."""
    assert provision(fresh_cluster, "--replicas", "3").returncode == 0
    fresh_cluster.stop()
    fresh_cluster.start()
    nc = await connection.connect(fresh_cluster.url(1, "improved"), "test-daemon")
    daemon = Daemon(nc, daemon_config(replicas=3))
    try:
        with structlog.testing.capture_logs() as logs:
            await daemon.start()
        assert daemon.healthy()
        operator = await as_operator(fresh_cluster, 3)
        try:
            pid = (await MeshClient(operator, "restarted").propose(
                rank_proposal("restarted", change_class="L1"))).proposal_id
        finally:
            await operator.close()
        assert await daemon.store.read_chain("restarted", pid)
    finally:
        await daemon.stop()
        await connection.close(nc)
    retries = [e for e in logs if e["event"].startswith("JetStream did not answer")]
    # on two cores the leaders take seconds to elect: the first looks go unanswered
    assert retries, [e["event"] for e in logs]
    for what in {e["what"] for e in retries}:  # each look counts its own tries
        tries = [e["attempt"] for e in retries if e["what"] == what]
        assert tries == list(range(1, len(tries) + 1)), retries
    assert all(e["of"] == LOOK_ATTEMPTS and e["what"].startswith(("stream", "bucket",
                                                                  "consumer"))
               for e in retries), retries
