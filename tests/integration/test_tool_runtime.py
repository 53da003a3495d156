"""Tool-surface authority (SPEC 09 §3.1) over a real nats-server, through the reference
tool runtime service: listing, gating, acceptance, grants and bad input on the bus. Every tool
counts its calls, so "refused" is checked as "did not run", not only as the reply's shape."""

from __future__ import annotations

import contextlib
import secrets
import time

import msgspec

from improved.core.tools import Provider, Runtime, grant_token, sign_grant
from improved.protocol import subjects
from improved.protocol.model import to_json
from improved_reference.tool_runtime import ToolRuntimeService
from tests.keys import ALICE, MALLORY
from tests.tool_surfaces import ARGS, by_name, grant, runtime


@contextlib.asynccontextmanager
async def serving(nc, rt: Runtime):
    service = ToolRuntimeService(nc, rt)
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
