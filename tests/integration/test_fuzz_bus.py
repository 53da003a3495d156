"""Fuzz every subject the daemon listens on, through the real bus, against the session daemon:
random bytes, random JSON, contract-shaped messages with one field mutated, and hand-written
hostile cases (oversized, 10,000-deep, huge arrays, invalid UTF-8, NaN/Infinity, 1e999, paths
escaping with `..`, a forged `rec_status`).

- every request (`<svc>.improve.propose|triage|refine`, `improved.spec.get`) gets a reply that is
  a valid record or `{"error": {"code", "message", ...}}` with a documented code, never
  `internal`, and agrees with the pure validation of the same bytes;
- every inbound publish (`improve.proposals|triage|applied|outcomes.<svc>`, `improve.grants`,
  `improve.quorum`) is taken by the broker and refused or handled without harm;
- afterwards nothing is stored for a fuzzed service (no state key, no chain, no retained record)
  but for the valid proposals among the inputs; escaping targets end rejected
  `forbidden_target` and are never ordered applied; the consumer task is alive
  (`daemon.healthy()`), and a good proposal is still registered.

Bounded: `max_examples` keeps the file under 20 s; `FUZZ_EXAMPLES` scales it."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import uuid
from collections import Counter
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from improved.client import connection
from improved.client.sdk import MeshClient
from improved.core import propose, signing
from improved.core.inbound import proposal_of, signal_of
from improved.protocol import subjects as S
from improved.protocol import wire
from improved.protocol.model import (
    ApplyReport,
    ProposeReply,
    RefineReply,
    TriageDecision,
    TriageRequest,
    to_json,
)
from improved.runtime import bus
from improved.runtime.daemon import Daemon
from tests.bus import daemon_config, eventually
from tests.factories import rank_proposal, signal, skill_proposal
from tests.keys import AGENT_A

pytestmark = pytest.mark.asyncio(loop_scope="session")

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "800"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                suppress_health_check=list(HealthCheck))
LIMIT = 256 * 1024  # the session daemon's max_message_bytes (the default)
CODES = {"invalid_json", "invalid_type", "invalid_value", "missing_field", "unknown_field",
         "status_forbidden", "body_count", "too_large", "too_deep", "subject_mismatch",
         "not_found", "not_supported", "not_awaiting_apply"}  # `internal` is a daemon fault

RUN = uuid.uuid4().hex[:6]
SVC = f"fz-{RUN}"  # the service every fuzz case targets
TOKENS = [SVC, SVC, SVC, "Bad", "x" * 70, "_grants"]  # and a few tokens no service can have
CASES: Counter = Counter()
REGISTERED: set[str] = set()  # every proposal legitimately registered under SVC by this file


# -- what the fuzz cases are made of ---------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                                  max_size=5),
    max_leaves=20)


def base_messages(svc: str) -> dict[str, dict[str, Any]]:
    """One well-formed message of each kind, to mutate."""
    pid = "ab" * 32
    return {
        "rank": msgspec.to_builtins(rank_proposal(svc, key=f"fz{RUN}")),
        "skill": msgspec.to_builtins(skill_proposal(svc, name=f"fz{RUN}")),
        "signal": msgspec.to_builtins(signal(svc, "mcp:fz:1", proposal_id=pid)),
        "triage": {"proposal_id": pid},
        "report": {"proposal_id": pid, "service": svc, "ok": True, "applied_id": "x"},
        "envelope": {"payloadType": "application/vnd.improved.review+json",
                     "payload": "e30=", "signatures": [{"keyid": "k", "sig": "c2ln"}]},
        # a proposal signed by a trusted agent of another service (signer_mismatch as it is;
        # a changed payload or signature, bad_signature; a changed type, invalid_value)
        "signed": msgspec.to_builtins(signing.sign(
            signing.PAYLOAD_TYPES["proposal"],
            to_json(rank_proposal(svc, key=f"fzs{RUN}")), AGENT_A[1])),
    }


@st.composite
def mutated(draw, svc: str = SVC) -> bytes:
    """A contract-shaped message with one change: a field set to any JSON value, removed, or
    added; sometimes one level down."""
    body = dict(draw(st.sampled_from(sorted(base_messages(svc).items())))[1])
    target = body
    nested = [k for k, v in body.items() if isinstance(v, dict)]
    if nested and draw(st.booleans()):
        key = draw(st.sampled_from(nested))
        target = body[key] = dict(body[key])
    op = draw(st.sampled_from(["set", "drop", "add"]))
    if op == "set" and target:
        target[draw(st.sampled_from(sorted(target)))] = draw(json_values)
    elif op == "drop" and target:
        target.pop(draw(st.sampled_from(sorted(target))))
    else:
        target[draw(st.text(min_size=1, max_size=12))] = draw(json_values)
    return json.dumps(body).encode()


payloads = st.one_of(
    st.binary(max_size=600),
    json_values.map(lambda v: json.dumps(v).encode()),
    mutated(),
)


def hostile(svc: str) -> list[tuple[str, bytes]]:
    good = msgspec.to_builtins(rank_proposal(svc, key=f"h{RUN}"))
    text = json.dumps(good)
    deep_list = b"[" * 10_000 + b"]" * 10_000
    return [
        ("oversized", json.dumps({**good, "proposal_data": {"blob": "x" * 300_000}}).encode()),
        ("oversized junk", b"\x00" * (LIMIT + 1)),
        ("10,000-deep array", deep_list),
        ("10,000-deep object", b'{"a":' * 10_000 + b"1" + b"}" * 10_000),
        ("10,000-deep in proposal_data",
         text.replace('"value": 1.5', '"value": ' + "[" * 10_000 + "]" * 10_000).encode()),
        ("huge array", b"[" + b"0," * 100_000 + b"0]"),
        ("huge target_files", json.dumps({**good, "target_files": ["a"] * 50_000}).encode()),
        ("huge signals", json.dumps({**good, "signals": [{}] * 20_000}).encode()),
        ("invalid UTF-8", b'{"service": "\xff\xfe", "x": "\xc3\x28"}'),
        ("invalid UTF-8 in a string", text.replace('"adjust_rank"', '"adj\xffrank"')
         .encode("latin-1")),
        ("NaN", text[:-1].encode() + b', "confidence": NaN}'),
        ("Infinity", text.replace('"value": 1.5', '"value": Infinity').encode()),
        ("-Infinity", text.replace('"value": 1.5', '"value": -Infinity').encode()),
        ("1e999 confidence", text[:-1].encode() + b', "confidence": 1e999}'),
        ("1e999 in proposal_data", text.replace('"value": 1.5', '"value": 1e999').encode()),
        ("1e999 created_at", text.replace(f'"created_at": {good["created_at"]}',
                                          '"created_at": 1e999').encode()),
        ("rec_status", json.dumps({**good, "rec_status": "applied"}).encode()),
        ("status", json.dumps({**good, "status": "applied"}).encode()),
        ("empty", b""),
        ("null", b"null"),
        ("nul bytes", b'{"\x00": "\x00"}'),
        ("lone surrogate", text.replace('"adjust_rank"', '"\\ud800"').encode()),
        ("duplicate keys", text[:-1].encode() + b', "service": "someone-else"}'),
    ]


def escaping(svc: str) -> list[tuple[str, bytes]]:
    """Valid proposals whose targets climb out of their root: each must end rejected
    `forbidden_target`, never applied."""
    return [
        ("doc:../../etc/passwd", to_json(rank_proposal(
            svc, key=f"e1{RUN}", target_ref="doc:../../etc/passwd", change_class="L2"))),
        ('target_files ["../../x"]', to_json(rank_proposal(svc, key=f"e2{RUN}",
                                                            target_files=["../../x"]))),
        ("config:$COSMIX/../x", to_json(rank_proposal(svc, key=f"e3{RUN}",
                                                      target_ref="config:$COSMIX/../../x",
                                                      change_class="L2",
                                                      scope="operation"))),
        ("code: a/../../_spec", to_json(rank_proposal(
            svc, key=f"e4{RUN}", change_class="L4", scope="code",
            target_ref="code:a/../../_spec/2026-04-20-00-constitution.md"))),
    ]


# -- checking replies ------------------------------------------------------------------------------


REPLY_TYPES = {"propose": ProposeReply, "triage": TriageDecision, "refine": RefineReply}


SIGNERS = signing.TrustStore.from_config(daemon_config().trust.signers)  # the test daemons' signers


def local_verdict(kind: str, svc: str, data: bytes) -> str | None:
    """The error code the pure validation gives these bytes on this request, or None when
    they are valid (the daemon may still answer not_found for an unknown proposal)."""
    try:
        if not S.SERVICE_RE.match(svc):
            return "invalid_value"
        if kind == "propose":
            proposal, env = proposal_of(data, svc, LIMIT)  # a bare Proposal, or a signed one
            propose.identify(proposal)
            if env is not None:  # refused unless a trusted agent of `svc` signed it
                propose.verify_signed(SIGNERS, env, proposal)
        elif kind == "triage":
            wire.decode(data, TriageRequest, LIMIT)
        elif kind == "refine":
            sig, _ = signal_of(data, LIMIT)  # a bare Signal, or a signed one
            if sig.proposal_id is None:
                return "missing_field"
    except wire.WireError as err:
        return err.code
    return None


def check_reply(kind: str, svc: str, data: bytes, raw: bytes, valid: set[str]) -> None:
    reply = msgspec.json.decode(raw)  # a reply is always JSON
    assert isinstance(reply, dict), reply
    expected = local_verdict(kind, svc, data)
    if "error" in reply:
        err = reply["error"]
        assert isinstance(err, dict) and isinstance(err.get("message"), str), reply
        assert err.get("code") in CODES, reply
        if kind != "spec":
            if expected is not None:
                assert err["code"] == expected, (reply, expected)
            else:
                assert kind != "propose" and err["code"] == "not_found", reply
        return
    assert kind == "spec" or expected is None, (reply, expected)
    if kind == "spec":
        assert reply.get("service") == "improved" and "capabilities" in reply, reply
        return
    record = msgspec.convert(reply, type=REPLY_TYPES[kind])
    if kind == "propose":
        assert record.status in ("pending", "rejected", "expired"), reply
        valid.add(record.proposal_id)


async def request(nc, kind: str, token: str, data: bytes, valid: set[str]) -> None:
    subject = S.SPEC_GET if kind == "spec" else f"{token}.improve.{kind}"
    msg = await nc.request(subject, data, timeout=10)
    check_reply(kind, token, data, msg.data, valid)
    CASES[f"request {kind}"] += 1


INBOUND = ["proposals", "triage", "applied", "outcomes", "grants", "quorum"]


def inbound_subject(kind: str, token: str) -> str:
    return f"improve.{kind}" if kind in ("grants", "quorum") else f"improve.{kind}.{token}"


def valid_inbound(kind: str, token: str, data: bytes) -> tuple[str | None, bool]:
    """(the proposal id when this is a valid proposal for a real service token; whether it is
    a valid signal without a proposal id, which the analyzers may turn into a proposal)."""
    if not S.SERVICE_RE.match(token):
        return None, False
    try:
        if kind == "proposals":
            return propose.identify(propose.validate(data, token, LIMIT))[0], False
        if kind == "outcomes":
            return None, signal_of(data, LIMIT)[0].proposal_id is None
        if kind == "applied":
            wire.decode(data, ApplyReport, LIMIT)
    except wire.WireError:
        pass
    return None, False


class Inbound:
    """What was published on the inbound stream, and which of it was valid."""

    def __init__(self):
        self.valid: set[str] = set()
        self.observable = False

    async def publish(self, js, kind: str, token: str, data: bytes) -> None:
        ack = await js.publish(inbound_subject(kind, token), data, stream=S.STREAM_INBOUND)
        assert ack.stream == S.STREAM_INBOUND
        pid, observable = valid_inbound(kind, token, data)
        if pid is not None:
            self.valid.add(pid)
        self.observable |= observable
        CASES[f"inbound {kind}"] += 1


# -- what is stored afterwards ---------------------------------------------------------------------


async def stored_ids(daemon, token: str) -> dict[str, set[str]]:
    """Proposal ids with anything stored under the service token: chains, records."""
    js = daemon.store.js
    chains = await js.stream_info(S.STREAM_AUDIT, subjects_filter=S.audit(token, "*"))
    records = await js.stream_info(S.STREAM_RECORDS, subjects_filter=f"improve.*.{token}.*")
    return {
        "chains": {s.rsplit(".", 1)[1] for s in (chains.state.subjects or {})},
        "records": {s.rsplit(".", 1)[1] for s in (records.state.subjects or {})},
    }


async def assert_nothing_stored_but(daemon, allowed: set[str], observable: bool = False):
    allowed = allowed | REGISTERED
    for token in set(TOKENS) - {"_grants"}:
        stored = await stored_ids(daemon, token)
        for where, ids in stored.items():
            extra = ids - allowed if token == SVC else ids
            if extra and observable and where == "chains":  # proposals the analyzers made
                for pid in list(extra):
                    first = (await daemon.store.read_chain(token, pid))[0][1]
                    if any(r.startswith("analyzer:improved.") for r in first.get("refs", ())):
                        extra.discard(pid)
            assert not extra, f"{where} under {token!r} for unexpected proposals {extra}"


async def still_serving(daemon, nc) -> None:
    assert daemon.healthy(), "the daemon's consumer task died"
    reply = await MeshClient(nc, SVC).propose(rank_proposal(SVC, key=f"after{len(REGISTERED)}"))
    assert reply.status == "pending"
    REGISTERED.add(reply.proposal_id)
    assert (await daemon.store.read_chain(SVC, reply.proposal_id))


async def spy_orders(nc, seen: list[str]):
    async def on_order(msg):
        try:
            seen.append(msgspec.json.decode(msg.data)["proposal_id"])
        finally:
            await msg.respond(b'{"ok": false, "error": "fuzz: not applied"}')

    return await nc.subscribe(S.apply_request(SVC), cb=on_order)


async def fuzz(body, **strategies) -> None:
    """Run hypothesis over `await body(**example)`: hypothesis drives the examples (and shrinks
    a failure) in a worker thread, each example runs on this event loop, where the session
    daemon lives."""
    loop = asyncio.get_running_loop()

    def example(**kwargs):
        asyncio.run_coroutine_threadsafe(body(**kwargs), loop).result(timeout=60)

    await asyncio.to_thread(FUZZ(given(**strategies)(example)))


# -- the tests -------------------------------------------------------------------------------------


@pytest.mark.slow  # a fuzz suite: run after the default suite
async def test_fuzz_request_subjects(daemon, nc):
    valid: set[str] = set()
    seen: list[str] = []
    spy = await spy_orders(nc, seen)

    async def one(kind, token, data):
        await request(nc, kind, token, data, valid)

    await fuzz(one, kind=st.sampled_from(["propose", "triage", "refine", "spec"]),
               token=st.sampled_from(TOKENS), data=payloads)
    await still_serving(daemon, nc)
    await asyncio.sleep(0.2)
    REGISTERED.update(valid)
    await assert_nothing_stored_but(daemon, set(seen))
    await spy.unsubscribe()
    print(f"\nfuzz requests: {sum(v for k, v in CASES.items() if k.startswith('request'))} "
          f"cases, {len(valid)} valid proposals among them; total so far {sum(CASES.values())}")


@pytest.mark.slow  # a fuzz suite: run after the default suite
async def test_fuzz_inbound_subjects(daemon, nc):
    js = nc.jetstream()
    inbound = Inbound()
    seen: list[str] = []
    spy = await spy_orders(nc, seen)

    async def one(kind, token, data):
        await inbound.publish(js, kind, token, data)

    await fuzz(one, kind=st.sampled_from(INBOUND), token=st.sampled_from(TOKENS), data=payloads)
    # A good proposal behind them on the same stream: once it is registered, the consumer has
    # fetched (and decoded or refused) everything before it.
    sentinel = rank_proposal(SVC, key=f"sentinel{RUN}")
    pid = await MeshClient(nc, SVC).publish(sentinel)
    inbound.valid.add(pid)
    await eventually(lambda: MeshClient(nc, SVC).state(pid), timeout=15)
    await asyncio.sleep(0.3)
    await still_serving(daemon, nc)
    REGISTERED.update(inbound.valid)
    await assert_nothing_stored_but(daemon, set(), inbound.observable)
    await spy.unsubscribe()
    print(f"\nfuzz inbound: {sum(v for k, v in CASES.items() if k.startswith('inbound'))} "
          f"cases, {len(inbound.valid)} valid proposals among them; "
          f"total so far {sum(CASES.values())}")


async def test_hostile_cases_on_every_subject(daemon, nc):
    js = nc.jetstream()
    valid: set[str] = set()
    inbound = Inbound()
    seen: list[str] = []
    spy = await spy_orders(nc, seen)
    cases = hostile(SVC)
    for name, data in cases:
        for kind in ("propose", "triage", "refine", "spec"):
            await request(nc, kind, SVC, data, valid)
        for kind in INBOUND:
            if kind == "triage" and "deep" in name:
                continue  # poison for the session daemon if it regresses: tested on a private one
            await inbound.publish(js, kind, SVC, data)
    assert not valid and not inbound.valid, "a hostile case was taken as a valid proposal"

    # Targets escaping their root, by request and through the stream: rejected, never applied.
    client = MeshClient(nc, SVC)
    escapes = escaping(SVC)
    for name, data in escapes:
        reply = await client.propose_raw(data)
        assert reply.get("status") == "rejected", (name, reply)
        decision = await client.triage(reply["proposal_id"])
        assert (decision.verdict, decision.cause) == ("reject", "forbidden_target"), name
        valid.add(reply["proposal_id"])
        await inbound.publish(js, "proposals", SVC, data)  # the same ids again, harmlessly
    sentinel = rank_proposal(SVC, key=f"hsentinel{RUN}")
    pid = await client.publish(sentinel)
    await eventually(lambda: client.state(pid), timeout=15)
    await asyncio.sleep(0.3)
    for rejected in valid:
        state = await client.state(rejected)
        assert state.status == "rejected", state
        assert await client.outcome(rejected) is None
        stages = [b["to_stage"] for _, b in await daemon.store.read_chain(SVC, rejected)]
        assert stages == ["propose", "triage"], stages
    assert not set(seen) & valid, "an escaping target was ordered applied"
    await still_serving(daemon, nc)
    REGISTERED.update(valid | inbound.valid | {pid})
    await assert_nothing_stored_but(daemon, set())
    await spy.unsubscribe()
    CASES["request propose (escaping)"] += len(escapes)  # the request/publish helpers count
    hostile_cases = len(cases) * (4 + len(INBOUND)) - 3 + 2 * len(escapes)  # the rest
    print(f"\nfuzz hostile: {hostile_cases} cases ({len(cases)} hostile inputs x "
          f"{4 + len(INBOUND)} subjects but the 3 deep ones on improve.triage, "
          f"{len(escapes)} escaping targets x 2); fuzz cases in all so far: "
          f"{sum(CASES.values())} ({dict(CASES)})")


# -- poison: a message that kills the consumer -----------------------------------------------------


def deep_envelope() -> bytes:
    """A DSSE envelope of the right shape whose base64 payload is 10,000-deep JSON."""
    payload = base64.b64encode(b"[" * 10_000 + b"]" * 10_000).decode()
    return json.dumps({"payloadType": "application/vnd.improved.review+json",
                       "payload": payload, "signatures": [{"keyid": "k", "sig": "c2ln"}]}
                      ).encode()


@pytest_asyncio.fixture(loop_scope="session")
async def private_daemon(tmp_path):
    """A server and an in-process daemon of its own, for inputs that break the daemon (the
    session daemon must survive for the rest of the suite)."""
    server = bus.EmbeddedServer(tmp_path / "nats", bus.free_port(), sync="2m")
    server.start()
    conn = await connection.connect(server.url, "poison-daemon")
    d = Daemon(conn, daemon_config(data_dir=tmp_path / "data"))
    await d.start()
    client = await connection.connect(server.url, "poison-client")
    try:
        yield d, client
    finally:
        try:  # a daemon whose consumer died cannot drain: cancel what is left
            await asyncio.wait_for(d.stop(), 10)
        except Exception:
            d.halt()
        await client.close()
        await conn.close()
        server.stop()


@pytest.mark.parametrize(("subject", "data"), [
    ("improve.triage.poison", b"[" * 10_000 + b"]" * 10_000),
    ("improve.triage.poison", b'{"a":' * 10_000 + b"1" + b"}" * 10_000),
    ("improve.triage.poison", deep_envelope()),
    ("improve.grants", deep_envelope()),
], ids=["deep-array-review", "deep-object-review", "deep-payload-review", "deep-payload-grant"])
async def test_a_deeply_nested_message_does_not_kill_the_consumer(private_daemon, subject, data):
    daemon, nc = private_daemon
    await nc.jetstream().publish(subject, data, stream=S.STREAM_INBOUND)
    pid = await MeshClient(nc, "poison").publish(rank_proposal("poison"))
    CASES["poison"] += 1
    # The message must be refused (too_deep) and the loop go on: the next proposal registers.
    client = MeshClient(nc, "poison")
    for _ in range(100):
        if not daemon.healthy() or await client.state(pid) is not None:
            break
        await asyncio.sleep(0.05)
    assert daemon.healthy(), "the consumer task is dead"
    assert await client.state(pid) is not None
