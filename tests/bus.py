"""Helpers for tests against a live nats-server and daemon: the test daemons' config, waiting
for a condition, publishing signed acts, sending orders by hand, reading a proposal's audit
chain, a stand-in owning service, a store that crashes at the worst moment, and the L4 steps
(an artefact store, an approval, a quorum case) several suites share."""

from __future__ import annotations

import asyncio
import atexit
import base64
import shutil
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import NamedTuple

import msgspec
import nats.errors
import nats.js.errors
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client.parser import text_string_to_metric_families

from improved import testing
from improved.client import connection, keys
from improved.client.config import ApplySettings, Config, Trust
from improved.client.sdk import MeshClient
from improved.core import authority, quorum, signing
from improved.core.authority import Act
from improved.protocol import canonical, subjects
from improved.protocol.model import (
    ApplyOrder,
    ApplyResult,
    GrantCommand,
    Proposal,
    ProposalEdit,
    to_json,
)
from improved.runtime.metrics import Metrics
from improved.runtime.store import Store
from improved_reference.artefact_store import ArtefactStore
from tests.builders import CHANGELOG_DIFF, CONSTITUTION
from tests.factories import now_ms, review, sha, swap
from tests.keys import AGENT_A, AGENT_B, ALICE, CHECK, EVALUATOR, SERVICE, VOTERS

# The run's scratch space (the test daemons' checkpoint key and data directories, and what
# `scratch` hands out), removed when the run ends: nothing is left under the temp dir.
_ROOT = Path(tempfile.mkdtemp(prefix="improved-tests-"))
atexit.register(shutil.rmtree, _ROOT, True)
_KEYS = _ROOT / "keys"
_KEYS.mkdir()


def scratch(prefix: str) -> Path:
    """A new directory in the run's scratch space, removed with it at the end of the run."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=_ROOT))


def daemon_config(**overrides) -> Config:
    """Short apply timeouts, ALICE trusted as an operator, a data directory of its own (where
    it keeps its last checkpoint) and the test daemons' one checkpoint key, so that each trusts
    the checkpoints the others signed on a shared server."""
    apply = overrides.pop("apply", ApplySettings(timeout_s=1.0, attempts=2, max_deliveries=3))
    public = base64.b64encode(signing.raw_public(ALICE[1].public_key())).decode()
    signers = {name: base64.b64encode(signing.raw_public(key.public_key())).decode()
               for name, key in (CHECK, EVALUATOR, AGENT_A, AGENT_B, SERVICE)}
    trust = overrides.pop("trust", Trust(operators={ALICE[0]: public}, signers=signers))
    # kept out of the work tree: a data directory left behind would hold the last checkpoint
    # of a server that is gone, and the next run's daemon would rightly call that a loss
    overrides.setdefault("data_dir", _KEYS / f"data-{uuid.uuid4().hex[:8]}")
    overrides.setdefault("checkpoint_key", _KEYS / "checkpoint.pem")
    return Config(apply=apply, trust=trust, **overrides)


def quorum_config(amendment: str | None, **overrides) -> Config:
    """`daemon_config` with `policy.quorum` on under the constitution edit `amendment`, and
    VOTERS' keys trusted as quorum voters."""
    base = daemon_config(**overrides)
    voters = {n: base64.b64encode(signing.raw_public(k.public_key())).decode()
              for n, k in VOTERS.items()}
    return msgspec.structs.replace(
        base, policy=msgspec.structs.replace(base.policy, quorum=True,
                                             quorum_amendment=amendment),
        trust=Trust(operators=base.trust.operators, quorum=voters))


QUORUM_AMENDS = "VII: IV.2 an L4 change may pass on a signed quorum (SPEC 09 §6)"


def charter(svc: str, amends: str = QUORUM_AMENDS) -> Proposal:
    """A constitution edit (scope charter, L4, `amends`, a CHANGELOG entry in its diff)."""
    return testing.proposal(
        svc, f"doc:{CONSTITUTION}", "L4", template="amend", analyzer="ops.amend/1",
        actor="operator:alice", scope="charter", amends=amends, created_at=now_ms(),
        proposal_edit=ProposalEdit(format="unified", base_digest=sha("v5"),
                                   diff=CHANGELOG_DIFF))


async def amendment(url: str, svc: str = "charter", *, approved: bool = True,
                    amends: str = QUORUM_AMENDS) -> str:
    """The id of a constitution edit permitting the L4 quorum, proposed through a daemon with
    the quorum off and (with `approved`) approved by ALICE's signed review, as an operator
    would before switching the quorum on. That daemon is stopped again."""
    nc = await connection.connect(url, "amendment")
    from improved.runtime.daemon import Daemon

    daemon = Daemon(nc, daemon_config())
    await daemon.start()
    try:
        client = MeshClient(nc, svc)
        pid = (await client.propose(charter(svc, amends))).proposal_id
        if approved:
            await approve(nc, client, svc, pid)

            async def is_approved():
                state = await client.state(pid)
                return state is not None and state.status == "approved"

            await eventually(is_approved)
    finally:
        await daemon.stop()
        await connection.close(nc)
    return pid


async def eventually(check, timeout: float = 10.0, interval: float = 0.05, *,
                     what: str = "condition", tolerate: tuple[type[BaseException], ...] = ()):
    """Await `check()` until it returns something truthy, and return that; fail naming `what`
    with its last value. An exception of a `tolerate`d type counts as not yet (a broker
    restarting, a cluster electing its leader). The tests' one way of waiting for an effect."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = await check()
        except tolerate as exc:
            last = exc
        else:
            if last:
                return last
        await asyncio.sleep(interval)
    raise AssertionError(f"{what} not met within {timeout}s (last: {last!r})")


async def logged(logs: list[dict], event: str, timeout: float = 10.0, **fields) -> dict:
    """The first entry of `logs` (structlog.testing.capture_logs) that is `event` with these
    `fields`, waited for: the event that proves a thing did not happen (the daemon refused the
    apply) instead of a sleep before looking."""
    def first() -> dict | None:
        return next((e for e in logs if e.get("event") == event
                     and all(e.get(k) == v for k, v in fields.items())), None)

    return await eventually(lambda: asyncio.sleep(0, first()), timeout,
                            what=f"{event!r} logged with {fields}")


async def refusal(nc, svc: str, subject: str, timeout: float = 10.0) -> dict:
    """The daemon's record (stream IMPROVED_REFUSED) of the first message it refused on
    `subject`, waited for: the event that proves a hostile message moved nothing."""
    js = nc.jetstream()
    sub = await js.subscribe(subjects.refused(svc), ordered_consumer=True,
                             stream=subjects.STREAM_REFUSED)
    try:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                record = msgspec.json.decode((await sub.next_msg(timeout=left)).data)
            except nats.errors.TimeoutError:
                break
            if record["subject"] == subject:
                return record
        raise AssertionError(f"nothing refused on {subject} within {timeout}s")
    finally:
        await sub.unsubscribe()


def log_events(log: Path, event: str) -> list[str]:
    """The lines of a JSON log naming `event`."""
    return [line for line in log.read_text().splitlines() if f'"event": "{event}"' in line]


def eventually_blocking(check, timeout: float = 10.0, interval: float = 0.1, *,
                        what: str = "condition"):
    """`eventually` for a test that is not a coroutine (a daemon in another process, the
    `improved` command): call `check()` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not met within {timeout}s (last: {last!r})")


def wait_for_event(log: Path, event: str, count: int = 1, timeout: float = 15.0) -> str:
    """The `count`-th line of a JSON log naming `event`, waited for."""
    def found() -> str | None:
        lines = log_events(log, event)
        return lines[count - 1] if len(lines) >= count else None

    try:
        return eventually_blocking(found, timeout, 0.05)
    except AssertionError:
        raise AssertionError(f"no {count}× {event!r} in the log:\n{log.read_text()[-3000:]}")\
            from None


async def publish(nc, subject: str, env) -> None:
    """Publish a signed act (review, grant, vote...) to its JetStream subject."""
    await nc.jetstream().publish(subject, to_json(env))


async def chain_ids(daemon, svc: str) -> list[str]:
    """The ids of the proposals with a chain under `svc` on the audit stream, sorted."""
    info = await daemon.store.js.stream_info(subjects.STREAM_AUDIT,
                                             subjects_filter=subjects.audit(svc, "*"))
    return sorted(s.rsplit(".", 1)[1] for s in (info.state.subjects or {}))


async def trailers(daemon, svc, pid):
    """The trailers of `pid`'s audit chain, oldest first."""
    return [b for _, b in await daemon.store.read_chain(svc, pid)]


def as_result(data: bytes) -> ApplyResult:
    """The reply as an ApplyResult; an error reply ("not now": the daemon would retry) reads
    as a failed one here, with its message."""
    body = msgspec.json.decode(data)
    if isinstance(body.get("error"), dict):
        return ApplyResult(ok=False, error=body["error"]["message"])
    return msgspec.convert(body, type=ApplyResult)


async def send(nc, svc: str, o: ApplyOrder | bytes) -> tuple[ApplyResult, bytes]:
    """One ApplyOrder sent by hand to `<svc>.improve.apply`: (its reply as a result, raw)."""
    body = o if isinstance(o, bytes) else to_json(o)
    reply = await nc.request(subjects.apply_request(svc), body, timeout=5)
    return as_result(reply.data), reply.data


def crash_once_after_the_write(store) -> None:
    """Make a reference store crash once between writing a value and completing its ledger
    entry, as a process dying at the worst moment would."""
    real = store.ledger.update
    calls = 0

    async def crash_once(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("crashed after the write")
        return await real(*args, **kwargs)

    store.ledger.update = crash_once


async def applied_at_l2(nc, proposal: Proposal) -> str:
    """Propose `proposal` (a skill) at L2, approve it as ALICE and wait until it is applied:
    the L2 proposal an L3 grant of its definition names (SPEC 09 §3). Something must be
    serving `proposal.service`'s applies."""
    client = MeshClient(nc, proposal.service)
    # made before `proposal` (an L3 of the same definition it may be) so it supersedes nothing
    l2 = msgspec.structs.replace(proposal, change_class="L2", created_at=proposal.created_at - 1)
    pid = (await client.propose(l2)).proposal_id
    await client.triage(pid)
    await publish(nc, subjects.inbound_review(proposal.service), review(pid))
    outcome = await eventually(lambda: client.outcome(pid))
    assert outcome.ok, outcome.error
    return pid


class Applier:
    """A stand-in owning service: records every ApplyOrder, applies each id once."""

    def __init__(self):
        self.orders: list[str] = []
        self.authorities: list[str] = []

    async def __call__(self, order) -> ApplyResult:
        self.orders.append(order.proposal_id)
        self.authorities.append(order.authority)
        skill = order.proposal.proposal_data["skill"]
        return ApplyResult(ok=True, applied_id=canonical.skill_identity(skill),
                           inverse={"retract": canonical.skill_identity(skill)},
                           rollbackable=True)


# -- L4 ------------------------------------------------------------------------------------------


async def started(nc, svc: str, seed: dict[str, str],
                  key: Ed25519PrivateKey | None = None) -> ArtefactStore:
    """The reference artefact store of `svc`, started and seeded with `seed`; with `key`,
    signing its answers (`KVService.use_key`)."""
    store = ArtefactStore(nc, svc)
    store.use_key(key)
    await store.start()
    await store.seed(seed)
    return store


async def approve(nc, client, svc, pid):
    """ALICE's signed approval of `pid`, once the daemon has decided it."""
    await eventually(lambda: client.decision(pid))
    await publish(nc, subjects.inbound_review(svc), review(pid))


@asynccontextmanager
async def serving(nc, store, buckets):
    """`store` started for the test, then stopped and its KV `buckets` deleted."""
    await store.start()
    try:
        yield store
    finally:
        await store.stop()
        for bucket in buckets:
            await nc.jetstream().delete_key_value(bucket)


class KVRevision(NamedTuple):
    value: bytes
    revision: int


async def kv_history(nc, bucket: str, key: str) -> list[KVRevision]:
    """Every revision KV `bucket` keeps of `key`, oldest first, read message by message from
    the bucket's stream (not a history watch, whose end-of-history marker can arrive before
    the first entry on a loaded machine)."""
    js, stream, subject = nc.jetstream(), f"KV_{bucket}", f"$KV.{bucket}.{key}"
    found: list[KVRevision] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(stream, seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return found
        found.append(KVRevision(msg.data or b"", msg.seq))
        seq = msg.seq + 1


async def kv_revisions(nc, bucket: str, key: str) -> int:
    """How many revisions KV `bucket` keeps of `key` (0 when it has none)."""
    return len(await kv_history(nc, bucket, key))


async def rolled_back(nc, client, svc, pid, reason: str = "undo it"):
    """ALICE's signed rollback of the applied `pid`, then its status rolled_back."""
    await publish(nc, subjects.inbound_review(svc), review(pid, verdict="rollback",
                                                           reason=reason))

    async def done():
        state = await client.state(pid)
        return state is not None and state.status == "rolled_back"

    await eventually(done)


async def outcome(client, pid):
    return await eventually(lambda: client.outcome(pid), timeout=15)


async def quorum_case(nc, daemon, svc):
    """An L4 swap on a quorum daemon, deferred for its quorum: (store, client, proposal id)."""
    store = await started(nc, svc, {"a": '{"v": 1}'})
    client = MeshClient(nc, svc)
    pid = await client.publish(swap(svc, {"a": '{"v": 2}'}))
    decision = await eventually(lambda: client.decision(pid))
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_quorum")
    return store, client, pid


async def whole_log_breaks(url: str) -> list[str]:
    """Every chain on the server verified as an auditor would, trusting the test daemons'
    key and the test identities' keys: the breaks found (the first of each broken chain).
    The tool runtimes' chains (their own stream) too: the session's runtimes sign with the
    test daemons' key."""
    from improved.core import audit, evidence

    def b64(key) -> str:
        return base64.b64encode(signing.raw_public(key.public_key())).decode()

    daemon = signing.keyid_of(signing.raw_public(daemon_key().public_key()))
    keyset = evidence.KeySet.from_config(
        {ALICE[0]: b64(ALICE[1])}, {name: b64(k) for name, k in VOTERS.items()},
        {name: b64(k) for name, k in (CHECK, EVALUATOR, AGENT_A, AGENT_B)})
    trust = evidence.ChainTrust(frozenset({daemon}), evidence.History(fallback=keyset))
    nc = await connection.connect(url, "improved-test-audit")
    try:
        log, _ = await Store(nc).read_audit()
        tools = Store(nc, audit_stream=subjects.STREAM_TOOLS_AUDIT)
        view = await tools.audit_view()
        log += [(seq, subject, body) async for seq, subject, body, _
                in tools.follow(subjects.TOOLS_AUDIT_FILTER, 1, view.last_seq)
                if body is not None]
    finally:
        await connection.close(nc)
    chains: dict[str, list[tuple[int, dict]]] = {}
    for seq, subject, body in log:
        chains.setdefault(subject, []).append((seq, body))
    breaks = []
    for subject, entries in chains.items():
        brk = audit.verify_chain(subjects.token(subject, 3) or "", [b for _, b in entries],
                                 trust, [seq for seq, _ in entries])
        if brk is not None:
            breaks.append(f"{subject}: {brk}")
    return breaks


async def quorum_reads(daemon, svc: str, pid: str) -> list[str]:
    """What a voter reads of `pid`: the digests of the proposal, its body and its triage
    record as its chain has them, and the SPEC version."""
    return quorum.expected_reads(await daemon.engine.records.rebuild(svc, pid))


# -- reading the daemon's metrics --------------------------------------------------------------


def samples(m: Metrics) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return samples(m).get((name, frozenset(labels.items())))


# -- grants without a daemon ---------------------------------------------------------------------


async def record_grant(nc, identity: str, *, active: bool = True,
                       expires_at: int | None = None) -> None:
    """ALICE's signed grant (or revocation) of `identity`, verified and recorded on the skill
    hash's grant chain the way the daemon records it: for tests of services without a daemon.
    (A retained Grant record proves nothing; the chain is what a service reads.)"""
    cmd = GrantCommand(op="grant" if active else "revoke", skill=identity, principal=ALICE[0],
                       reason="tofu", at=int(time.time() * 1000), expires_at=expires_at)
    env = signing.sign(signing.PAYLOAD_TYPES["grant"], to_json(cmd), ALICE[1])
    trust = signing.TrustStore.from_config(
        {ALICE[0]: base64.b64encode(signing.raw_public(ALICE[1].public_key())).decode()})
    verified = trust.verify(env, signing.PAYLOAD_TYPES["grant"])
    sha = identity.split(":", 1)[1]

    def next_draft(chain, now):
        return authority.grant_act([], Act(verified.digest, len(chain) + 1), verified, cmd, None,
                                   "improved:test")

    store = Store(nc)
    store.signer = daemon_key()  # as a test daemon writes it: its checkpoint verifies the log
    await store.append_sealed(subjects.grant_audit(sha), sha, "L3", "knowledge", next_draft,
                              whole=True)


def daemon_key():
    """The test daemons' one key (`daemon_config`'s checkpoint key), created on first use."""
    return keys.load_or_create_key(_KEYS / "checkpoint.pem")


@asynccontextmanager
async def daemon_with_records_ttl(url: str, svc: str, ttl_s: float, name: str):
    """A daemon whose closed proposals' records and dedup keys carry a TTL of `ttl_s`
    (`records_ttl_days`), and an owning service of `svc` that applies every order at once:
    (daemon, connection, the service's MeshClient)."""
    config = msgspec.structs.replace(daemon_config(), records_ttl_days=ttl_s / 86400)
    async with serving_daemon(url, svc, name, config) as running:
        yield running


@asynccontextmanager
async def serving_daemon(url: str, svc: str, name: str, config: Config | None = None):
    """A daemon of its own on `url` (`config`, default `daemon_config()`), and an owning
    service of `svc` that applies every order at once: (daemon, connection, the service's
    MeshClient). Both stop, and the connection closes, on the way out."""
    from improved.runtime.daemon import Daemon

    nc = await connection.connect(url, name)
    daemon = Daemon(nc, config or daemon_config())
    await daemon.start()
    client = MeshClient(nc, svc)

    async def applier(order) -> ApplyResult:
        return ApplyResult(ok=True, applied_id="x", inverse={"delete": "x"}, rollbackable=True)

    sub = await client.serve_apply(applier)
    try:
        yield daemon, nc, client
    finally:
        await sub.unsubscribe()
        await daemon.stop()
        await connection.close(nc)


async def trusted_service(daemon, svc: str) -> Ed25519PrivateKey:
    """A key `daemon` trusts as `service:<svc>` from now on, taken as a SIGHUP reload takes
    it (recorded on the trust chain first): the service's signed answers to the daemon's
    requests are then attributable to it (core.boundary). The keys it trusted stay."""
    key = Ed25519PrivateKey.generate()
    trust = daemon.config.trust
    signers = {**trust.signers,
               f"service:{svc}": base64.b64encode(signing.raw_public(key.public_key())).decode()}
    await daemon.reload_trust(msgspec.structs.replace(
        daemon.config, trust=msgspec.structs.replace(trust, signers=signers)))
    return key


async def measurement(daemon, svc: str, pid: str, timeout: float = 15.0) -> dict:
    """The learn-back trailer recording `pid`'s measurement at review_after (held,
    regressed or unmeasured), once it is on the chain."""

    async def found():
        chain = await trailers(daemon, svc, pid)
        return next((t for t in chain if t.get("verdict") in ("held", "regressed",
                                                              "unmeasured")), None)

    return await eventually(found, timeout=timeout)


@asynccontextmanager
async def own_daemon(server, tmp_path, name: str):
    """A connection to `server` and a daemon of its own on it, whose checkpoints the test
    signs when it wants them (`daemon.engine.checkpoints.checkpoint`): for a test that trips mesh-wide
    state (the breaker, a crisis) the session daemon's other tests must not meet."""
    from improved.client import connection
    from improved.runtime.daemon import Daemon

    conn = await connection.connect(server.url, name)
    daemon = Daemon(conn, msgspec.structs.replace(daemon_config(), checkpoint_interval_s=0.0,
                                                  data_dir=tmp_path / "data"))
    await daemon.start()
    try:
        yield conn, daemon
    finally:
        await daemon.stop()
        await connection.close(conn)
