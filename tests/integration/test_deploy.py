"""deploy/: the bus permissions, the NATS configs, the scripts and the unit (the systemd
notifications are in tests/unit/test_notify.py). The permission tests run a real nats-server
with deploy/accounts.conf included, `improved provision` as user `improved-admin`, the real
daemon as user `improved` and the reference ranking store as user `svc-ranking`."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import msgspec
import nats
import pytest
import pytest_asyncio
import structlog.testing
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from improved.client import chains, connection
from improved.client.config import ApplySettings, Config, Trust
from improved.client.sdk import MeshClient, inbox_prefix
from improved.core import observe, propose, signing
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import (
    AnalyzerRef,
    Origin,
    Proposal,
    ProposalEdit,
    Summary,
    to_json,
)
from improved.runtime import bus
from improved.runtime.daemon import Daemon
from improved.runtime.provisioning import stream_configs, windows_config
from improved.runtime.store import Store
from improved_reference.ranking_store import RankingStore
from tests.bus import eventually, eventually_blocking, scratch
from tests.cli import decoy_data_dir
from tests.cluster import ACCOUNTS, CLUSTER, DEPLOY, PASSWORDS, Cluster, start_server, stop_server
from tests.cluster import listening as _listening
from tests.cluster import local_copy as _local_copy
from tests.factories import grant, rank_proposal, review, signal, skill_proposal, swap
from tests.keys import ALICE

ROOT = Path(__file__).resolve().parents[2]
SERVER_CONFIGS = [DEPLOY / "nats-single.conf", *CLUSTER]

FAKE_ID = "ab" * 32


def daemon_config() -> Config:
    """Short apply timeouts; ALICE trusted as an operator (her signed reviews and grants are
    what the operator user publishes here); a data directory of its own (the daemon keeps its
    last checkpoint there)."""
    alice = base64.b64encode(signing.raw_public(ALICE[1].public_key())).decode()
    return Config(apply=ApplySettings(timeout_s=1.0, attempts=2, max_deliveries=3),
                  trust=Trust(operators={ALICE[0]: alice}),
                  data_dir=scratch("improved-deploy-"))


# -- a) provisioning: look first, change only what is missing or differs --------------------


async def test_ensure_changes_only_what_is_missing_or_differs(own_server):
    """Without accounts the daemon still makes everything itself; once it is there, a start
    changes nothing (a daemon user under accounts.conf could not), and a weakened audit
    stream or a lost bucket is put back."""
    nc = await connection.connect(own_server.url, "provision-test")
    try:
        store = Store(nc)
        made = await store.ensure()
        assert {c.split(" ", 1)[0] for c in made} == {"created"} and len(made) == 12, made
        assert await Store(nc).ensure() == []  # nothing missing, nothing differs
        js = nc.jetstream()
        # the tool runtimes' chains are kept as durably as the daemon's log
        durable = ("storage", "retention", "deny_delete", "deny_purge", "allow_direct",
                   "num_replicas", "max_msgs", "max_bytes", "max_age", "max_msgs_per_subject")
        logs = [(await js.stream_info(n)).config for n in (S.STREAM_AUDIT, S.STREAM_TOOLS_AUDIT)]
        assert [{k: getattr(c, k) for k in durable} for c in logs] == \
            [{k: getattr(logs[0], k) for k in durable}] * 2
        audit = (await js.stream_info(S.STREAM_AUDIT)).config
        await js.update_stream(audit.evolve(max_msgs_per_subject=1))  # what accounts forbid
        await js.delete_key_value(S.BUCKET_LEDGER)  # lost, as by an operator's slip
        assert await Store(nc).ensure() == [
            f"updated stream {S.STREAM_AUDIT} (max_msgs_per_subject)",
            f"created bucket {S.BUCKET_LEDGER}"]
        assert (await js.stream_info(S.STREAM_AUDIT)).config.max_msgs_per_subject == -1
    finally:
        await nc.drain()


def test_a_users_inbox_prefix_is_one_token_of_its_own():
    """`_INBOX_<user>`: outside `_INBOX.>`, and no user's prefix falls under another's grant."""
    assert inbox_prefix("svc-ranking") == "_INBOX_svc-ranking"
    assert inbox_prefix("improved-admin") == "_INBOX_improved-admin"
    for bad in ("svc.ranking", "svc*", ">", "", "a b", "x" * 129):
        with pytest.raises(ValueError, match="cannot name an inbox"):
            inbox_prefix(bad)


async def test_every_reply_comes_under_the_connections_own_inbox_prefix(own_server):
    """nats-py puts every inbox of a connection under the prefix it was made with: request
    replies, JetStream acks and API replies, pull fetches, ordered consumers (a KV watch, an
    object store read) and the chain reads of a service; nothing comes to `_INBOX.`, which no
    user of deploy/accounts.conf may hear."""
    prefix = inbox_prefix("svc-x")
    heard: list[str] = []

    async def note(msg):
        heard.append(msg.subject)

    async def echo(msg):
        await msg.respond(msg.data)

    watcher = await connection.connect(own_server.url, "watcher")
    await watcher.subscribe(">", cb=note)
    await watcher.subscribe("inboxes.echo", cb=echo)
    await watcher.flush()
    nc = await connection.connect(own_server.url, "prefixed", inbox_prefix=prefix)
    try:
        assert (await nc.request("inboxes.echo", b"hi", timeout=2)).data == b"hi"
        js = nc.jetstream(timeout=2.0)
        await js.add_stream(name="INBOXES", subjects=["inboxes.js.>"])
        await js.publish("inboxes.js.a", b"1")
        pull = await js.pull_subscribe("inboxes.js.a", stream="INBOXES")
        assert [m.data for m in await pull.fetch(1, timeout=2)] == [b"1"]
        ordered = await js.subscribe("inboxes.js.a", stream="INBOXES", ordered_consumer=True)
        assert (await ordered.next_msg(timeout=2)).data == b"1"
        kv = await js.create_key_value(bucket="inboxes")
        await kv.put("k", b"v")
        assert (await kv.get("k")).value == b"v"
        watch = await kv.watchall()
        assert (await watch.updates(timeout=2)).value == b"v"
        objects = await js.create_object_store("inboxes")
        await objects.put("o", b"blob")
        assert (await objects.get("o")).data == b"blob"
        await Store(nc).ensure()
        chain = f"improve.audit._test.{FAKE_ID}"
        await js.publish(chain, b"{}", stream=S.STREAM_AUDIT)
        assert await chains.read_chain(js, chain) == [{}]
        await nc.flush()
        await watcher.flush()
    finally:
        await nc.close()
        await watcher.close()
    assert [s for s in heard if s.startswith("_INBOX.")] == []
    assert sum(s.startswith(f"{prefix}.") for s in heard) > 10, heard


# -- b) accounts and permissions on a real server -------------------------------------------


class SecuredServer:
    """A nats-server with JetStream whose users and permissions are deploy/accounts.conf;
    stopped and started again on the same port and store."""

    def __init__(self, base: Path):
        self.base = base
        self.port = bus.free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.conf = base / "server.conf"
        self.conf.write_text(
            f'listen: "127.0.0.1:{self.port}"\n'
            "max_payload: 1MB\n"
            f'jetstream {{\n  store_dir: "{base / "js"}"\n}}\n'
            # include paths are relative to the including file: reach the real one from here
            f'include "{os.path.relpath(ACCOUNTS, base)}"\n'
        )
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        self.proc = start_server(self.conf, self.port, self.base / "server.log")
        return self.url

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)


@pytest.fixture(scope="module")
def secured_url(tmp_path_factory):
    server = SecuredServer(tmp_path_factory.mktemp("secured"))
    yield server.start()
    server.stop()


@pytest.fixture
def secured_server(tmp_path):
    """A secured server of a test's own, with nothing provisioned yet."""
    server = SecuredServer(tmp_path)
    server.start()
    yield server
    server.stop()


def as_user(url: str, user: str) -> str:
    """`url` with the reference credentials of `user` in it."""
    return url.replace("nats://", f"nats://{user}:{PASSWORDS[user]}@")


class Conn:
    """A connection as one user, with the server's asynchronous errors collected."""

    def __init__(self, nc, errors: list[str]):
        self.nc = nc
        self.errors = errors

    def violations(self) -> list[str]:
        return [e for e in self.errors if "permissions violation" in e.lower()]

    async def violation(self, subject: str, timeout: float = 3.0) -> str:
        """The server's permissions violation naming `subject` (waits for it; nats-py
        reports the server's error text lowercased)."""

        async def seen():
            return [v for v in self.violations() if f'"{subject.lower()}"' in v.lower()]

        return (await eventually(seen, timeout=timeout))[0]

    async def violation_like(self, pattern: str, timeout: float = 3.0) -> str:
        """The server's permissions violation whose quoted subject matches `pattern` (for a
        subject with a random token in it, such as a consumer's name)."""

        async def seen():
            return [v for v in self.violations()
                    if re.search(f'"{pattern}"', v, flags=re.IGNORECASE)]

        return (await eventually(seen, timeout=timeout))[0]


async def connect_as(url: str, user: str, prefix: str | None = None) -> Conn:
    """A connection as `user`, hearing replies on its own inboxes (or under `prefix`)."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(as_user(url, user), name=f"test-{user}", error_cb=on_error,
                            max_reconnect_attempts=1, connect_timeout=2,
                            inbox_prefix=prefix or inbox_prefix(user))
    return Conn(nc, errors)


async def count(js, stream: str, subject: str) -> int:
    """How many messages `stream` holds on exactly `subject`."""
    info = await js.stream_info(stream, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def mesh(secured_url):
    """The deployment provisioned by `improved provision` as `improved-admin`, then the
    daemon running as `improved` and the ranking store as `svc-ranking`."""
    rc, out = await cli("provision", "--nats", as_user(secured_url, "improved-admin"))
    assert rc == 0, out
    daemon_conn = await connect_as(secured_url, "improved")
    # deploy/accounts.conf binds each service to its own subjects: a subject proves who sent
    daemon = Daemon(daemon_conn.nc, msgspec.structs.replace(
        daemon_config(), trust=msgspec.structs.replace(daemon_config().trust,
                                                       subjects_bound=True)))
    await daemon.start()  # Store.ensure() finds everything as it should be
    ranking_conn = await connect_as(secured_url, "svc-ranking")
    store = RankingStore(ranking_conn.nc, "ranking")
    await store.start()
    yield {"url": secured_url, "daemon": daemon, "daemon_conn": daemon_conn,
           "ranking": ranking_conn}
    await store.stop()
    await ranking_conn.nc.drain()
    await daemon.stop()
    await daemon_conn.nc.drain()
    # Whatever the module's tests made the daemon and the ranking store do, their
    # permissions covered it.
    assert daemon_conn.violations() == []
    assert ranking_conn.violations() == []


LOOP_STREAMS = (S.STREAM_INBOUND, S.STREAM_RECORDS, S.STREAM_AUDIT, S.STREAM_REFUSED,
                S.STREAM_TOOLS_AUDIT, S.STREAM_TOOLS_SPENT, S.STREAM_TOOLS_REVOKED,
                f"KV_{S.BUCKET_DEDUP}", f"KV_{S.BUCKET_LEDGER}", f"KV_{S.BUCKET_WINDOWS}",
                f"KV_{S.BUCKET_LEARNED}")


async def test_provisioned_daemon_runs_the_loop_and_changes_nothing(mesh):
    js = mesh["daemon_conn"].nc.jetstream()
    for name in LOOP_STREAMS:
        assert (await js.stream_info(name)).config.name == name
    # a provisioned deployment is looked at, never changed (it could not be: no violation)
    assert await Store(mesh["daemon_conn"].nc).ensure() == []

    # A service proposes (request/reply to the daemon), the daemon orders the apply from the
    # service (request/reply back), and the service reads its retained records.
    client = MeshClient(mesh["ranking"].nc, "ranking", timeout=5.0)
    reply = await client.propose(rank_proposal("ranking", key="deploy.boost", value=2.0))
    outcome = await eventually(lambda: client.outcome(reply.proposal_id))
    assert outcome.ok and outcome.applied_id.startswith("rank_ranking:deploy.boost@")
    state = await eventually(lambda: client.state(reply.proposal_id))
    assert state.service == "ranking"
    # Durable publish into the inbound stream (JetStream ack) works the same way.
    pid = await client.publish(rank_proposal("ranking", key="deploy.durable", value=3))
    assert (await eventually(lambda: client.outcome(pid))).ok
    assert await count(js, S.STREAM_INBOUND, S.inbound_proposal("ranking")) >= 2
    assert len(await Store(mesh["daemon_conn"].nc).read_chain("ranking", pid)) >= 3
    # Three sessions report a regression (stage 1 writes its windows bucket), and an operator
    # rejects the investigation it proposes (the analyzer's counts are written).
    observed = await observed_and_rejected(mesh, client, "rank:deploy.observed")
    assert (await client.state(observed)).status == "rejected"
    learned = await mesh["daemon"].observer.counts(observe.RegressionAnalyzer().id)
    assert learned.rejected == 1
    # The daemon's grants covered everything it did; so did the service's.
    assert mesh["daemon_conn"].violations() == []
    assert mesh["ranking"].violations() == []


async def observed_and_rejected(mesh, client: MeshClient, target: str) -> str:
    """Negative metric signals on `target` from three sessions, sent by the service; the id
    of the L1 proposal they make, once an operator has rejected it."""
    regression = observe.RegressionAnalyzer()
    window, candidates = observe.EMPTY, []
    for i in range(3):
        sig = signal("ranking", f"mcp:watch-{i}:1", positive=False, kind="metric",
                     target_ref=target, name="ctr", at=int(time.time() * 1000) + i)
        window, candidates = regression.step("ranking", window, sig)
        await client.signal(sig)
    pid = propose.identify(candidates[0].proposal)[0]
    await eventually(lambda: client.decision(pid))
    operator = await connect_as(mesh["url"], "operator")
    try:
        await operator.nc.publish(S.inbound_review("ranking"),
                                  to_json(review(pid, verdict="reject", reason="noise")))
        await operator.nc.flush()
        assert operator.violations() == []
    finally:
        await operator.nc.close()
    await eventually(lambda: _status_is(client, pid, "rejected"))
    return pid


async def _status_is(client: MeshClient, pid: str, status: str) -> bool:
    state = await client.state(pid)
    return state is not None and state.status == status


async def test_daemon_cannot_change_or_drop_the_audit_stream(mesh):
    """A compromised daemon cannot lose the chain: as user `improved`, an update of the audit
    stream's limits (one trailer per chain would drop all the others), its deletion, a purge
    and a message delete are all refused by the server, and the stream is as it was."""
    conn = await connect_as(mesh["url"], "improved")
    try:
        js = conn.nc.jetstream(timeout=1.0)
        before = await js.stream_info(S.STREAM_AUDIT)
        assert before.state.messages > 0  # the daemon's start wrote its policy trailers
        cfg = before.config.evolve(max_msgs_per_subject=1)
        attacks = [
            (f"$JS.API.STREAM.UPDATE.{S.STREAM_AUDIT}", lambda: js.update_stream(cfg)),
            (f"$JS.API.STREAM.DELETE.{S.STREAM_AUDIT}", lambda: js.delete_stream(S.STREAM_AUDIT)),
            (f"$JS.API.STREAM.PURGE.{S.STREAM_AUDIT}", lambda: js.purge_stream(S.STREAM_AUDIT)),
            (f"$JS.API.STREAM.MSG.DELETE.{S.STREAM_AUDIT}",
             lambda: js.delete_msg(S.STREAM_AUDIT, before.state.first_seq)),
        ]
        for subject, attack in attacks:
            with pytest.raises(NatsTimeout):  # the server drops it: nothing answers
                await attack()
            assert "permissions violation" in (await conn.violation(subject)).lower()
        after = await js.stream_info(S.STREAM_AUDIT)
        assert after.config.as_dict() == before.config.as_dict()
        assert after.config.max_msgs_per_subject != 1
        # every trailer is still there (the daemon may have appended more meanwhile)
        assert after.state.first_seq == before.state.first_seq
        assert after.state.last_seq >= before.state.last_seq
        assert after.state.messages == after.state.last_seq - after.state.first_seq + 1
    finally:
        await conn.nc.close()


async def test_the_archivist_may_purge_the_audit_stream_and_nothing_else(mesh):
    """`improved-archivist` (`improved audit archive --remove`) may read the audit stream and
    purge it, and nothing more: it cannot write a trailer, change or delete the stream, nor
    purge another stream."""
    conn = await connect_as(mesh["url"], "improved-archivist")
    try:
        js = conn.nc.jetstream(timeout=1.0)
        before = await js.stream_info(S.STREAM_AUDIT)
        # allowed: a purge (of a service with no chains here, so the module's log stays whole)
        assert await js.purge_stream(S.STREAM_AUDIT, subject=S.audit("nosuchsvc", "*"),
                                     seq=before.state.last_seq)
        attacks = [
            (S.audit("ranking", "f" * 64), lambda: js.publish(S.audit("ranking", "f" * 64),
                                                              b"{}")),
            (f"$JS.API.STREAM.UPDATE.{S.STREAM_AUDIT}",
             lambda: js.update_stream(before.config.evolve(max_msgs_per_subject=1))),
            (f"$JS.API.STREAM.DELETE.{S.STREAM_AUDIT}", lambda: js.delete_stream(S.STREAM_AUDIT)),
            (f"$JS.API.STREAM.MSG.DELETE.{S.STREAM_AUDIT}",
             lambda: js.delete_msg(S.STREAM_AUDIT, before.state.first_seq)),
            (f"$JS.API.STREAM.PURGE.{S.STREAM_RECORDS}",
             lambda: js.purge_stream(S.STREAM_RECORDS)),
        ]
        for subject, attack in attacks:
            with pytest.raises(NatsTimeout):
                await attack()
            assert "permissions violation" in (await conn.violation(subject)).lower()
        after = await js.stream_info(S.STREAM_AUDIT)
        assert after.state.messages >= before.state.messages
    finally:
        await conn.nc.close()


async def test_daemon_cannot_change_or_drop_the_other_loop_streams(mesh):
    """Nor update, delete or purge the other streams and buckets, delete their messages, or
    delete the shared inbound consumer; a create of a stream that exists changes nothing."""
    conn = await connect_as(mesh["url"], "improved")
    try:
        js = conn.nc.jetstream(timeout=1.0)
        before = {name: (await js.stream_info(name)).config.as_dict() for name in LOOP_STREAMS}
        forbidden = [f"$JS.API.STREAM.{api}.{name}" for name in LOOP_STREAMS
                     for api in ("UPDATE", "DELETE", "PURGE", "MSG.DELETE")]
        forbidden += [f"$JS.API.STREAM.CREATE.{name}"
                      for name in (S.STREAM_INBOUND, S.STREAM_AUDIT, S.STREAM_REFUSED,
                                   S.STREAM_TOOLS_AUDIT, S.STREAM_TOOLS_SPENT,
                                   S.STREAM_TOOLS_REVOKED)]
        forbidden += [f"$JS.API.CONSUMER.DELETE.{S.STREAM_INBOUND}.{S.CONSUMER_INBOUND}",
                      f"$JS.API.CONSUMER.DURABLE.CREATE.{S.STREAM_INBOUND}.{S.CONSUMER_INBOUND}"]
        for subject in forbidden:
            await conn.nc.publish(subject, b"{}")
        await conn.nc.flush()
        for subject in forbidden:
            await conn.violation(subject)
        # the records it may re-create: a create cannot change the stream that is there
        records = (await js.stream_info(S.STREAM_RECORDS)).config
        with pytest.raises(BadRequestError, match="different configuration"):
            await js.add_stream(records.evolve(max_msgs_per_subject=100))
        after = {name: (await js.stream_info(name)).config.as_dict() for name in LOOP_STREAMS}
        assert after == before
        assert (await js.consumer_info(S.STREAM_INBOUND, S.CONSUMER_INBOUND)).config
    finally:
        await conn.nc.close()


async def test_only_the_provisioning_user_provisions_and_the_daemon_says_so(secured_server,
                                                                            tmp_path):
    """On a fresh server the daemon's user and the operator cannot make the loop's streams
    (one line: run `improved provision`); `improved-admin` can, and may run it again (finding
    no bucket of an earlier version to remove). After a broker restart the daemon finds
    everything in place and makes nothing."""
    url = secured_server.url
    rc, out = await cli("run", "--nats", as_user(url, "improved"),
                        "--data-dir", str(tmp_path / "daemon"))
    assert rc == 2 and "Traceback" not in out, out
    assert out.splitlines()[-1].startswith(
        f"improved: stream {S.STREAM_INBOUND} is missing, and this user may not change it "
        "(JetStream did not answer): run `improved provision"), out
    rc, out = await cli("provision", "--nats", as_user(url, "operator"))
    assert rc == 2 and out.splitlines() == [
        f"improved provision: stream {S.STREAM_INBOUND} is missing, and these credentials may "
        "not change it (JetStream did not answer): connect as the provisioning user, e.g. "
        "IMPROVED_NATS_USER=improved-admin IMPROVED_NATS_PASSWORD_FILE=FILE"], out

    rc, out = await cli("provision", "--nats", as_user(url, "improved-admin"))
    assert rc == 0 and out.splitlines()[-1].endswith("12 changed"), out
    rc, out = await cli("provision", "--nats", as_user(url, "improved-admin"))
    assert rc == 0 and len(out.splitlines()) == 1, out
    assert out.splitlines()[-1].endswith("nothing changed"), out

    secured_server.stop()
    secured_server.start()
    conn = await connect_as(url, "improved")
    try:
        daemon = Daemon(conn.nc, daemon_config())
        await daemon.start()  # finds everything as it should be
        assert await daemon.store.ensure() == []
        await daemon.stop()
        await conn.nc.flush()
        assert conn.violations() == []
    finally:
        await conn.nc.close()


async def test_a_dedup_bucket_without_ttls_is_kept_by_the_daemon_and_fixed_by_provision(
        secured_server):
    """An earlier deployment's dedup bucket, whose stream takes no per-message TTLs: the
    daemon's user may not allow them, so the daemon says so in one line and runs the loop
    without them (its heads kept, as before); `improved provision` allows them."""
    url = secured_server.url
    admin = await connect_as(url, "improved-admin")
    try:
        store = Store(admin.nc)  # everything as provisioned, but that bucket as it was made
        await admin.nc.jetstream().add_stream(StreamConfig(
            name=f"KV_{S.BUCKET_DEDUP}", subjects=[f"$KV.{S.BUCKET_DEDUP}.>"],
            allow_rollup_hdrs=True, deny_delete=True, discard=DiscardPolicy.NEW,
            max_msgs_per_subject=1, storage=StorageType.FILE))
        for cfg in stream_configs():
            await store._ensure_stream(cfg)
        await store._ensure_consumer()
        for bucket in (S.BUCKET_LEDGER, S.BUCKET_LEARNED):
            await store._bucket(bucket, bucket, [])
        await store._ensure_stream(windows_config())
    finally:
        await admin.nc.close()
    conn = await connect_as(url, "improved")
    config = msgspec.structs.replace(daemon_config(), records_ttl_days=2 / 86400)
    daemon = Daemon(conn.nc, config)
    ranking = await connect_as(url, "svc-ranking")
    client = MeshClient(ranking.nc, "ranking", timeout=5.0)
    try:
        with structlog.testing.capture_logs() as logs:
            await daemon.start()
        assert not daemon.store.dedup_ttl
        said = [e["event"] for e in logs if "per-message" in e["event"]]
        assert len(said) == 1 and "run `improved provision`" in said[0], logs
        proposal = rank_proposal("ranking", key="old.bucket")
        pid = (await client.propose(proposal)).proposal_id  # the daemon answers, as before
        assert (await client.triage(pid)).verdict == "accept"
        dedup = S.dedup_key_of("ranking", propose.identify(proposal)[1])
        msg = await conn.nc.jetstream().get_msg(f"KV_{S.BUCKET_DEDUP}",
                                                subject=f"$KV.{S.BUCKET_DEDUP}.{dedup}")
        assert "Nats-TTL" not in (msg.headers or {})
    finally:
        await ranking.nc.close()
        await daemon.stop()
        await conn.nc.close()
    rc, out = await cli("provision", "--nats", as_user(url, "improved-admin"))
    assert rc == 0 and f"updated bucket {S.BUCKET_DEDUP} (allow_msg_ttl)" in out, out


async def test_the_provisioning_user_moves_a_file_records_stream_and_no_one_else_may(
        secured_server):
    """A records stream an earlier deployment made on file storage: `improved provision
    --move-records` as improved-admin makes it again on memory storage (the default); the
    daemon's user, asked the same, may not remove it and changes nothing."""
    url = secured_server.url
    admin = await connect_as(url, "improved-admin")
    try:
        store = Store(admin.nc)
        for cfg in stream_configs(records_storage="file"):
            await store._ensure_stream(cfg)
        js = admin.nc.jetstream()
        assert (await js.stream_info(S.STREAM_RECORDS)).config.storage == StorageType.FILE
        rc, out = await cli("provision", "--nats", as_user(url, "improved"), "--move-records")
        assert rc == 2 and "these credentials may not change it" in out, out
        assert (await js.stream_info(S.STREAM_RECORDS)).config.storage == StorageType.FILE
        rc, out = await cli("provision", "--nats", as_user(url, "improved-admin"),
                            "--move-records")
        assert rc == 0 and f"created stream {S.STREAM_RECORDS}" in out, out
        assert (await js.stream_info(S.STREAM_RECORDS)).config.storage == StorageType.MEMORY
    finally:
        await admin.nc.close()


async def test_provision_writes_the_sentinel_into_a_spent_stream_an_earlier_version_made(
        secured_server):
    """The tool runtimes' streams as an earlier version provisioned them, the spent marks'
    without a sentinel: a tool runtime under `rt-agent` refuses to start, naming `improved
    provision`; provisioning as `improved-admin` writes the sentinel (its one publish into the
    loop), and the runtime starts, records a granted call and refuses its replay, with no
    permission violation on either side."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from improved.client.streams import tools_audit_config, tools_ledger_configs
    from improved_reference.tool_runtime import ToolRuntimeService
    from tests.tool_surfaces import ARGS, grant, runtime

    url = secured_server.url
    admin = await connect_as(url, "improved-admin")
    try:
        for cfg in (tools_audit_config(), *tools_ledger_configs()):
            await admin.nc.jetstream().add_stream(cfg)
    finally:
        await admin.nc.close()
    conn = await connect_as(url, "rt-agent")
    try:
        rt, kit = runtime(name="agent")
        with pytest.raises(RuntimeError, match="IMPROVE_TOOLS_SPENT has no sentinel .* run "
                           "`improved provision` once, which writes it"):
            await ToolRuntimeService(conn.nc, rt, Ed25519PrivateKey.generate()).start()
        rc, out = await cli("provision", "--nats", as_user(url, "improved-admin"))
        assert rc == 0 and (f"wrote the sentinel of stream {S.STREAM_TOOLS_SPENT} (sequence 1)"
                            ": it was made by an earlier version") in out, out
        service = ToolRuntimeService(conn.nc, rt, Ed25519PrivateKey.generate())
        await service.start()
        request = to_json({"tool": "deploy", "args": ARGS, "grant": grant(
            kit["deploy"][0], ARGS, now=int(time.time() * 1000), runtime="agent")})
        assert msgspec.json.decode(await service.answer(request))["ok"] is True
        replay = msgspec.json.decode(await service.answer(request))
        assert replay["refused"]["reason"] == "replayed", replay
        await service.stop()
        await conn.nc.flush()
        assert conn.violations() == []
    finally:
        await conn.nc.close()


FORBIDDEN_TO_SERVICES = [
    S.GRANTS,  # only operators grant
    S.inbound_review("ranking"),  # reviews are the operator's, even for its own proposals
    S.inbound_proposal("other"),  # another service's inbound
    S.inbound_outcome("other"),
    S.QUORUM,
    S.proposal_state("ranking", FAKE_ID),  # a forged retained record
    S.apply_outcome("ranking", FAKE_ID),
    S.grant_record("ranking", FAKE_ID),
    S.review_entry("ranking", FAKE_ID),  # a forged entry in the operator's queue
    S.audit("ranking", FAKE_ID),  # a forged trailer
    S.apply_request("ranking"),  # ordering applies is the daemon's
    S.propose_request("other"),
    S.refused("ranking"),
    "$JS.API.STREAM.CREATE.SNOOP",  # a stream capturing other subjects
    f"$JS.API.STREAM.PURGE.{S.STREAM_INBOUND}",
    f"$KV.{S.BUCKET_DEDUP}.ranking.{FAKE_ID}",  # the daemon's dedup heads
]


async def test_service_cannot_publish_outside_its_own_subjects(mesh):
    dj = mesh["daemon_conn"].nc.jetstream()
    watched = [(S.STREAM_INBOUND, S.GRANTS), (S.STREAM_INBOUND, S.inbound_review("ranking")),
               (S.STREAM_INBOUND, S.inbound_proposal("other")),
               (S.STREAM_INBOUND, S.inbound_outcome("other")),
               (S.STREAM_RECORDS, S.proposal_state("ranking", FAKE_ID)),
               (S.STREAM_RECORDS, S.grant_record("ranking", FAKE_ID)),
               (S.STREAM_RECORDS, S.review_entry("ranking", FAKE_ID)),
               (S.STREAM_AUDIT, S.audit("ranking", FAKE_ID))]
    before = [await count(dj, stream, subject) for stream, subject in watched]
    conn = await connect_as(mesh["url"], "svc-ranking")
    try:
        for subject in FORBIDDEN_TO_SERVICES:
            await conn.nc.publish(subject, b'{"forged": true}')
        await conn.nc.flush()
        for subject in FORBIDDEN_TO_SERVICES:
            assert "permissions violation" in (await conn.violation(subject)).lower()

        # A JetStream publish that the server refuses is never acknowledged.
        js = conn.nc.jetstream(timeout=0.5)
        with pytest.raises(NatsTimeout):
            await js.publish(S.GRANTS, b"{}", stream=S.STREAM_INBOUND)
        with pytest.raises(NatsTimeout):
            await js.publish(S.inbound_proposal("other"), b"{}", stream=S.STREAM_INBOUND)
        # ... while its own inbound subject is (even for junk, which the daemon refuses).
        ack = await js.publish(S.inbound_outcome("ranking"), b"{}", stream=S.STREAM_INBOUND)
        assert ack.stream == S.STREAM_INBOUND
    finally:
        await conn.nc.close()

    # Nothing it was refused landed anywhere.
    after = [await count(dj, stream, subject) for stream, subject in watched]
    assert after == before
    assert await count(dj, S.STREAM_AUDIT, S.audit("ranking", FAKE_ID)) == 0
    op = await connect_as(mesh["url"], "operator")  # the daemon may not list streams
    try:
        names = await op.nc.request("$JS.API.STREAM.NAMES", b"{}", timeout=2)
        assert "SNOOP" not in msgspec.json.decode(names.data)["streams"]
    finally:
        await op.nc.close()


async def test_service_cannot_serve_or_read_what_is_not_its_own(mesh):
    conn = await connect_as(mesh["url"], "svc-ranking")
    try:
        forbidden = [S.apply_request("other"),  # answering another service's applies
                     S.PROPOSE_REQUESTS,  # impersonating the daemon
                     S.SPEC_GET, "improve.>", S.audit("other", "*")]
        for subject in forbidden:
            await conn.nc.subscribe(subject)
        await conn.nc.flush()
        for subject in forbidden:
            await conn.violation(subject)

        js = conn.nc.jetstream(timeout=0.5)
        with pytest.raises(NatsTimeout):  # another service's retained record
            await js.get_msg(S.STREAM_RECORDS, subject=S.proposal_state("other", FAKE_ID),
                             direct=True)
        with pytest.raises(NatsTimeout):  # the audit stream
            await js.get_msg(S.STREAM_AUDIT, seq=1, direct=True)
        await conn.violation(f"$JS.API.DIRECT.GET.{S.STREAM_AUDIT}")
        # its own serving subjects are fine
        await conn.nc.subscribe(S.apply_request("ranking"), queue="ranking")
        await conn.nc.subscribe(S.service_spec("ranking"))
        await conn.nc.flush()
        await asyncio.sleep(0.05)
        assert not [v for v in conn.violations() if "ranking.improve.apply" in v
                    or "ranking.spec.get" in v]
    finally:
        await conn.nc.close()


async def test_operator_publishes_acts_reads_records_but_cannot_order_applies(mesh):
    conn = await connect_as(mesh["url"], "operator")
    try:
        js = conn.nc.jetstream(timeout=2.0)
        # Signed acts go into the inbound stream (junk here: the daemon refuses it, audited).
        assert (await js.publish(S.GRANTS, b"{}", stream=S.STREAM_INBOUND)).seq > 0
        review = S.inbound_review("ranking")
        assert (await js.publish(review, b"{}", stream=S.STREAM_INBOUND)).seq > 0
        dj = mesh["daemon_conn"].nc.jetstream()
        assert await count(dj, S.STREAM_INBOUND, S.GRANTS) >= 1
        assert await count(dj, S.STREAM_INBOUND, review) >= 1

        # Reads: the daemon's capabilities, a decision on request, records and trailers.
        spec = await conn.nc.request(S.SPEC_GET, b"{}", timeout=2)
        assert msgspec.json.decode(spec.data)["service"] == "improved"
        client = MeshClient(mesh["ranking"].nc, "ranking", timeout=5.0)
        reply = await client.propose(rank_proposal("ranking", key="op.read", value=1))
        decided = await conn.nc.request(S.triage_request("ranking"),
                                        msgspec.json.encode({"proposal_id": reply.proposal_id}),
                                        timeout=5)
        assert msgspec.json.decode(decided.data)["verdict"] == "accept"
        store = Store(conn.nc)
        await store.bind()
        chain = await eventually(lambda: store.read_chain("ranking", reply.proposal_id))
        assert chain and chain[0][1]["to_stage"]
        assert await eventually(lambda: store.last(S.proposal_state("ranking",
                                                                    reply.proposal_id)))
        assert conn.violations() == []

        # A reversal goes into the inbound stream (`improved revert`): a proposal it may
        # also send on request, and one that makes a service's own evidence less independent.
        inbound = S.inbound_proposal("ranking")
        assert (await js.publish(inbound, b"{}", stream=S.STREAM_INBOUND)).seq > 0

        # Refused: ordering an apply, writing records or trailers, changing streams, and a
        # signal on a service's subject, which counts as that service's own (subjects_bound).
        forbidden = [S.apply_request("ranking"), S.audit("ranking", FAKE_ID),
                     S.triage_decision("ranking", FAKE_ID), S.refine_request("ranking"),
                     f"$JS.API.STREAM.DELETE.{S.STREAM_AUDIT}",
                     f"$KV.{S.BUCKET_DEDUP}.ranking.{FAKE_ID}"]
        for subject in forbidden:
            await conn.nc.publish(subject, b"{}")
        await conn.nc.flush()
        for subject in forbidden:
            await conn.violation(subject)
        await conn.nc.subscribe(S.apply_request("ranking"))  # nor serve a service's applies
        await conn.violation(S.apply_request("ranking"))
    finally:
        await conn.nc.close()


def improved_exe() -> Path:
    exe = Path(bus.nats_server_binary()).parent / "improved"
    if not exe.exists():
        pytest.skip(f"{exe} is not installed (pip install -e .)")
    return exe


async def cli(*args: str, env: dict[str, str] | None = None,
              stdin: bytes | None = None, cwd: Path | None = None) -> tuple[int, str]:
    """Run this checkout's `improved` command, with `env` added to the environment, in `cwd`
    (default: this process's); (exit code, stdout + stderr)."""
    proc = await asyncio.create_subprocess_exec(
        str(improved_exe()), *args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        env={**os.environ, "IMPROVED_CONFIG": "", **(env or {})}, cwd=cwd)
    out, _ = await asyncio.wait_for(proc.communicate(stdin), 60)
    return proc.returncode, out.decode()


async def test_operator_cli_reads_show_review_and_verify(mesh, tmp_path):
    """The operator's read commands work under the operator's permissions: `show` (records,
    one chain), `review` (an ordered consumer over the review index, the
    listed chains), `audit verify` (an ordered consumer over the whole audit stream)."""
    await _operator_reads(mesh, "op", tmp_path)


async def test_operator_cli_reads_alike_beside_another_deployments_data(mesh, tmp_path):
    """The same reads from a directory holding `.improved/` of another deployment (its
    checkpoint key and last checkpoint), and with that deployment's data directory as this
    user's default: the working directory is never read, and the default data directory,
    kept for another deployment, is named as such, not taken for tampering."""
    work = tmp_path / "work"
    decoy_data_dir(work / ".improved")
    decoy = decoy_data_dir(tmp_path / "state" / "improved")[:16]
    await _operator_reads(mesh, "decoy", work, {"XDG_STATE_HOME": str(tmp_path / "state")},
                          f"holds the checkpoint key or kept checkpoint of another deployment "
                          f"(daemon key {decoy}…")


async def _operator_reads(mesh, name: str, cwd: Path, env: dict[str, str] | None = None,
                          note: str | None = None) -> None:
    client = MeshClient(mesh["ranking"].nc, "ranking", timeout=5.0)
    reply = await client.propose(rank_proposal("ranking", key=f"{name}.cli", value=4))
    waiting = await client.propose(skill_proposal("ranking", name=f"{name}-review"))  # waits
    await eventually(lambda: client.outcome(reply.proposal_id))
    url = mesh["url"].replace("nats://", f"nats://operator:{PASSWORDS['operator']}@")
    rc, out = await cli("show", reply.proposal_id, "--nats", url, cwd=cwd, env=env)
    assert rc == 0, out
    # no daemon key given to check writers: it says so, and never BROKEN
    assert '"chain": "UNVERIFIED writers (no trusted daemon key' in out, out
    rc, out = await cli("review", "--json", "--nats", url, cwd=cwd, env=env)
    assert rc == 0, out
    assert waiting.proposal_id in out and "read from the audit chains" not in out
    rc, out = await cli("audit", "verify", "--nats", url, cwd=cwd, env=env)
    assert rc == 3 and "BROKEN" not in out and "\nUNVERIFIED writers (no trusted daemon " \
        "key" in out, out
    assert note is None or note in out, out
    anchor = mesh["daemon"].config.data_dir / "last-checkpoint.json"  # names the daemon's key
    rc, out = await cli("audit", "verify", "--nats", url, "--checkpoint", str(anchor), cwd=cwd,
                        env=env)
    assert rc == 0, out
    assert re.search(r"(\d+)/\1 chains verified", out), out
    assert "\nVERIFIED " in out and f"(the checkpoint file {anchor})" in out, out


async def test_audit_rebuild_runs_as_the_daemon_user(mesh):
    """`improved audit rebuild --write` republishes retained records; accounts.conf says to
    run it as `improved`, whose narrowed grants still cover it."""
    rc, out = await cli("audit", "rebuild", "--write", "--nats", as_user(mesh["url"], "improved"))
    assert rc == 0 and "proposals rebuilt from their chains alone" in out, out


async def test_other_service_users_start_their_reference_store(mesh):
    """svc-skills's grants fit the reference skills store's start-up (its three buckets)."""
    from improved_reference.skills_store import SkillsStore

    conn = await connect_as(mesh["url"], "svc-skills")
    try:
        store = SkillsStore(conn.nc, "skills")
        await store.start()
        assert await store.check_grant_active(f"summarize:{FAKE_ID}") is False  # grants read
        await store.stop()
        await conn.nc.flush()
        assert conn.violations() == []
    finally:
        await conn.nc.close()


async def test_the_doc_and_knowledge_stores_run_under_their_own_users(mesh):
    """svc-docs and svc-knowledge: each store starts, an operator-approved doc edit is applied
    with its acceptance read from its own chain (--verify-acceptance), and neither user needed
    a right it lacks. The knowledge store is only started: its grants fit its buckets."""
    from improved_reference import diffs
    from improved_reference.doc_store import DocStore
    from improved_reference.doc_store import digest as doc_digest
    from improved_reference.knowledge_store import KnowledgeStore
    from tests.factories import unique_ms

    docs, knowledge, op = [await connect_as(mesh["url"], user)
                           for user in ("svc-docs", "svc-knowledge", "operator")]
    doc_store = DocStore(docs.nc, "docs", verify_acceptance=True)
    know_store = KnowledgeStore(knowledge.nc, "knowledge", verify_acceptance=True)
    old, new = "# Guide\n\nRun it.\n", f"# Guide\n\nRun it ({time.time_ns()}).\n"
    try:
        await know_store.start()
        await doc_store.start()
        await doc_store.put("docs/guide.md", old)
        client = MeshClient(docs.nc, "docs", timeout=5.0)
        proposal = Proposal(
            service="docs", target_ref="doc:docs/guide.md", change_class="L2",
            scope="knowledge", origin=Origin(actor="mcp:docs-writer:1", service="docs"),
            analyzer=AnalyzerRef(id="acme.docs/1"),
            summary=Summary(template_id="edit_doc", args={}),
            proposal_edit=ProposalEdit(format="unified", base_digest=doc_digest(old),
                                       diff=diffs.make(old, new, "docs/guide.md")),
            created_at=unique_ms())
        pid = (await client.propose(proposal)).proposal_id
        await eventually(lambda: client.decision(pid))
        await op.nc.jetstream(timeout=5.0).publish(S.inbound_review("docs"),
                                                   to_json(review(pid)),
                                                   stream=S.STREAM_INBOUND)
        outcome = await eventually(lambda: client.outcome(pid), timeout=15)
        assert outcome.ok, outcome.error
        assert await doc_store.document("docs/guide.md") == new
    finally:
        await doc_store.stop()
        await know_store.stop()
        for conn in (docs, knowledge, op):
            await conn.nc.flush()
            await conn.nc.close()
    assert docs.violations() == [] and knowledge.violations() == [], (
        docs.violations(), knowledge.violations())


async def test_a_tool_runtime_records_its_calls_under_its_own_user(mesh):
    """rt-agent's grants fit the reference tool runtime `agent`: it starts (its acceptances'
    bucket made, the provisioned mark streams looked at), answers the operator's calls
    (`improved tools`), records a mounted call, an L2 acceptance, a granted L4 call and its
    refused replay on its own chain in IMPROVE_TOOLS_AUDIT with no permission violation, spends
    the grant and records an operator's revocation as marks it cannot erase, and an operator's
    `audit verify` reads that chain (verified under `[trust.runtimes]`). It cannot write the
    daemon's log, another runtime's chain or revocations, nor create, change or purge a mark
    stream, and the daemon's checkpoint is not affected."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from nats.js.errors import APIError

    from improved.client.tool_chains import verify_tool_chains
    from improved.core import evidence, tools
    from improved_reference.tool_runtime import ToolRuntimeService
    from tests.tool_surfaces import ARGS, grant, runtime, upgrade

    key = Ed25519PrivateKey.generate()
    conn, op = [await connect_as(mesh["url"], user) for user in ("rt-agent", "operator")]
    rt, kit = runtime(name="agent")
    service = ToolRuntimeService(conn.nc, rt, key)
    now = int(time.time() * 1000)
    try:
        await service.start()
        await conn.nc.flush()  # its subscriptions are in place before the first call

        async def call(body):  # as `improved tools call` does, with the operator's rights
            reply = await op.nc.request(S.tools_call("agent"), to_json(body), timeout=5)
            return msgspec.json.decode(reply.data)

        assert (await call({"tool": "read", "args": ARGS}))["ok"]
        accept = grant(kit["write"][0], ARGS, now=now, runtime="agent")
        assert (await call({"tool": "write", "args": ARGS, "grant": accept}))["ok"]
        deploy = grant(kit["deploy"][0], ARGS, now=now)
        assert (await call({"tool": "deploy", "args": ARGS, "grant": deploy}))["ok"]
        # its marks: the grant spent, which not even the runtime's user can erase
        rjs = conn.nc.jetstream(timeout=5.0)
        spent = S.tools_spent(tools.upgrade_id(deploy))
        assert (await rjs.get_last_msg(S.STREAM_TOOLS_SPENT, spent)).headers["Nats-TTL"]
        with pytest.raises(APIError, match="rollup not permitted"):
            await rjs.publish(spent, b"", msg_ttl=1,
                              headers={"KV-Operation": "PURGE", "Nats-Rollup": "sub"})
        replay = await call({"tool": "deploy", "args": ARGS, "grant": deploy})
        assert replay["refused"]["reason"] == "replayed", replay
        up = upgrade("agent", "s-1", now=now)
        revocation = tools.sign_revocation(ALICE[1], ALICE[0], "agent", tools.upgrade_id(up),
                                           "done", now)
        reply = await op.nc.request(S.tools_revoke("agent"), to_json({"revocation": revocation}),
                                    timeout=5)
        assert msgspec.json.decode(reply.data)["ok"] is True
        assert await rjs.get_last_msg(S.STREAM_TOOLS_REVOKED,
                                      S.tools_revoked("agent", tools.upgrade_id(up)))
        await service.stop()
        cid = tools.chain_id("agent")
        js = mesh["daemon_conn"].nc.jetstream(timeout=5.0)  # counts: the daemon may look
        # the mark streams it trusts (provisioning wrote the spent marks' sentinel first),
        # then the four calls
        assert await count(js, S.STREAM_TOOLS_AUDIT, S.tools_audit(cid)) == 5
        assert (await rjs.get_msg(S.STREAM_TOOLS_SPENT, 1)).subject == S.TOOLS_SPENT_SENTINEL
        # what the runtime may not write: the daemon's log, another runtime's chain, another
        # runtime's revocations, the mark streams' configuration
        forbidden = (S.legacy_tools_audit(cid), S.tools_audit(tools.chain_id("other")),
                     S.tools_revoked("other", "f" * 64),
                     f"$JS.API.STREAM.CREATE.{S.STREAM_TOOLS_SPENT}",
                     f"$JS.API.STREAM.UPDATE.{S.STREAM_TOOLS_REVOKED}",
                     f"$JS.API.STREAM.PURGE.{S.STREAM_TOOLS_SPENT}")
        for subject in forbidden:
            await conn.nc.publish(subject, b"{}")
            await conn.nc.flush()
            await conn.violation(subject)
        assert await count(js, S.STREAM_AUDIT, S.legacy_tools_audit(cid)) == 0
        public = base64.b64encode(signing.raw_public(key.public_key())).decode()
        found = await verify_tool_chains(op.nc, signing.TrustStore.from_config(
            {"agent": public}), evidence.History(fallback=evidence.KeySet.from_config(
                {ALICE[0]: base64.b64encode(signing.raw_public(ALICE[1].public_key()))
                 .decode()}, {})))
        assert (found.chains, found.verified, found.trailers) == (1, 1, 5), found.lines
        assert await mesh["daemon"].engine.checkpoints.checkpoint(mesh["daemon"]._checkpoint_key) is None
        unexpected = [v for v in conn.violations()
                      if not any(f'"{subject.lower()}"' in v.lower() for subject in forbidden)]
        assert unexpected == [] and op.violations() == [], (unexpected, op.violations())
    finally:
        for c in (conn, op):
            await c.nc.close()


async def test_the_l4_artefact_store_runs_under_its_own_user(mesh):
    """svc-deploy's grants fit the reference artefact store: its object store and buckets, the
    last-known-good check, and reading the audit chain to refuse an unaccepted order."""
    from improved.cli.queries import schema_class
    from improved.core.propose import identify
    from improved.protocol.model import AnalyzerRef, ApplyOrder, Origin, Proposal, Summary, to_json
    from improved_reference.artefact_store import ArtefactStore, digest_of

    conn = await connect_as(mesh["url"], "svc-deploy")
    try:
        store = ArtefactStore(conn.nc, "deploy")
        await store.start()
        digests = await store.seed({"app": '{"v": 1}'})
        report = await store.check_lkg({"proposal_id": FAKE_ID, "lkg": [
            {"artefact": "app", "digest": digests["app"], "smoke_test": "json"}]})
        assert report["ok"], report
        assert await store.content("app") == b'{"v": 1}'
        proposal = Proposal(
            service="deploy", target_ref="binary:deploy", change_class="L4", scope="operation",
            origin=Origin(actor="agentd:x", service="agentd"), analyzer=AnalyzerRef(id="acme.deploy/1"),
            summary=Summary(template_id="swap"), created_at=1,
            proposal_data={"artefacts": {"app": '{"v": 2}'}},
            lkg=[{"artefact": "app", "digest": digests["app"], "smoke_test": "json"}])
        pid, _ = identify(proposal)
        # only the daemon may order an apply
        reply = await mesh["daemon_conn"].nc.request("deploy.improve.apply", to_json(ApplyOrder(
            proposal_id=pid, proposal=proposal, authority="operator:alice", attempt=1)),
            timeout=5)
        assert b"not_accepted" in reply.data, reply.data
        # the operator may ask the store's read-only class of a pending schema: change
        op = await connect_as(mesh["url"], "operator")
        try:
            schema = msgspec.structs.replace(proposal, target_ref="schema:deploy", lkg=[
                {"artefact": "app", "digest": digest_of(b'{"v": 2}'), "smoke_test": "json"}])
            # under accounts only the store's own user may answer its subject: it is its word
            bound = Trust(subjects_bound=True)
            assert await schema_class(op.nc, schema, trust=bound) == {
                "class": "breaking", "reason": "app at /: uses v, which the classifier does not "
                                               "understand", "by": "service:deploy"}
            await op.nc.flush()
            assert op.violations() == []
        finally:
            await op.nc.close()
        await store.stop()
        await conn.nc.flush()
        assert conn.violations() == []
    finally:
        await conn.nc.close()


# -- replies: each user hears its own only --------------------------------------------------


# nats-py's default inbox namespace, and every other party's own prefix
OTHERS_INBOXES = ["_INBOX.>", "_INBOX_improved.>", "_INBOX_operator.>", "_INBOX_svc-skills.>",
                  "_INBOX_svc-deploy.>", "_INBOX_improved-admin.>"]


async def test_a_service_hears_no_reply_meant_for_another_party(mesh):
    """svc-ranking asks to hear nats-py's default inboxes and every other party's, and is
    refused each, hearing nothing, while the skills service proposes (its reply), the operator
    approves (the daemon fetches the signed review into its inbox), the daemon orders the apply
    (the skills store answers into the daemon's inbox, after reading its own chain), a grant is
    recorded and the skills store serves the skill under it (reading the grant chain)."""
    from improved_reference.skills_store import SkillsStore

    spy, skills, op = [await connect_as(mesh["url"], user)
                       for user in ("svc-ranking", "svc-skills", "operator")]
    heard: list[str] = []

    async def overheard(msg):
        heard.append(msg.subject)

    store = SkillsStore(skills.nc, "skills", verify_acceptance=True)
    try:
        for subject in OTHERS_INBOXES:
            await spy.nc.subscribe(subject, cb=overheard)
        await spy.nc.flush()
        await store.start()
        client = MeshClient(skills.nc, "skills", timeout=5.0)
        proposal = skill_proposal("skills", name=f"private-{time.time_ns()}")
        pid = (await client.propose(proposal)).proposal_id
        await eventually(lambda: client.decision(pid))
        operator = op.nc.jetstream(timeout=5.0)
        await operator.publish(S.inbound_review("skills"), to_json(review(pid)),
                               stream=S.STREAM_INBOUND)
        outcome = await eventually(lambda: client.outcome(pid), timeout=15)
        assert outcome.ok, outcome.error
        skill = proposal.proposal_data["skill"]
        identity = canonical.skill_identity(skill)
        await operator.publish(S.GRANTS, to_json(grant(identity, proposal=pid)),
                               stream=S.STREAM_INBOUND)
        await eventually(lambda: store.check_grant_active(identity))
        name, sha = identity.split(":", 1)
        assert await store.get_granted(name, sha) == skill

        for subject in OTHERS_INBOXES:
            await spy.violation(subject)
        assert heard == []
        await skills.nc.flush()
        await op.nc.flush()
        assert skills.violations() == [] and op.violations() == []
    finally:
        await store.stop()
        for conn in (spy, skills, op):
            await conn.nc.close()


async def test_a_client_on_anothers_inbox_prefix_or_the_default_one_hears_nothing(mesh):
    """svc-ranking connected with nats-py's default prefix, or with another party's, may not
    subscribe to its own reply inboxes: its requests go unanswered, refused by the server."""
    for prefix in ("_INBOX", "_INBOX_improved", "_INBOX_operator", "_INBOX_svc-skills"):
        conn = await connect_as(mesh["url"], "svc-ranking", prefix)
        try:
            with pytest.raises(NatsTimeout):
                await conn.nc.request(S.SPEC_GET, b"{}", timeout=1)
            await conn.violation_like(re.escape(f"{prefix}.") + r"[^.]+\.\*")
        finally:
            await conn.nc.close()


def test_a_connection_hears_replies_on_its_urls_users_inboxes():
    """connection.connect names the inbox prefix after the URL's user (what accounts.conf grants); no
    user, no accounts: nats-py's default."""
    _, creds = connection.split_credentials("nats://svc-ranking:pw@127.0.0.1:4222")
    assert connection.inbox_of(creds) == "_INBOX_svc-ranking"
    assert connection.inbox_of(creds, "_INBOX_mine") == "_INBOX_mine"
    assert connection.inbox_of({}) == "_INBOX" and connection.inbox_of({"token": "s3cret"}) == "_INBOX"
    with pytest.raises(connection.BusError, match="cannot name an inbox"):
        connection.inbox_of({"user": "svc.ranking", "password": "pw"})


# -- records and chains: a service's own only -----------------------------------------------


async def test_a_service_reads_its_own_chains_and_the_grant_chains_only(mesh):
    """svc-deploy and svc-skills cannot get the ranking service's record or chain by message
    get or direct get, nor walk its chain with a consumer (one whose API subject names their
    own chain but whose configuration filters another's is refused by the server); they read
    their own chains and the grant chains."""
    ranking = MeshClient(mesh["ranking"].nc, "ranking", timeout=5.0)
    pid = (await ranking.propose(rank_proposal("ranking", key="private.read", value=5))
           ).proposal_id
    assert (await eventually(lambda: ranking.outcome(pid))).ok
    record, chain = S.proposal_state("ranking", pid), S.audit("ranking", pid)
    for user, own in (("svc-deploy", "deploy"), ("svc-skills", "skills")):
        conn = await connect_as(mesh["url"], user)
        try:
            js = conn.nc.jetstream(timeout=0.5)
            attempts = [
                (re.escape(f"$JS.API.STREAM.MSG.GET.{S.STREAM_RECORDS}"),
                 lambda js=js: js.get_msg(S.STREAM_RECORDS, subject=record)),
                (re.escape(f"$JS.API.STREAM.MSG.GET.{S.STREAM_AUDIT}"),
                 lambda js=js: js.get_msg(S.STREAM_AUDIT, seq=1, subject=chain, next=True)),
                (re.escape(f"$JS.API.DIRECT.GET.{S.STREAM_RECORDS}.{record}"),
                 lambda js=js: js.get_msg(S.STREAM_RECORDS, subject=record, direct=True)),
                (re.escape(f"$JS.API.DIRECT.GET.{S.STREAM_AUDIT}"),
                 lambda js=js: js.get_msg(S.STREAM_AUDIT, seq=1, subject=chain, next=True,
                                          direct=True)),
                (re.escape(f"$JS.API.DIRECT.GET.{S.STREAM_AUDIT}.{chain}"),
                 lambda js=js: js.get_msg(S.STREAM_AUDIT, subject=chain, direct=True)),
                (re.escape(f"$JS.API.CONSUMER.CREATE.{S.STREAM_AUDIT}.") + r"[^.]+\."
                 + re.escape(chain), lambda js=js: chains.read_chain(js, chain)),
            ]
            for pattern, attempt in attempts:
                with pytest.raises(NatsTimeout):
                    await attempt()
                await conn.violation_like(pattern)
            for config in ({"filter_subject": chain}, {"filter_subjects": [chain]}):
                reply = await conn.nc.request(
                    f"$JS.API.CONSUMER.CREATE.{S.STREAM_AUDIT}.spy.{S.audit(own, FAKE_ID)}",
                    msgspec.json.encode({"stream_name": S.STREAM_AUDIT, "config": {
                        "name": "spy", "deliver_subject": conn.nc.new_inbox(),
                        "ack_policy": "none", **config}}), timeout=2)
                assert "error" in msgspec.json.decode(reply.data), reply.data

            before = len(conn.violations())
            assert await chains.read_chain(js, S.audit(own, FAKE_ID)) == []
            assert await chains.current_grant(js, f"summarize:{FAKE_ID}") is None
            await conn.nc.flush()
            assert conn.violations()[before:] == []
        finally:
            await conn.nc.close()


async def test_the_artefact_store_applies_an_order_it_verified_on_its_own_chain(mesh):
    """An L4 swap approved by the operator: svc-deploy's artefact store reads the proposal's
    chain (its own) to verify the approval, and applies."""
    from improved_reference.artefact_store import ArtefactStore

    deploy, op = [await connect_as(mesh["url"], user) for user in ("svc-deploy", "operator")]
    store = ArtefactStore(deploy.nc, "deploy")
    try:
        await store.start()
        await store.seed({"web": '{"v": 1}'})
        client = MeshClient(deploy.nc, "deploy", timeout=5.0)
        pid = await client.publish(swap("deploy", {"web": '{"v": 2}'}))
        await eventually(lambda: client.decision(pid))
        await op.nc.jetstream(timeout=5.0).publish(S.inbound_review("deploy"),
                                                   to_json(review(pid)),
                                                   stream=S.STREAM_INBOUND)
        outcome = await eventually(lambda: client.outcome(pid), timeout=15)
        assert outcome.ok, outcome.error
        assert await store.content("web") == b'{"v": 2}'
        await deploy.nc.flush()
        assert deploy.violations() == [] and op.violations() == []
    finally:
        await store.stop()
        for conn in (deploy, op):
            await conn.nc.close()


async def test_a_signal_is_independent_only_from_another_services_own_subject(mesh):
    """With the services bound to their subjects, the subject a signal arrives on is who sent
    it. The ranking service confirming its own proposal — under any actor, claiming any
    service — stays the proposer; it cannot speak on the skills service's subjects; the skills
    service, on its own subject, releases the proposal."""
    ranking = MeshClient(mesh["ranking"].nc, "ranking", timeout=5.0)
    own = signal("ranking", "mcp:ranking-agent:1")
    pid = (await ranking.propose(rank_proposal("ranking", key="deploy.collapse", value=4,
                                               signals=[own]))).proposal_id
    assert (await ranking.triage(pid)).cause == "feedback_collapse"
    for actor, service in (("mcp:made-up:1", "ranking"), ("operator:alice", "billing"),
                           ("skills", "skills")):
        reply = await ranking.refine(signal(service, actor, proposal_id=pid))
        assert reply.counted and not reply.independent, actor
    intruder = await connect_as(mesh["url"], "svc-ranking")
    try:
        with pytest.raises(NatsTimeout):  # not its subject: the server drops it
            await intruder.nc.request(S.refine_request("skills"), msgspec.json.encode(
                signal("skills", "skills", proposal_id=pid)), timeout=1)
        assert await intruder.violation(S.refine_request("skills"))
    finally:
        await intruder.nc.drain()
    skills_conn = await connect_as(mesh["url"], "svc-skills")
    try:
        skills = MeshClient(skills_conn.nc, "skills", timeout=5.0)
        reply = await skills.refine(signal("skills", "mcp:skills-evaluator:1", kind="check",
                                           proposal_id=pid))
        assert reply.counted and reply.independent
        assert (await eventually(lambda: ranking.outcome(pid))).ok
        chain = await Store(mesh["daemon_conn"].nc).read_chain("ranking", pid)
        assert any("emitter:service:skills" in body.get("refs", []) for _, body in chain)
        assert skills_conn.violations() == []
    finally:
        await skills_conn.nc.drain()


async def test_unknown_users_and_wrong_passwords_are_refused(secured_url):
    for auth in ("nobody:nothing", "svc-ranking:dev-operator-pw", ""):
        url = secured_url.replace("nats://", f"nats://{auth}@") if auth else secured_url
        with pytest.raises(Exception):  # noqa: B017 - nats-py raises several kinds here
            await nats.connect(url, connect_timeout=1, max_reconnect_attempts=0,
                               allow_reconnect=False)


# -- credentials: files, never the URL, never a log line ---------------------------------------


def secret_file(path: Path, secret: str) -> Path:
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return path


class RunningDaemon:
    """`improved run --config FILE` as a process of its own, its output (JSON log lines and
    what it prints) kept in a file."""

    def __init__(self, config: Path, log: Path, env: dict[str, str] | None = None):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([str(improved_exe()), "run", "--config", str(config)],
                                         stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "IMPROVED_CONFIG": "",
                                              **(env or {})})

    def output(self) -> str:
        return self.log.read_text()

    async def wait_for(self, text: str, timeout: float = 30.0) -> None:
        async def seen():
            assert self.proc.poll() is None, f"the daemon exited: {self.output()}"
            return text in self.output()

        await eventually(seen, timeout=timeout, interval=0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(60)


@pytest.mark.parametrize("form", ["password_file", "url"])
async def test_the_daemon_never_logs_its_password_across_a_disconnect(secured_server,
                                                                     tmp_path, form):
    """The daemon connects as user improved with its password in a file ([nats]), or in the
    URL as older configurations have it; the broker restarts under it. Its output says it
    lost the server and got it back, naming the server, and never holds the password; the
    provisioning and the operator's CLI take their passwords from files through the
    environment."""
    url = secured_server.url
    admin = {"IMPROVED_NATS_USER": "improved-admin", "IMPROVED_NATS_PASSWORD_FILE":
             str(secret_file(tmp_path / "admin.pw", PASSWORDS["improved-admin"]))}
    rc, out = await cli("provision", "--nats", url, env=admin)
    assert rc == 0 and out.splitlines()[-1].endswith("12 changed"), out
    config = tmp_path / "improved.toml"
    if form == "password_file":
        pw = secret_file(tmp_path / "improved.pw", PASSWORDS["improved"])
        config.write_text(f'nats_url = "{url}"\ndata_dir = "{tmp_path / "data"}"\n'
                          f'[nats]\nuser = "improved"\npassword_file = "{pw}"\n')
    else:
        config.write_text(f'nats_url = "{as_user(url, "improved")}"\n'
                          f'data_dir = "{tmp_path / "data"}"\n')
    daemon = RunningDaemon(config, tmp_path / "daemon.log")
    try:
        await daemon.wait_for("improved: ready")
        operator = {"IMPROVED_NATS_USER": "operator", "IMPROVED_NATS_PASSWORD_FILE":
                    str(secret_file(tmp_path / "operator.pw", PASSWORDS["operator"]))}
        proposal = to_json(rank_proposal("creds", change_class="L1"))
        rc, out = await cli("propose", "--json", "-", "--nats", url, env=operator, stdin=proposal)
        assert rc == 0 and msgspec.json.decode(out)["status"] == "pending", out
        secured_server.stop()
        await daemon.wait_for("nats disconnected")
        secured_server.start()
        await daemon.wait_for("nats reconnected")
    finally:
        assert daemon.stop() == 0, daemon.output()
    output = daemon.output()
    assert "ready as improved:" in output and f"on {url}" in output, output
    lost = [line for line in output.splitlines() if "nats disconnected" in line]
    assert lost and all(url in line for line in lost), lost
    for secret in PASSWORDS.values():
        assert secret not in output


async def test_the_daemon_and_the_cli_connect_with_a_token_file(tmp_path):
    """A server that wants a token: the daemon reads it from `[nats] token_file`, the CLI
    from IMPROVED_NATS_TOKEN_FILE; without it the CLI is refused in one line."""
    server = bus.EmbeddedServer(tmp_path / "nats", bus.free_port(), sync="2m",
                                extra='authorization { token: "t0ken-s3cret" }\n')
    server.start()
    token = secret_file(tmp_path / "token", "t0ken-s3cret")
    config = tmp_path / "improved.toml"
    config.write_text(f'nats_url = "{server.url}"\ndata_dir = "{tmp_path / "data"}"\n'
                      f'[nats]\ntoken_file = "{token}"\n')
    daemon = RunningDaemon(config, tmp_path / "daemon.log")
    try:
        await daemon.wait_for("improved: ready")
        proposal = to_json(rank_proposal("tokens", change_class="L1"))
        rc, out = await cli("propose", "--json", "-", "--nats", server.url, stdin=proposal,
                            env={"IMPROVED_NATS_TOKEN_FILE": str(token)})
        assert rc == 0 and msgspec.json.decode(out)["status"] == "pending", out
        rc, out = await cli("propose", "-", "--nats", server.url, stdin=proposal)
        assert rc == 2 and len(out.splitlines()) == 1, out
        assert out.startswith(f"improved: NATS at {server.url} refused a connection without "
                              "credentials (authorization violation)"), out
        rc, out = await cli("propose", "-", "--nats", server.url, stdin=proposal,
                            env={"IMPROVED_NATS_TOKEN_FILE": str(tmp_path / "nope")})
        assert (rc, out.strip()) == (2, "improved: config error: nats.token_file "
                                        "(IMPROVED_NATS_TOKEN_FILE): cannot read "
                                        f"{tmp_path / 'nope'}: No such file or directory")
    finally:
        assert daemon.stop() == 0, daemon.output()
        server.stop()
    assert "t0ken-s3cret" not in daemon.output()


async def test_provision_says_at_once_when_the_server_has_no_jetstream(tmp_path):
    """Start-up retries wait for a cluster electing its leaders, not for a server with no
    JetStream at all: that is one line, at once."""
    port = bus.free_port()
    conf = tmp_path / "plain.conf"
    conf.write_text(f"listen: 127.0.0.1:{port}\n")
    proc = start_server(conf, port, tmp_path / "plain.log")
    try:
        began = time.monotonic()
        rc, out = await cli("provision", "--nats", f"nats://127.0.0.1:{port}")
        took = time.monotonic() - began
    finally:
        stop_server(proc)
    assert (rc, out.strip()) == (2, f"improved provision: nats://127.0.0.1:{port}: JetStream "
                                    "is not available there (not enabled, or not ready yet)")
    assert took < 5, took


# -- c) the server configs -------------------------------------------------------------------


@pytest.mark.parametrize("conf", SERVER_CONFIGS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_server_config_is_valid(conf):
    done = subprocess.run([bus.nats_server_binary(), "-c", str(conf), "-t"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "is valid" in done.stdout + done.stderr
    text = conf.read_text()
    assert re.search(r"^\s*sync_interval:\s*always\b", text, re.M)
    assert re.search(r"^include \S*accounts\.conf$", text, re.M)


def test_config_check_rejects_a_broken_config(tmp_path):
    """`-t` really checks: a typo in a copy of the accounts file fails it."""
    broken = tmp_path / "accounts.conf"
    broken.write_text(ACCOUNTS.read_text().replace("allow_responses: true", "allow_responsez: true", 1))
    conf = tmp_path / "server.conf"
    conf.write_text(f"listen: 127.0.0.1:{bus.free_port()}\ninclude ./accounts.conf\n")
    done = subprocess.run([bus.nats_server_binary(), "-c", str(conf), "-t"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0


def test_cluster_nodes_are_distinct():
    seen: dict[str, set[str]] = {"server_name": set(), "listen": set(), "store_dir": set(),
                                 "http": set()}
    for conf in CLUSTER:
        text = conf.read_text()
        for key in seen:
            seen[key].add(re.search(rf"^\s*{key}:\s*(\S+)", text, re.M).group(1))
        routes = re.findall(r"nats-route://\S+:(62\d\d)", text)
        assert sorted(routes) == ["6222", "6223", "6224"]
    assert all(len(values) == 3 for values in seen.values()), seen
    assert seen["listen"] == {"127.0.0.1:4222", "127.0.0.1:4223", "127.0.0.1:4224"}


def test_single_node_config_runs_with_fsync_always(tmp_path):
    ports = {"client": bus.free_port(), "http": bus.free_port()}
    conf = _local_copy(DEPLOY / "nats-single.conf", tmp_path, ports, tmp_path / "store")
    proc = start_server(conf, ports["client"], tmp_path / "server.log")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['http']}/varz", timeout=2) as r:
            varz = msgspec.json.decode(r.read())
    finally:
        stop_server(proc)
    assert varz["max_payload"] == 1_048_576
    assert varz["jetstream"]["config"]["sync_always"] is True
    assert varz["system_account"] == "SYS"


@pytest.mark.slow
async def test_cluster_configs_form_a_cluster_that_takes_r3_streams(tmp_path):
    """The three node configs (ports moved) elect a meta leader and hold R3 streams made by
    the daemon's Store with replicas=3."""
    cluster = Cluster(tmp_path)
    try:
        cluster.start()
        conn = await connect_as(cluster.url(1), "improved-admin")
        try:
            store = Store(conn.nc, replicas=3)

            async def ensured():
                try:
                    await store.ensure()
                    return True
                except Exception:  # no meta leader yet
                    return False

            await eventually(ensured, timeout=30, interval=0.5)
            info = await store.js.stream_info(S.STREAM_AUDIT)
            assert info.config.num_replicas == 3
            assert len(info.cluster.replicas or []) == 2  # the leader and two followers
        finally:
            await conn.nc.close()
    finally:
        cluster.stop()


# -- d) scripts and the unit -----------------------------------------------------------------


def test_scripts_parse_and_are_strict():
    for script in ("up.sh", "down.sh"):
        path = DEPLOY / script
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "set -euo pipefail" in path.read_text()
        assert os.access(path, os.X_OK), f"{script} is not executable"


@pytest.mark.slow
def test_up_and_down_scripts_run_the_cluster_and_two_daemons(tmp_path):
    """deploy/up.sh on the fixed ports of the cluster configs (provisioning as improved-admin,
    then the daemons as improved), a proposal through it as the operator, then
    deploy/down.sh --purge. Skipped when any of those ports is taken."""
    busy = [p for base in (4222, 6222, 8222) for p in range(base, base + 3) if _listening(p)]
    if busy:
        pytest.skip(f"ports {busy} are in use; up.sh needs 4222-4224, 6222-6224, 8222-8224")
    run_dir = tmp_path / "run"
    env = {**os.environ, "IMPROVED_RUN_DIR": str(run_dir)}
    try:
        up = subprocess.run([str(DEPLOY / "up.sh")], capture_output=True, text=True, env=env,
                            timeout=180)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "two daemon replicas ready" in up.stdout
        assert "provisioned nats://127.0.0.1:4222" in up.stdout, up.stdout
        assert "stream IMPROVE_AUDIT: R3" in up.stdout, up.stdout
        proposal = (ROOT / "examples" / "rank-l0.json").read_text().replace('"demo"',
                                                                            '"ranking"')
        improved = str(ROOT / ".venv" / "bin" / "improved")
        url = f"nats://operator:{PASSWORDS['operator']}@127.0.0.1:4223"
        done = subprocess.run([improved, "propose", "--json", "-", "--nats", url], input=proposal,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        pid = msgspec.json.decode(done.stdout)["proposal_id"]
        def verified() -> subprocess.CompletedProcess | None:
            check = subprocess.run([improved, "audit", "verify", pid, "--nats", url,
                                    "--checkpoint",  # names the daemons' key, to trust
                                    str(run_dir / "daemon-1" / "last-checkpoint.json")],
                                   capture_output=True, text=True, timeout=60)
            return check if "4 trailers" in check.stdout else None

        # the proposal's chain: registered, triaged, dispatched, applied
        check = eventually_blocking(verified, 20, 0.5)
        assert check.returncode == 0 and "1/1 chains verified, 4 trailers" in check.stdout, (
            check.stdout + check.stderr)
        # and the whole log, with the replicas' signed checkpoints, verifies too
        whole = subprocess.run([improved, "audit", "verify", "--nats", url, "--checkpoint",
                                str(run_dir / "daemon-1" / "last-checkpoint.json")],
                               capture_output=True, text=True, timeout=60)
        assert whole.returncode == 0 and "holds" in whole.stdout, whole.stdout + whole.stderr
        for i in (1, 2):  # as user improved, the replicas were refused nothing they tried
            log = (run_dir / "logs" / f"improved-{i}.log").read_text()
            assert "permissions violation" not in log.lower(), log
    finally:
        down = subprocess.run([str(DEPLOY / "down.sh"), "--purge"], capture_output=True,
                              text=True, env=env, timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not run_dir.exists()
    assert not [p for p in (4222, 4223, 4224) if _listening(p)]


@pytest.mark.slow
def test_up_says_at_once_when_a_daemon_it_started_dies(tmp_path):
    """A daemon replica that exits while up.sh waits for it to be ready: up.sh stops waiting
    at once (not after its minute), exits non-zero, and shows the daemon's exit status and
    the last lines of its log. Skipped when the cluster's fixed ports are taken."""
    busy = [p for base in (4222, 6222, 8222) for p in range(base, base + 3) if _listening(p)]
    if busy:
        pytest.skip(f"ports {busy} are in use; up.sh needs 4222-4224, 6222-6224, 8222-8224")
    venv = ROOT / ".venv" / "bin"
    fake = tmp_path / "venv" / "bin"
    fake.mkdir(parents=True)
    for exe in ("python", "nats-server"):
        (fake / exe).symlink_to(Path(os.path.realpath(venv / exe)) if exe == "nats-server"
                                else venv / exe)
    # `improved run` as a daemon whose start fails; every other command is the real one
    (fake / "improved").write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = run ]; then\n'
        '  echo "improved: config error: trust.operators: simulated bad key" >&2\n'
        "  exit 2\n"
        "fi\n"
        f'exec "{venv / "improved"}" "$@"\n')
    (fake / "improved").chmod(0o755)
    run_dir = tmp_path / "run"
    env = {**os.environ, "IMPROVED_RUN_DIR": str(run_dir), "IMPROVED_VENV": str(fake.parent),
           "WITH_RANKING": "0"}
    try:
        began = time.monotonic()
        up = subprocess.run([str(DEPLOY / "up.sh")], capture_output=True, text=True, env=env,
                            timeout=180)
        waited = time.monotonic() - began
        assert up.returncode != 0, up.stdout + up.stderr
        assert "provisioned nats://127.0.0.1:4222" in up.stdout, up.stdout + up.stderr
        assert "up.sh: daemon replica 1 exited (status 2) before it was ready" in up.stderr, (
            up.stderr)
        assert "  | improved: config error: trust.operators: simulated bad key" in up.stderr
        assert "not ready within" not in up.stderr
        # cluster and provisioning take seconds; the daemon's own wait is a minute
        assert waited < 50, waited
    finally:
        down = subprocess.run([str(DEPLOY / "down.sh"), "--purge"], capture_output=True,
                              text=True, env=env, timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not [p for p in (4222, 4223, 4224) if _listening(p)]


UNIT = DEPLOY / "improved.service"


def test_example_daemon_config_loads():
    from improved.client.config import load

    config = load(DEPLOY / "improved.toml")
    assert config.nats_url == "nats://127.0.0.1:4222"  # no password in the URL
    assert config.nats.user == "improved"
    assert config.nats.password_file == Path("/etc/improved/nats-password")
    assert config.replicas == 1 and config.data_dir == Path("/var/lib/improved")


def test_unit_is_a_notify_service_with_a_watchdog():
    text = UNIT.read_text()
    for line in ("Type=notify", "NotifyAccess=main", "WatchdogSec=30", "Restart=on-failure",
                 "RestartSec=2", "KillMode=mixed", "KillSignal=SIGTERM", "TimeoutStopSec=120",
                 "TimeoutStartSec=180",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes",
                 "ExecStart=/opt/improved/.venv/bin/improved run "
                 "--config /etc/improved/improved.toml"):
        assert re.search(rf"^{re.escape(line)}$", text, re.M), line
    assert re.search(r"^ReadWritePaths=/var/lib/improved$", text, re.M)
    assert re.search(r"^After=.*network-online\.target.*nats-server\.service", text, re.M)
    assert re.search(r"^User=improved$", text, re.M)
    # the stop drains for up to DRAIN_S, then signs a last checkpoint: room for both
    from improved.runtime.daemon import DRAIN_S

    stop = int(re.search(r"^TimeoutStopSec=(\d+)$", text, re.M).group(1))
    assert stop >= DRAIN_S + 60


def test_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed; the unit's content is checked above")
    # verify insists that ExecStart exists: point it at this checkout's entry point.
    exe = Path(bus.nats_server_binary()).parent / "improved"
    if not exe.exists():
        pytest.skip(f"{exe} is not installed, and verify needs ExecStart to exist")
    unit = tmp_path / "improved.service"
    unit.write_text(UNIT.read_text().replace("/opt/improved/.venv/bin/improved", str(exe)))
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                          timeout=60)
    if done.returncode != 0 and "Failed to" in done.stderr and "bus" in done.stderr.lower():
        pytest.skip(f"systemd-analyze cannot run here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "improved.service" not in done.stderr, done.stderr  # no warnings about the unit
