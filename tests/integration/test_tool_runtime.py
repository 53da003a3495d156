"""Tool-surface authority (SPEC 09 §3.1) over a real nats-server, through the reference
tool runtime service: listing, gating, acceptance, grants, scopes, session upgrades and bad
input on the bus; spent grants and acceptances shared by replicas and kept across a restart in
the `improved_tools` bucket, whatever a bus participant writes there; every call on the
runtime's `_tools` audit chain, on the tool runtimes' own stream (IMPROVE_TOOLS_AUDIT), which
no daemon checkpoints: a runtime nobody trusts cannot stop the loop. Every tool counts its
calls, so "refused" is checked as "did not run", not only as the reply's shape. The session
daemon (`daemon`) provides the streams; the runtime signs its trailers with the test daemons'
key, so the session's whole-log check at the end verifies them too."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
import time

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.js import api as jsapi
from nats.js.errors import APIError, NotFoundError

from improved.client import connection
from improved.client.chains import read_sequenced
from improved.client.streams import tools_audit_config, tools_ledger_configs
from improved.core import audit, evidence, signing
from improved.core.tools import (
    Provider,
    Runtime,
    args_digest,
    grant_token,
    proof_digest,
    proof_message,
    sign_grant,
    sign_revocation,
    upgrade_id,
)
from improved.core.tools import chain_id as tools_chain_id
from improved.protocol import subjects
from improved.protocol.model import to_json
from improved.runtime import bus
from improved.runtime.store import Store
from improved_reference.tool_gate import ToolGate
from improved_reference.tool_runtime import JetStreamLedger, ToolRuntimeService
from tests.bus import daemon_key, eventually, own_daemon
from tests.cli import improved
from tests.keys import ALICE, MALLORY
from tests.tool_surfaces import (
    ARGS,
    SCOPED_ARGS,
    SESSION,
    by_name,
    grant,
    proof,
    runtime,
    scoped,
    trust,
    upgrade,
)

pytestmark = pytest.mark.usefixtures("daemon")


@contextlib.asynccontextmanager
async def serving(nc, rt: Runtime, key=None):
    service = ToolRuntimeService(nc, rt, key or daemon_key())
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


async def ask(nc, subject: str, body) -> dict:
    msg = await nc.request(subject, body if isinstance(body, bytes) else to_json(body),
                           timeout=5)
    return msgspec.json.decode(msg.data)


async def call(nc, rt: Runtime, tool_name: str, args=None, grant_env=None) -> dict:
    body: dict = {"tool": tool_name}
    if args is not None:
        body["args"] = args
    if grant_env is not None:
        body["grant"] = grant_env
    return await ask(nc, subjects.tools_call(rt.name), body)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def upgraded(svc: str, env, tool_name: str, args: dict, session: str, key=SESSION) -> dict:
    """A call under the upgrade `env`, with a fresh proof by `key` (the session's, SESSION)."""
    return {"tool": tool_name, "args": args, "session": session, "upgrade": env,
            "proof": proof(env, tool_name, args, runtime_name=svc, key=key, now=now_ms())}


async def test_e2e_autonomous_gates_l4(nc, svc):
    rt, tools = runtime(name=svc)
    deploy, body = tools["deploy"]
    async with serving(nc, rt):
        listing = await ask(nc, subjects.tools_list(svc), b"")
        assert (listing["runtime"], listing["ceiling"], listing["mode"]) == (
            svc, "L2", "autonomous")
        entry = by_name(listing["tools"])["deploy"]
        assert entry["gated_authority"] == "L4" and entry["mountable"] is False
        token = entry["grant_token"]
        assert token == grant_token(deploy)

        reply = await call(nc, rt, "deploy", ARGS)
        assert reply["refused"]["reason"] == "authority_gated"
        assert reply["refused"]["required"] == "L4"
        assert body.calls == []

        env = sign_grant(ALICE[1], ALICE[0], token, "deploy", ARGS, "ticket 42", now_ms(),
                         nonce=secrets.token_hex(16))
        assert await call(nc, rt, "deploy", ARGS, env) == {
            "ok": True, "result": "deploy ran", "granted_by": ALICE[0]}
        assert body.calls == [ARGS]
        assert (await call(nc, rt, "deploy", ARGS, env))["refused"]["reason"] == "replayed"

        evil = sign_grant(MALLORY[1], MALLORY[0], token, "deploy", ARGS, "r", now_ms(),
                         nonce=secrets.token_hex(16))
        assert (await call(nc, rt, "deploy", ARGS, evil))["refused"]["reason"] == "unknown_key"
        other = sign_grant(ALICE[1], ALICE[0], token, "deploy", {"path": "/"}, "r", now_ms(),
                         nonce=secrets.token_hex(16))
        assert (await call(nc, rt, "deploy", ARGS, other))["refused"]["reason"] == "wrong_args"
        assert body.calls == [ARGS]

    # the same tool in a re-created runtime has the same token, so the agent's request stands
    rt2, _ = runtime(name=svc)
    async with serving(nc, rt2):
        listing = await ask(nc, subjects.tools_list(svc), b"")
        assert by_name(listing["tools"])["deploy"]["grant_token"] == token


async def test_e2e_l2_acceptance(nc, svc):
    rt, tools = runtime(name=svc)
    write, body = tools["write"]
    async with serving(nc, rt):
        entry = by_name((await ask(nc, subjects.tools_list(svc), b""))["tools"])["write"]
        assert entry["needs_acceptance"] is True and entry["mountable"] is True
        reply = await call(nc, rt, "write", ARGS)
        assert reply["refused"]["reason"] == "acceptance_required"
        assert reply["refused"]["required"] == "L2"
        assert body.calls == []
        env = grant(write, now=now_ms(), runtime=svc)
        assert (await call(nc, rt, "write", ARGS, env))["ok"] is True
        assert await call(nc, rt, "write", {"n": 2}) == {"ok": True, "result": "write ran"}
        assert body.calls == [ARGS, {"n": 2}]
        entry = by_name((await ask(nc, subjects.tools_list(svc), b""))["tools"])["write"]
        assert "needs_acceptance" not in entry


async def test_e2e_interactive_mounts_everything(nc, svc):
    rt, tools = runtime("interactive", name=svc)
    async with serving(nc, rt):
        listing = await ask(nc, subjects.tools_list(svc), b"")
        assert listing["ceiling"] == "L4" and listing["mode"] == "interactive"
        assert all(e["mountable"] and "gated_authority" not in e for e in listing["tools"])
        for name, (_, body) in tools.items():
            assert await call(nc, rt, name) == {"ok": True, "result": f"{name} ran"}
            assert body.calls == [{}]


async def test_e2e_unknown_bad_input_and_spec(nc, svc):
    rt, _ = runtime(name=svc)

    def broken(args):
        raise ValueError("no such branch")

    rt.register(Provider("broken", "L0", "", broken))
    rt.register(Provider("opaque", "L0", "", lambda args: object()))
    async with serving(nc, rt):
        assert (await call(nc, rt, "nope"))["error"]["code"] == "not_found"
        assert (await call(nc, rt, "deploy"))["refused"]["reason"] == "authority_gated"
        tools_call = subjects.tools_call(svc)
        assert (await ask(nc, tools_call, b"{not json"))["error"]["code"] == "invalid_json"
        bad = await ask(nc, tools_call, {"tool": "read", "args": [1]})
        assert bad["error"]["code"] == "invalid_type" and bad["error"]["field"] == "args"
        bad = await ask(nc, tools_call, {"tool": "Read!"})
        assert bad["error"]["code"] == "invalid_value" and bad["error"]["field"] == "tool"
        bad = await ask(nc, tools_call, {"tool": "read", "sudo": True})
        assert bad["error"]["code"] == "unknown_field"
        bad = await ask(nc, tools_call, {"tool": "deploy", "grant": {"payload": "x"}})
        assert bad["error"]["code"] == "missing_field"
        assert await call(nc, rt, "broken") == {"ok": False,
                                                "error": "ValueError: no such branch"}
        opaque = await call(nc, rt, "opaque")
        assert opaque["ok"] is False and "not JSON" in opaque["error"]
        assert await call(nc, rt, "read") == {"ok": True, "result": "read ran"}  # still serving
        assert await ask(nc, subjects.service_spec(svc), b"") == {
            "service": svc, "improve": False, "tools": True, "ceiling": "L2",
            "mode": "autonomous"}


# -- scopes and session upgrades on the bus -----------------------------------------------------


async def test_e2e_scopes_and_a_session_upgrade(nc, svc):
    rt, tools = runtime(name=svc)
    push, body = scoped("push", "L4")
    rt.register(push)
    async with serving(nc, rt):
        entry = by_name((await ask(nc, subjects.tools_list(svc), b""))["tools"])["push"]
        assert entry["scoped_args"] == SCOPED_ARGS and entry["gated_authority"] == "L4"
        env = upgrade(svc, "sess-9", now=now_ms(), tools=["push"])

        def push_call(args: dict, session: str = "sess-9") -> dict:
            return upgraded(svc, env, "push", args, session)

        ok = await ask(nc, subjects.tools_call(svc), push_call({"path": "/srv/data/a"}))
        assert ok == {"ok": True, "result": "push ran", "granted_by": ALICE[0],
                      "upgrade": upgrade_id(env)}
        for args, reason in (({"path": "/srv/data/../../etc/passwd"}, "path_traversal"),
                             ({"url": "https://evil.example.com/"}, "out_of_scope"),
                             ({"set": "red"}, "out_of_scope")):
            reply = await ask(nc, subjects.tools_call(svc), push_call(args))
            assert reply["refused"]["reason"] == reason
        other = await ask(nc, subjects.tools_call(svc), push_call({}, "sess-10"))
        assert other["refused"]["reason"] == "wrong_session"
        bad = await ask(nc, subjects.tools_call(svc), push_call({}, "no spaces"))
        assert bad["error"]["field"] == "session"
        bad = await ask(nc, subjects.tools_call(svc), {**push_call({}), "proof": {"at": 1}})
        assert bad["error"]["code"] == "missing_field" and "proof" in bad["error"]["field"]
        assert body.calls == [{"path": "/srv/data/a"}]

        revocation = sign_revocation(ALICE[1], ALICE[0], svc, upgrade_id(env), "done", now_ms())
        forged = sign_revocation(MALLORY[1], MALLORY[0], svc, upgrade_id(env), "x", now_ms())
        refused_rev = await ask(nc, subjects.tools_revoke(svc), {"revocation": forged})
        assert refused_rev["refused"]["reason"] == "unknown_key"
        assert (await ask(nc, subjects.tools_revoke(svc), b"[]"))["error"]["code"]
        assert (await ask(nc, subjects.tools_call(svc), push_call({})))["ok"] is True
        assert await ask(nc, subjects.tools_revoke(svc), {"revocation": revocation}) == {
            "ok": True, "revoked": upgrade_id(env), "revoked_by": ALICE[0]}
        reply = await ask(nc, subjects.tools_call(svc), push_call({}))
        assert reply["refused"]["reason"] == "revoked"
        assert len(body.calls) == 2


async def test_e2e_an_upgrade_copied_off_the_chain_runs_nothing_for_another_party(nc, svc):
    """The attack: a session makes one upgraded L4 call, so the upgrade envelope and the
    session id are on the runtime's public `_tools` chain. A second party reads them off the
    stream, as anyone allowed to read it can, and calls an upgraded tool with them: with no
    proof, with a proof by a key of its own, and with the legitimate call's proof (seen on the
    bus) replayed or moved to other arguments. Each is refused with one line saying why;
    nothing runs and nothing is spent: the session's next proof still works."""
    rt, tools = runtime(name=svc)
    deploy, body = tools["deploy"]
    async with serving(nc, rt):
        env = upgrade(svc, "sess-legit", now=now_ms())
        legit = upgraded(svc, env, "deploy", ARGS, "sess-legit")
        assert (await ask(nc, subjects.tools_call(svc), legit))["ok"] is True
        assert body.calls == [ARGS]

        # the attacker: read the chain from the stream, take the upgrade and the session
        cid = tools_chain_id(svc)
        chain = await read_sequenced(nc.jetstream(), subjects.tools_audit(cid),
                                     stream=subjects.STREAM_TOOLS_AUDIT)
        used = [b for _, b in chain if "via:upgrade" in b["refs"]]
        assert used, chain
        stolen = used[-1]["envelope"]
        session = next(r.removeprefix("session:") for r in used[-1]["refs"]
                       if r.startswith("session:"))
        assert (stolen, session) == (msgspec.to_builtins(env), "sess-legit")
        target = {"path": "/srv/data/x"}
        attack = {"tool": "deploy", "args": target, "session": session, "upgrade": stolen}
        mallory_session = Ed25519PrivateKey.generate()
        own_key = upgraded(svc, env, "deploy", target, session, key=mallory_session)
        attempts = {
            "session_proof_missing": attack,
            "session_proof_invalid": {**attack, "proof": own_key["proof"]},
            "session_proof_replayed": {**attack, "args": ARGS, "proof": legit["proof"]},
            "session_proof_invalid ": {**attack, "proof": legit["proof"]},
        }
        js = nc.jetstream()
        for reason, request in attempts.items():
            reply = await ask(nc, subjects.tools_call(svc), request)
            assert reply["refused"]["reason"] == reason.strip(), (reason, reply)
            assert reply["refused"]["detail"] and "\n" not in reply["refused"]["detail"]
        assert body.calls == [ARGS]  # nothing ran
        # nothing spent: the attacker's proof left no spent mark
        attacker_proof = own_key["proof"]
        digest = proof_digest(proof_message(svc, "deploy", args_digest(target),
                                            upgrade_id(env), attacker_proof.at,
                                            attacker_proof.nonce))
        assert await spent_key(js, digest) is None
        # the refusals are on the chain, each naming its reason
        chain = await read_sequenced(js, subjects.tools_audit(cid),
                                     stream=subjects.STREAM_TOOLS_AUDIT)
        assert [r for _, b in chain[-4:] for r in b["refs"] if r.startswith("refused:")] == [
            f"refused:{reason.strip()}" for reason in attempts]
        # the session itself goes on: a fresh proof of its own key
        again = await ask(nc, subjects.tools_call(svc),
                          upgraded(svc, env, "deploy", target, "sess-legit"))
        assert again["ok"] is True and body.calls == [ARGS, target]
        refs = dict(r.split(":", 1) for r in (await read_sequenced(
            js, subjects.tools_audit(cid), stream=subjects.STREAM_TOOLS_AUDIT))[-1][1]["refs"])
        assert refs["session_key"] == signing.keyid_of(signing.raw_public(SESSION.public_key()))
        assert len(refs["proof"]) == 64


# -- replicas, restarts and a hostile bus participant -------------------------------------------


@contextlib.asynccontextmanager
async def replicas(nats_url, name: str, n: int = 2):
    """`n` instances of one runtime, each on a connection of its own, in one queue group."""
    conns, services, made = [], [], []
    try:
        for i in range(n):
            conn = await connection.connect(nats_url, f"tool-replica-{i}")
            conns.append(conn)
            rt, tools = runtime(name=name)
            service = ToolRuntimeService(conn, rt, daemon_key())
            await service.start()
            services.append(service)
            made.append((service, tools))
        yield made
    finally:
        for service in services:
            await service.stop()
        for conn in conns:
            await connection.close(conn)


def calls_of(made, tool_name: str) -> list:
    return [c for _, tools in made for c in tools[tool_name][1].calls]


async def test_e2e_replicas_spend_a_grant_once_and_a_restart_keeps_it_spent(nc, nats_url, svc):
    async with replicas(nats_url, svc) as made:
        (a, tools_a), (b, _) = made
        env = grant(tools_a["deploy"][0], now=now_ms(), runtime=svc)
        request = to_json({"tool": "deploy", "args": ARGS, "grant": env})
        answers = await asyncio.gather(a.answer(request), b.answer(request),
                                       *(ask(nc, subjects.tools_call(svc), request)
                                         for _ in range(4)))
        replies = [a if isinstance(a, dict) else msgspec.json.decode(a) for a in answers]
        assert sum(r.get("ok") is True for r in replies) == 1, replies
        assert {r["refused"]["reason"] for r in replies if "refused" in r} == {"replayed"}
        assert calls_of(made, "deploy") == [ARGS]
    async with replicas(nats_url, svc, 1) as made:  # every instance gone: a restart
        (c, _), = made
        reply = msgspec.json.decode(await c.answer(request))
        assert reply["refused"]["reason"] == "replayed"
        assert calls_of(made, "deploy") == []


async def test_e2e_an_acceptance_on_one_replica_holds_on_the_other(nc, nats_url, svc):
    async with replicas(nats_url, svc) as made:
        (a, tools_a), (b, _) = made
        write = tools_a["write"][0]
        first = msgspec.json.decode(await b.answer(to_json({"tool": "write", "args": ARGS})))
        assert first["refused"]["reason"] == "acceptance_required"
        env = grant(write, now=now_ms(), runtime=svc)
        accepted = await a.answer(to_json({"tool": "write", "args": ARGS, "grant": env}))
        assert msgspec.json.decode(accepted)["granted_by"] == ALICE[0]
        later = msgspec.json.decode(await b.answer(to_json({"tool": "write", "args": {"n": 2}})))
        assert later == {"ok": True, "result": "write ran"}
        assert "needs_acceptance" not in by_name((await b.listing())["tools"])["write"]
    async with replicas(nats_url, svc, 1) as made:
        (c, _), = made
        assert "needs_acceptance" not in by_name((await c.listing())["tools"])["write"]
        again = msgspec.json.decode(await c.answer(to_json({"tool": "write", "args": {}})))
        assert again["ok"] is True


async def test_e2e_what_a_bus_participant_writes_in_the_bucket_allows_nothing(nc, svc):
    """Anyone may publish on the bucket's subjects: delete or purge a `spent.` key an earlier
    version kept there, plant an acceptance. None of it lets a call run that the signed acts
    do not allow (the spent mark is on its own stream; a `spent.` key in the bucket still
    refuses)."""
    rt, tools = runtime(name=svc)
    (deploy, deploy_body), (write, write_body) = tools["deploy"], tools["write"]
    async with serving(nc, rt):
        js = nc.jetstream()
        kv = await js.key_value(subjects.BUCKET_TOOLS)
        env = grant(deploy, now=now_ms(), runtime=svc)
        assert (await call(nc, rt, "deploy", ARGS, env))["ok"] is True
        spent = f"spent.{upgrade_id(env)}"  # a grant's act id is its payload's digest too
        await kv.delete(spent)
        assert (await call(nc, rt, "deploy", ARGS, env))["refused"]["reason"] == "replayed"
        await kv.purge(spent)
        assert (await call(nc, rt, "deploy", ARGS, env))["refused"]["reason"] == "replayed"
        await nc.publish(f"$KV.{subjects.BUCKET_TOOLS}.{spent}", b"")
        assert (await call(nc, rt, "deploy", ARGS, env))["refused"]["reason"] == "replayed"
        assert deploy_body.calls == [ARGS]

        key = f"accepted.{svc}.{grant_token(write).removeprefix('gt:')}"
        for planted in (b"accepted", to_json(grant(write, key=MALLORY, runtime=svc)),
                        to_json(grant(write, runtime="someone-else")),
                        to_json(grant(write))):
            await kv.put(key, planted)
            reply = await call(nc, rt, "write", ARGS)
            assert reply["refused"]["reason"] == "acceptance_required", planted
            listed = by_name((await ask(nc, subjects.tools_list(svc), b""))["tools"])
            assert listed["write"]["needs_acceptance"] is True
        assert write_body.calls == []

        # a key written before the grant is presented refuses it: failing closed, never open
        early = grant(deploy, now=now_ms(), runtime=svc)
        await kv.put(f"spent.{upgrade_id(early)}", b"{}")
        assert (await call(nc, rt, "deploy", ARGS, early))["refused"]["reason"] == "replayed"


# -- how long a spent key stays ------------------------------------------------------------------

TOOLS_STREAM = f"KV_{subjects.BUCKET_TOOLS}"


async def spent_key(js, act: str):
    """The spent mark of `act` (its headers say its TTL), or None when it is gone."""
    try:
        return await js.get_last_msg(subjects.STREAM_TOOLS_SPENT, subjects.tools_spent(act))
    except NotFoundError:
        return None


async def test_e2e_a_spent_key_carries_its_ttl_and_leaves_and_the_replay_is_refused_by_time(
        nc, svc):
    """A grant's spent key lives its window plus the margin (one second here), then the server
    removes it; presented again, inside its window, the grant is refused as replayed, and
    after the key left, as lapsed: nothing runs either time. A session proof's key carries
    its TTL too (its minute either way, plus the margin)."""
    margin_ms, window_ms = 1000, 2000
    rt, tools = runtime(name=svc, spent_margin_ms=margin_ms)
    deploy, body = tools["deploy"]
    js = nc.jetstream()
    async with serving(nc, rt):
        start = now_ms()
        env = grant(deploy, now=start, ttl_ms=window_ms, runtime=svc)
        assert (await call(nc, rt, "deploy", ARGS, env))["ok"] is True
        held = await spent_key(js, upgrade_id(env))
        assert held is not None
        ttl = int(held.headers["Nats-TTL"])
        assert 1 <= ttl <= (window_ms + margin_ms) // 1000 + 1, held.headers
        assert (await call(nc, rt, "deploy", ARGS, env))["refused"]["reason"] == "replayed"
        assert body.calls == [ARGS]

        async def gone():
            return await spent_key(js, upgrade_id(env)) is None

        await eventually(gone, timeout=ttl + 5)
        assert now_ms() >= start + window_ms  # it left only after the grant's window
        reply = await call(nc, rt, "deploy", ARGS, env)
        assert reply["refused"]["reason"] == "expired", reply
        assert "lapsed" in reply["refused"]["detail"]
        assert body.calls == [ARGS]  # nothing ran

        up = upgrade(svc, "s-ttl", now=now_ms())
        request = upgraded(svc, up, "deploy", {"n": 1}, "s-ttl")
        assert (await ask(nc, subjects.tools_call(svc), request))["ok"] is True
        digest = proof_digest(proof_message(svc, "deploy", args_digest({"n": 1}),
                                            upgrade_id(up), request["proof"].at,
                                            request["proof"].nonce))
        held = await spent_key(js, digest)
        assert held is not None
        assert 1 <= int(held.headers["Nats-TTL"]) <= (60_000 + 1 + margin_ms) // 1000 + 2
        again = await ask(nc, subjects.tools_call(svc), request)
        assert again["refused"]["reason"] == "session_proof_replayed"


async def test_e2e_a_grant_living_longer_than_a_day_is_refused_runs_nothing_spends_nothing(
        nc, svc):
    """A signed grant whose `expires_at` lies a year after its `at` would have its spent mark
    kept a year (its TTL is the lapse plus the margin): refused `window_too_long` in one line,
    the tool does not run, no mark is written, and the same call under a day's grant runs."""
    rt, tools = runtime(name=svc)
    deploy, body = tools["deploy"]
    js = nc.jetstream()
    async with serving(nc, rt):
        start = now_ms()
        day = grant(deploy, now=start, ttl_ms=24 * 3600 * 1000, runtime=svc)
        payload = msgspec.json.decode(base64.b64decode(day.payload))  # signed by hand: the
        year = signing.sign(day.payloadType, to_json(  # `tools grant` command refuses it
            {**payload, "expires_at": start + 365 * 24 * 3600 * 1000}), ALICE[1])
        reply = await call(nc, rt, "deploy", ARGS, year)
        assert reply["refused"]["reason"] == "window_too_long", reply
        assert "at most 24 h" in reply["refused"]["detail"]
        assert "\n" not in reply["refused"]["detail"]
        assert body.calls == []
        assert await spent_key(js, upgrade_id(year)) is None
        assert (await call(nc, rt, "deploy", ARGS, day))["ok"] is True
        held = await spent_key(js, upgrade_id(day))
        assert int(held.headers["Nats-TTL"]) <= 24 * 3600 + 5 * 60 + 1
        assert body.calls == [ARGS]


ERASERS = (  # what a bus participant publishes to erase a mark: a roll-up purge expiring at once
    {"headers": {"KV-Operation": "PURGE", "Nats-Rollup": "sub"}, "msg_ttl": 1},
    {"headers": {"Nats-Rollup": "sub"}},
    {"headers": {"Nats-TTL": "1"}},
    {},
)


async def erase(js, subject: str, stream: str) -> list[str]:
    """Every way a publisher has to erase the mark on `subject`: roll-ups, a message that
    would replace it, a delete and a purge of the stream. What the server answered each."""
    answers = []
    for kw in ERASERS:
        try:
            await js.publish(subject, b"", **kw)
            answers.append("accepted")
        except APIError as exc:
            answers.append(exc.description or str(exc.err_code))
    held = (await js.get_last_msg(stream, subject)).seq
    for attempt in (lambda: js.delete_msg(stream, held),
                    lambda: js.purge_stream(stream, subject=subject),
                    lambda: js.purge_stream(stream)):
        try:
            await attempt()
            answers.append("accepted")
        except APIError as exc:
            answers.append(exc.description or str(exc.err_code))
    return answers


async def test_a_roll_up_with_a_short_ttl_erases_no_spent_mark(nc, svc):
    """The attack: a grant runs once; a bus participant then writes a roll-up purge with a
    one-second TTL over its spent mark (where the bucket kept it before, and on the mark
    stream), replaces it, deletes it, purges it. The bucket is no longer where a grant is
    spent, and the mark stream refuses every one of those: the grant, presented again within
    its window, is refused as replayed and does not run."""
    rt, tools = runtime(name=svc)
    deploy, body = tools["deploy"]
    async with serving(nc, rt):
        js = nc.jetstream()
        env = grant(deploy, now=now_ms(), runtime=svc)
        assert (await call(nc, rt, "deploy", ARGS, env))["ok"] is True
        await js.publish(f"$KV.{subjects.BUCKET_TOOLS}.spent.{upgrade_id(env)}", b"", msg_ttl=1,
                         headers={"KV-Operation": "PURGE", "Nats-Rollup": "sub"})
        answers = await erase(js, subjects.tools_spent(upgrade_id(env)),
                              subjects.STREAM_TOOLS_SPENT)
        assert answers == ["rollup not permitted"] * 2 + [
            "maximum messages per subject exceeded"] * 2 + [
            "message delete not permitted"] + ["stream purge not permitted"] * 2, answers
        await asyncio.sleep(2.2)
        assert (await spent_key(js, upgrade_id(env))) is not None
        reply = await call(nc, rt, "deploy", ARGS, env)
        assert reply["refused"]["reason"] == "replayed", reply
        assert body.calls == [ARGS]


async def test_a_roll_up_with_a_short_ttl_erases_no_revocation(nc, svc):
    """The same attack on a revocation: an operator revokes a session upgrade; a bus
    participant writes a roll-up purge with a one-second TTL over it (in the bucket, where it
    was kept before, and on the revocations' stream), replaces, deletes or purges it. Erased, it
    would let the revoked upgrade call again; the stream refuses all of it (a TTL too: a mark
    there is for good), and the upgrade stays revoked."""
    rt, tools = runtime(name=svc)
    deploy, body = tools["deploy"]
    async with serving(nc, rt):
        js = nc.jetstream()
        env = upgrade(svc, "s-revoked", now=now_ms())
        assert (await ask(nc, subjects.tools_call(svc),
                          upgraded(svc, env, "deploy", ARGS, "s-revoked")))["ok"] is True
        revocation = sign_revocation(ALICE[1], ALICE[0], svc, upgrade_id(env), "done", now_ms())
        assert (await ask(nc, subjects.tools_revoke(svc), {"revocation": revocation}))["ok"]
        await js.publish(f"$KV.{subjects.BUCKET_TOOLS}.revoked.{upgrade_id(env)}", b"",
                         msg_ttl=1, headers={"KV-Operation": "PURGE", "Nats-Rollup": "sub"})
        answers = await erase(js, subjects.tools_revoked(svc, upgrade_id(env)),
                              subjects.STREAM_TOOLS_REVOKED)
        assert answers == ["per-message TTL is disabled", "rollup not permitted",
                           "per-message TTL is disabled", "maximum messages per subject exceeded",
                           "message delete not permitted"] + [
            "stream purge not permitted"] * 2, answers
        await asyncio.sleep(2.2)
        reply = await ask(nc, subjects.tools_call(svc),
                          upgraded(svc, env, "deploy", {"n": 2}, "s-revoked"))
        assert reply["refused"]["reason"] == "revoked", reply
        assert body.calls == [ARGS]


async def test_a_forged_mark_refuses_and_never_allows(nc, svc):
    """Whoever may publish a mark can refuse a call: a spent mark written before the grant is
    presented refuses it; a mark with a short TTL refuses it until it expires, and then the
    grant runs once. A revocation cannot be forged to expire: the revocations' stream refuses
    a TTL, so the operator's revocation, or a forged one kept for good, stands."""
    rt, tools = runtime(name=svc)
    deploy, body = tools["deploy"]
    async with serving(nc, rt):
        js = nc.jetstream()
        env = grant(deploy, now=now_ms(), runtime=svc)
        await js.publish(subjects.tools_spent(upgrade_id(env)), b"{}", msg_ttl=1)
        assert (await call(nc, rt, "deploy", ARGS, env))["refused"]["reason"] == "replayed"
        assert body.calls == []

        async def gone():
            return await spent_key(js, upgrade_id(env)) is None

        await eventually(gone, timeout=5)
        assert (await call(nc, rt, "deploy", ARGS, env))["ok"] is True
        assert (await call(nc, rt, "deploy", ARGS, env))["refused"]["reason"] == "replayed"
        assert body.calls == [ARGS]
        up = upgrade(svc, "s-forged", now=now_ms())
        with pytest.raises(APIError):
            await js.publish(subjects.tools_revoked(svc, upgrade_id(up)), b"{}", msg_ttl=1)


async def test_an_earlier_versions_spent_and_revoked_keys_still_refuse(own_server):
    """A bucket an earlier version kept its spent and revoked keys in (made before its stream
    allowed TTLs): opened, it is not changed, and each of its `spent.`/`revoked.` keys still
    counts, so a grant spent or an upgrade revoked before the upgrade stays so; a new spend
    is a mark, with its TTL, on the mark stream, create-only."""
    conn = await connection.connect(own_server.url, "tool-ledger-old-bucket")
    try:
        js = conn.jetstream()
        await js.add_stream(jsapi.StreamConfig(
            name=TOOLS_STREAM, subjects=[f"$KV.{subjects.BUCKET_TOOLS}.>"],
            allow_direct=True, allow_rollup_hdrs=True, deny_delete=True,
            discard=jsapi.DiscardPolicy.NEW, max_msgs_per_subject=1, max_msgs=-1,
            max_consumers=-1, duplicate_window=120.0))
        for cfg in tools_ledger_configs():
            await Store(conn).ensure_stream(cfg)  # made as now, the spent marks' sentinel first
        old, revoked = "b" * 64, "d" * 64
        await js.publish(f"$KV.{subjects.BUCKET_TOOLS}.spent.{old}", b"{}")
        await js.publish(f"$KV.{subjects.BUCKET_TOOLS}.revoked.{revoked}", b"{}")
        ledger = await JetStreamLedger.open(js, "agent")
        assert not (await js.stream_info(TOOLS_STREAM)).config.allow_msg_ttl  # unchanged
        now = now_ms()
        assert await ledger.spend("a" * 64, now + 1500, now) is True
        assert (await spent_key(js, "a" * 64)).headers["Nats-TTL"] == "2"
        assert await ledger.spend("a" * 64, now + 1500, now) is False
        assert await ledger.spend(old, now + 1500, now) is False  # spent before: still spent
        assert await ledger.revoked(revoked) is True
        assert await ledger.revoked("e" * 64) is False
    finally:
        await connection.close(conn)


async def test_a_runtime_that_may_not_create_the_mark_streams_does_not_start(tmp_path, svc):
    """Where the provisioning user has made the tool runtimes' audit stream but not the mark
    streams, a runtime whose user may not create them refuses to start with one line naming
    `improved provision`; nothing is served. Provisioned, it starts."""
    users = ('authorization {\n  users = [\n'
             '    {user: admin, password: a}\n'
             '    {user: rt, password: r, permissions: {publish: {deny: ['
             '"$JS.API.STREAM.CREATE.*", "$JS.API.STREAM.UPDATE.*"]}}}\n  ]\n}\n')
    server = bus.EmbeddedServer(tmp_path / "nats", bus.free_port(), sync="2m", extra=users)
    url = server.start()
    admin = await connection.connect(url.replace("nats://", "nats://admin:a@"), "tool-ledger-admin")
    user = await connection.connect(url.replace("nats://", "nats://rt:r@"), "tool-ledger-rt")
    try:
        await admin.jetstream().add_stream(tools_audit_config())
        rt, _ = runtime(name=svc)
        with pytest.raises(RuntimeError) as refused:
            await ToolRuntimeService(user, rt, daemon_key()).start()
        line = str(refused.value)
        assert line.startswith(f"tool runtime {svc}: stream IMPROVE_TOOLS_SPENT is missing, "
                               "and this user may not change it"), line
        assert "improved provision" in line and "\n" not in line
        for cfg in tools_ledger_configs():
            await Store(admin).ensure_stream(cfg)
        await admin.jetstream().create_key_value(bucket=subjects.BUCKET_TOOLS, history=1)
        async with serving(user, rt):
            assert (await call(user, rt, "read"))["ok"] is True
    finally:
        await connection.close(user)
        await connection.close(admin)
        server.stop()


# -- the audit chain ----------------------------------------------------------------------------


def chain_trust():
    daemon = signing.keyid_of(signing.raw_public(daemon_key().public_key()))
    return evidence.ChainTrust(frozenset({daemon}), evidence.History(
        fallback=evidence.KeySet(trust())))


async def test_e2e_every_call_is_on_the_runtime_audit_chain(nc, svc):
    rt, tools = runtime(name=svc)
    deploy = tools["deploy"][0]
    secret = {"token": "s3cr3t-value", "path": "/srv/data"}
    async with serving(nc, rt):
        await call(nc, rt, "read", secret)
        await call(nc, rt, "deploy", secret)
        await call(nc, rt, "deploy", secret, grant(deploy, secret, now=now_ms(), runtime=svc))
        await ask(nc, subjects.tools_call(svc),
                  upgraded(svc, upgrade(svc, "s", now=now_ms()), "deploy", {}, "s"))
        await call(nc, rt, "nope")  # not a tool: nothing to record
    cid = tools_chain_id(svc)
    chain = await read_sequenced(nc.jetstream(), subjects.tools_audit(cid),
                                 stream=subjects.STREAM_TOOLS_AUDIT)
    bodies = [b for _, b in chain]
    assert audit.verify_chain(cid, bodies, chain_trust(), [s for s, _ in chain]) is None
    # first the mark streams the runtime trusts (seen for the first time), then each call,
    # each naming them too
    assert [(b["verdict"], b["gate_class"]) for b in bodies] == [
        ("ledger", "L0"), ("tool_call", "L0"), ("refused", "L4"), ("tool_call", "L4"),
        ("tool_call", "L4")]
    assert b"s3cr3t" not in msgspec.json.encode(bodies)
    ledger, *refs = [dict(r.split(":", 1) for r in b["refs"]) for b in bodies]
    streams = ("spent_stream", "revoked_stream", "audit_stream")
    assert ledger["spent_stream"].endswith(" sentinel=1")
    assert all({k: r[k] for k in streams} == {k: ledger[k] for k in streams} for r in refs)
    bodies = bodies[1:]
    assert refs[0]["args"] == args_digest(secret) and refs[1]["refused"] == "authority_gated"
    assert [r.get("via") for r in refs] == ["mounted", None, "grant", "upgrade"]
    assert bodies[2]["actor"] == ALICE[0] and bodies[2]["envelope"]["signatures"]


async def test_e2e_a_call_that_cannot_be_recorded_does_not_run(nc, svc):
    rt, tools = runtime(name=svc)
    deploy, body = tools["deploy"]
    async with serving(nc, rt) as service:
        async def broken(*a, **kw):
            raise ConnectionError("audit stream unavailable")

        service.chains.append_sealed = broken
        env = grant(deploy, now=now_ms(), runtime=svc)
        reply = await call(nc, rt, "deploy", ARGS, env)
        assert reply["refused"]["reason"] == "unaudited"
        assert (await call(nc, rt, "read"))["refused"]["reason"] == "unaudited"
        assert body.calls == [] and tools["read"][1].calls == []


async def test_the_runtime_needs_an_audit_stream(own_server, svc):
    conn = await connection.connect(own_server.url, "tool-runtime-no-stream")
    try:
        rt, _ = runtime(name=svc)
        with pytest.raises(RuntimeError,
                           match="audit stream IMPROVE_TOOLS_AUDIT does not exist"):
            await ToolRuntimeService(conn, rt, daemon_key()).start()
    finally:
        await connection.close(conn)


async def test_improved_audit_verify_checks_the_tools_chain(own_server, svc, tmp_path):
    """A runtime with a key of its own, trusted for its chain under `[trust.runtimes]`: the
    command verifies the chain. Without that key the same chain is one UNVERIFIED line and
    exit 3, while the daemon's own log verifies and its checkpoint finds nothing
    wrong; a trailer someone else appends is named BROKEN."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


    key = Ed25519PrivateKey.generate()
    async with own_daemon(own_server, tmp_path, "tool-runtime-verify") as (conn, daemon):
        rt, tools = runtime(name=svc)
        async with serving(conn, rt, key):
            await call(conn, rt, "read", ARGS)
            await call(conn, rt, "deploy", ARGS, grant(tools["deploy"][0], now=now_ms()))
        b64 = base64.b64encode
        alice = b64(signing.raw_public(ALICE[1].public_key())).decode()
        daemon_public = b64(signing.raw_public(daemon_key().public_key())).decode()
        common = (f'data_dir = "{tmp_path / "verifier"}"\n[trust]\n'
                  f'operators = {{ "{ALICE[0]}" = "{alice}" }}\n'
                  f'daemons = {{ "improved:test" = "{daemon_public}" }}\n')
        trusted, untrusted = tmp_path / "trusted.toml", tmp_path / "untrusted.toml"
        trusted.write_text(common + f'[trust.runtimes]\n{svc} = "'
                           f'{b64(signing.raw_public(key.public_key())).decode()}"\n')
        untrusted.write_text(common)

        async def verify(cfg):
            return await asyncio.to_thread(improved, "audit", "verify", "--nats",
                                           own_server.url, "--config", str(cfg))

        cid = tools_chain_id(svc)
        ok = await verify(trusted)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "BROKEN" not in ok.stdout and "UNVERIFIED" not in ok.stdout
        assert "tool runtimes (IMPROVE_TOOLS_AUDIT): 1/1 chains verified, 3 trailers" \
            in ok.stdout  # the mark streams it trusts, then the two calls

        unknown = await verify(untrusted)  # nothing wrong found, its writer not checked
        assert unknown.returncode == 3, unknown.stdout + unknown.stderr
        lines = [line for line in unknown.stdout.splitlines() if cid in line]
        assert lines == [f"UNVERIFIED {cid}: 3 trailers of tool runtime {svc} hash and link, "
                         f"but [trust.runtimes] has no key for {svc}, so who wrote them is not "
                         f'checked (add {svc} = "<base64 public key>" to verify them)'], \
            unknown.stdout
        assert "BROKEN" not in unknown.stdout  # the daemon's log verifies all the same
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None
        assert not (await daemon.engine.autonomy.state(2**62)).crisis

        store = Store(conn, audit_stream=subjects.STREAM_TOOLS_AUDIT)
        seq, last = await store.chain_head(subjects.tools_audit(cid))
        forged = dict(last, seq=last["seq"] + 1, prev=last["hash"], sig="", refs=[])
        forged["hash"] = audit.trailer_hash(forged)
        await conn.jetstream().publish(subjects.tools_audit(cid), to_json(forged))
        broken = await verify(trusted)
        assert broken.returncode == 1
        assert (f"BROKEN {cid} trailer 3: not signed by a runtime: a trailer anyone on the bus "
                f"could have written (tool runtime {svc}, IMPROVE_TOOLS_AUDIT)") in broken.stdout
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None


# -- a runtime nobody trusts cannot stop the loop -----------------------------------------------


async def _applied(client, pid):
    state = await client.state(pid)
    return state if state is not None and state.status == "applied" else None


async def test_an_untrusted_runtime_key_on_a_tools_chain_opens_no_crisis(own_server, tmp_path):
    """The attack: a correctly hashed trailer of a runtime's `_tools` chain, signed by a key
    nobody trusts, published on the chain's subject. The daemon's checkpoint finds nothing it
    answers for (the chain is not in its log): no crisis, and an L0 proposal published after
    it is still applied."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from improved.client.sdk import MeshClient
    from improved.core.record import ChainHead
    from improved.core.tools import call_draft
    from improved.protocol.model import ApplyResult
    from improved.runtime.daemon import Daemon
    from tests.bus import daemon_config, eventually
    from tests.factories import rank_proposal

    config = msgspec.structs.replace(daemon_config(), checkpoint_interval_s=0.0,
                                     data_dir=tmp_path / "data")
    conn = await connection.connect(own_server.url, "untrusted-runtime")
    daemon = Daemon(conn, config)
    await daemon.start()
    client = MeshClient(conn, "rank")
    orders: list[str] = []

    async def applier(order):
        orders.append(order.proposal_id)
        return ApplyResult(ok=True, applied_id="x", rollbackable=False)

    sub = await client.serve_apply(applier)
    try:
        first = (await client.propose(rank_proposal("rank", key="before"))).proposal_id
        await eventually(lambda: _applied(client, first))
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None

        rogue, name = Ed25519PrivateKey.generate(), "rogue"
        rt, _ = runtime(name=name)
        draft = call_draft(name, await ToolGate(rt).decide("read", ARGS, None, now_ms()))
        assert draft is not None
        cid = tools_chain_id(name)
        sealed = audit.seal_next(draft, cid, ChainHead(length=0, last_hash=""), "L0",
                                 "operation", now_ms())
        signed = msgspec.to_builtins(evidence.sign(sealed, rogue))
        assert audit.verify_chain(cid, [signed]) is None  # correctly hashed and linked
        await conn.jetstream().publish(subjects.tools_audit(cid), to_json(signed))

        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None
        assert not (await daemon.engine.autonomy.state(2**62)).crisis
        second = (await client.propose(rank_proposal("rank", key="after"))).proposal_id
        await eventually(lambda: _applied(client, second))
        assert orders == [first, second]
    finally:
        await sub.unsubscribe()
        await daemon.stop()
        await connection.close(conn)


async def test_a_chain_written_into_the_daemons_log_before_the_move_verifies_under_its_runtime(
        own_server, tmp_path):
    """A `_tools` chain a runtime wrote into IMPROVE_AUDIT before the chains moved: a full
    `improved audit verify` accepts it under the runtime's key in `[trust.runtimes]`, so the
    key need not stay among `[trust] daemons`; with neither, it is a break as before."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from improved.core.tools import call_draft

    key, name = Ed25519PrivateKey.generate(), "legacy"
    conn = await connection.connect(own_server.url, "tool-runtime-legacy")
    try:
        store = Store(conn)
        await store.ensure()
        store.signer = key  # as a runtime wrote it then: on the daemon's log, with its own key
        rt, _ = runtime(name=name)
        draft = call_draft(name, await ToolGate(rt).decide("read", ARGS, None, now_ms()))
        cid = tools_chain_id(name)
        await store.append_sealed(subjects.legacy_tools_audit(cid), cid, "L0", "operation",
                                  lambda chain, now: draft, clock=now_ms)
    finally:
        await connection.close(conn)
    b64 = base64.b64encode
    daemon_public = b64(signing.raw_public(daemon_key().public_key())).decode()
    base = (f'data_dir = "{tmp_path / "verifier"}"\n[trust]\n'
            f'daemons = {{ "improved:test" = "{daemon_public}" }}\n')
    with_runtime, without = tmp_path / "with.toml", tmp_path / "without.toml"
    with_runtime.write_text(base + f'[trust.runtimes]\n{name} = "'
                            f'{b64(signing.raw_public(key.public_key())).decode()}"\n')
    without.write_text(base)
    ok = await asyncio.to_thread(improved, "audit", "verify", "--nats", own_server.url,
                                 "--config", str(with_runtime))
    assert ok.returncode == 0 and "BROKEN" not in ok.stdout, ok.stdout + ok.stderr
    broken = await asyncio.to_thread(improved, "audit", "verify", "--nats", own_server.url,
                                     "--config", str(without))
    assert broken.returncode == 1
    assert f"BROKEN {cid} trailer 0: signed by" in broken.stdout
    assert "which is not a trusted daemon key" in broken.stdout


# -- a session proof re-checked from the chain alone ---------------------------------------------


def _resigned(body: dict, key, **changes) -> dict:
    """`body` changed, re-hashed and re-signed by `key`: a trailer its chain's writer made."""
    from improved.protocol.model import Trailer

    changed = {k: v for k, v in dict(body, **changes).items() if k not in ("hash", "sig")}
    changed["hash"] = audit.trailer_hash(changed)
    return msgspec.to_builtins(evidence.sign(msgspec.convert(changed, Trailer), key))


def _verifier_config(tmp_path, runtime_name: str, key) -> str:
    b64 = base64.b64encode
    alice = b64(signing.raw_public(ALICE[1].public_key())).decode()
    daemon_public = b64(signing.raw_public(daemon_key().public_key())).decode()
    path = tmp_path / "verifier.toml"
    path.write_text(f'data_dir = "{tmp_path / "verifier"}"\n[trust]\n'
                    f'operators = {{ "{ALICE[0]}" = "{alice}" }}\n'
                    f'daemons = {{ "improved:test" = "{daemon_public}" }}\n'
                    f'[trust.runtimes]\n{runtime_name} = "'
                    f'{b64(signing.raw_public(key.public_key())).decode()}"\n')
    return str(path)


async def test_audit_verify_rechecks_the_session_proof_a_trailer_records(own_server, svc,
                                                                         tmp_path):
    """The attack: the runtime's key (or whoever holds it) appends an upgraded call the
    session never proved — a copy of a real one whose recorded proof is altered — hashed,
    linked and signed by the runtime's key, so the chain itself verifies. `improved audit
    verify` re-checks the recorded proof against the upgrade's session key and names it."""

    key = Ed25519PrivateKey.generate()
    conn = await connection.connect(own_server.url, "tool-runtime-proof")
    try:
        await Store(conn).ensure()
        rt, _ = runtime(name=svc)
        env = upgrade(svc, "sess-p", now=now_ms())
        async with serving(conn, rt, key):
            reply = await ask(conn, subjects.tools_call(svc),
                              upgraded(svc, env, "deploy", ARGS, "sess-p"))
            assert reply["ok"] is True
        cfg = _verifier_config(tmp_path, svc, key)
        ok = await asyncio.to_thread(improved, "audit", "verify", "--nats", own_server.url,
                                     "--config", cfg)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "tool runtimes (IMPROVE_TOOLS_AUDIT): 1/1 chains verified, 2 trailers" \
            in ok.stdout

        cid = tools_chain_id(svc)
        store = Store(conn, audit_stream=subjects.STREAM_TOOLS_AUDIT)
        _, last = await store.chain_head(subjects.tools_audit(cid))
        refs = [r if not r.startswith("proof_nonce:") else "proof_nonce:" + "f" * 32
                for r in last["refs"]]
        forged = _resigned(last, key, seq=last["seq"] + 1, prev=last["hash"], refs=refs)
        await conn.jetstream().publish(subjects.tools_audit(cid), to_json(forged))
        broken = await asyncio.to_thread(improved, "audit", "verify", "--nats",
                                         own_server.url, "--config", cfg)
        assert broken.returncode == 1, broken.stdout + broken.stderr
        assert (f"BROKEN {cid} trailer 2: the recorded session proof does not verify "
                f"(session_proof_invalid)") in broken.stdout, broken.stdout
        assert "Traceback" not in broken.stdout + broken.stderr
    finally:
        await connection.close(conn)


async def test_audit_verify_since_and_by_chain_check_the_runtime_chains(own_server, svc,
                                                                        tmp_path):
    """`improved audit verify --since` checks the runtime chains' trailers stored since the
    last checkpoint, each chain continued from the trailer before its first one there, by the
    same rules as the whole-log verify; `improved audit verify runtime:NAME` (or the chain's
    id) checks that one chain. A trailer appended unsigned after the checkpoint is named by
    both, exit 1."""

    key = Ed25519PrivateKey.generate()
    async with own_daemon(own_server, tmp_path, "tool-runtime-since") as (conn, daemon):
        rt, tools = runtime(name=svc)
        async with serving(conn, rt, key):
            await call(conn, rt, "read", ARGS)
            await call(conn, rt, "read", {"path": "/srv/data/1"})
            await asyncio.sleep(0.05)
            assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None
            await asyncio.sleep(0.05)
            await call(conn, rt, "deploy", ARGS, grant(tools["deploy"][0], now=now_ms()))
        cfg = _verifier_config(tmp_path, svc, key)
        cid = tools_chain_id(svc)

        async def verify(*args: str):
            return await asyncio.to_thread(improved, "audit", "verify", *args, "--nats",
                                           own_server.url, "--config", cfg)

        since = await verify("--since")
        assert since.returncode == 0, since.stdout + since.stderr
        assert ("tool runtimes (IMPROVE_TOOLS_AUDIT): 1/1 chains verified, 1 trailers since "
                "the checkpoint") in since.stdout
        for target in (f"runtime:{svc}", cid):
            one = await verify(target)
            assert one.returncode == 0, one.stdout + one.stderr
            assert one.stdout.splitlines() == [
                "tool runtimes (IMPROVE_TOOLS_AUDIT): 1/1 chains verified, 4 trailers"]

        store = Store(conn, audit_stream=subjects.STREAM_TOOLS_AUDIT)
        _, last = await store.chain_head(subjects.tools_audit(cid))
        forged = dict(last, seq=last["seq"] + 1, prev=last["hash"], sig="", refs=[])
        forged["hash"] = audit.trailer_hash(forged)
        await conn.jetstream().publish(subjects.tools_audit(cid), to_json(forged))
        line = (f"BROKEN {cid} trailer 4: not signed by a runtime: a trailer anyone on the bus "
                f"could have written (tool runtime {svc}, IMPROVE_TOOLS_AUDIT)")
        for args in (("--since",), (f"runtime:{svc}",), (cid,)):
            broken = await verify(*args)
            assert broken.returncode == 1, (args, broken.stdout + broken.stderr)
            assert line in broken.stdout, (args, broken.stdout)

        bad = await verify("runtime:Not A Name")
        assert bad.returncode == 2 and "is not a runtime name" in bad.stderr
        assert "Traceback" not in bad.stderr
        nothing = await verify(tools_chain_id("nobody"))
        assert nothing.returncode == 1 and "no chain for" in nothing.stderr
        assert "Traceback" not in nothing.stderr


# -- a runtime chain removed is named against the heads the checkpoints witnessed ----------------


async def test_a_removed_or_replaced_runtime_chain_is_named_against_the_checkpoints_witness(
        own_server, svc, tmp_path):
    """The attack: IMPROVE_TOOLS_AUDIT has no checkpoint of its own, so a runtime's whole
    chain purged (or the stream re-created and the chain written anew) left nothing to tell.
    The daemon's checkpoint now witnesses each runtime chain's head; `improved audit verify`
    names a chain missing, shorter than or diverging from it (exit 1). The daemon itself
    never goes into crisis over it: its next checkpoint is signed as before."""

    key = Ed25519PrivateKey.generate()
    cid = tools_chain_id(svc)
    subject = subjects.tools_audit(cid)
    cfg = _verifier_config(tmp_path, svc, key)
    async with own_daemon(own_server, tmp_path, "tool-runtime-witness") as (conn, daemon):
        js = conn.jetstream()

        async def verify():
            return await asyncio.to_thread(improved, "audit", "verify", "--nats", own_server.url,
                                           "--config", cfg)

        async def calls(n: int, tag: str) -> None:
            rt, _ = runtime(name=svc)
            async with serving(conn, rt, key):
                for k in range(n):
                    await call(conn, rt, "read", {"path": f"/srv/data/{tag}{k}"})

        async def checkpoint_witnesses() -> str:
            assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None
            assert not (await daemon.engine.autonomy.state(2**62)).crisis
            _, cp = await daemon.store.chain_head(checkpointing_subject())
            return next((r for r in cp["refs"] if r.startswith("runtime_heads:")), "")

        await calls(2, "a")
        witnessed = await checkpoint_witnesses()
        ok = await verify()
        assert ok.returncode == 0, ok.stdout + ok.stderr
        store = Store(conn, audit_stream=subjects.STREAM_TOOLS_AUDIT)
        head_seq, head = await store.chain_head(subject)

        await js.delete_stream(subjects.STREAM_TOOLS_AUDIT)  # every runtime chain with it
        missing = await verify()
        assert missing.returncode == 1, missing.stdout + missing.stderr
        assert (f"BROKEN {cid}: the chain is missing; the checkpoint at") in missing.stdout
        assert f"witnessed 3 trailers ending in {head['hash'][:16]}…: the whole chain was " \
               "removed (IMPROVE_TOOLS_AUDIT does not exist)" in missing.stdout
        assert witnessed == "runtime_heads:" + json.dumps(
            {cid: [3, head["hash"], head_seq]}, separators=(",", ":"))

        await js.add_stream(tools_audit_config())  # re-created: the chain written anew
        await calls(1, "b")
        short = await verify()
        assert short.returncode == 1
        assert f"BROKEN {cid}: the chain holds 2 trailers; the checkpoint at" in short.stdout
        await calls(2, "c")
        other = await verify()
        assert other.returncode == 1
        assert (f"BROKEN {cid} trailer 2: it is not the trailer the checkpoint at"
                in other.stdout), other.stdout
        assert "the chain was replaced or rewritten" in other.stdout
        # a later checkpoint witnesses the chain written anew, longer: the earlier head is
        # still looked for where it was, and is not there
        assert await checkpoint_witnesses() != ""
        rewitnessed = await verify()
        assert rewitnessed.returncode == 1, rewitnessed.stdout
        assert (f"BROKEN {cid} trailer 2: the checkpoint at" in rewitnessed.stdout
                and f"witnessed trailer 2 ({head['hash'][:16]}…) at stream sequence "
                    f"{head_seq}" in rewitnessed.stdout
                and "the chain was removed or replaced (IMPROVE_TOOLS_AUDIT)"
                    in rewitnessed.stdout), rewitnessed.stdout

        await js.purge_stream(subjects.STREAM_TOOLS_AUDIT, subject=subject)  # the whole chain
        gone = await verify()
        assert gone.returncode == 1
        assert (f"BROKEN {cid} trailer 2: the checkpoint at" in gone.stdout
                and "it is gone: the chain was removed or replaced" in gone.stdout), gone.stdout
        assert "Traceback" not in gone.stdout + gone.stderr
        assert await checkpoint_witnesses() == ""  # nothing left to witness, and no crisis
        # a checkpoint that witnessed nothing (as a daemon that may not read the stream) takes
        # nothing away from the earlier ones
        still = await verify()
        assert still.returncode == 1 and f"BROKEN {cid} trailer" in still.stdout


def checkpointing_subject() -> str:
    from improved.client.checkpointing import CP_SUBJECT

    return CP_SUBJECT
