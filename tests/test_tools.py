"""Tool-surface authority (SPEC 09 §3.1): the library's rules, then the same rules over a real
nats-server through services.tool_runtime. Every tool counts its calls, so "refused" is checked
as "did not run", not only as the reply's shape."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from improved.core import signing
from improved.core.tools import (
    DEFAULT_CEILINGS,
    Provider,
    Runtime,
    ToolGrant,
    args_digest,
    grant_token,
    sign_grant,
)
from improved.protocol import subjects
from improved.protocol.model import DsseSignature, Envelope, to_json
from improved_reference.tool_runtime import ToolRuntimeService

from .conftest import ALICE, MALLORY

NOW = 1768471200000
ARGS = {"path": "/srv/data", "force": True}


def trust() -> signing.TrustStore:
    public = base64.b64encode(signing.raw_public(ALICE[1].public_key())).decode()
    return signing.TrustStore.from_config({ALICE[0]: public})


class Counter:
    """A tool body that records each call's arguments."""

    def __init__(self, result="done"):
        self.calls: list[dict] = []
        self.result = result

    def __call__(self, args):
        self.calls.append(args)
        return self.result


def tool(name: str, authority: str, version: str | None = "1") -> tuple[Provider, Counter]:
    body = Counter(result=f"{name} ran")
    return Provider(name, authority, f"the {name} tool", body, version), body


def runtime(mode: str = "autonomous", name: str = "agent", ceiling: str | None = None,
            ) -> tuple[Runtime, dict[str, tuple[Provider, Counter]]]:
    rt = Runtime(name, ceiling, trust(), mode)
    tools = {n: tool(n, a) for n, a in (("read", "L0"), ("write", "L2"), ("deploy", "L4"))}
    for provider, _ in tools.values():
        rt.register(provider)
    return rt, tools


def grant(provider: Provider, args=ARGS, *, key=ALICE, now: int = NOW, **kw) -> Envelope:
    kw.setdefault("nonce", secrets.token_hex(16))
    return sign_grant(key[1], key[0], provider, provider.name, args, "ticket 42", now, **kw)


def by_name(catalog: list[dict]) -> dict[str, dict]:
    return {entry["name"]: entry for entry in catalog}


# -- providers and grant tokens ------------------------------------------------------------------


@pytest.mark.parametrize("authority", ["L1", "L3"])
def test_lifecycle_classes_are_not_tool_classes(authority):
    rt = Runtime("agent", trust=trust())
    with pytest.raises(ValueError, match="skill-lifecycle"):
        rt.register(Provider("x", authority, "", lambda a: None))
    assert rt.catalog() == []


@pytest.mark.parametrize("kw", [{"name": "Bad Name"}, {"name": ""}, {"authority": "L5"},
                                {"authority": "l0"}, {"run": "not callable"},
                                {"version": 3}, {"description": None}])
def test_provider_validates(kw):
    fields = {"name": "ok", "authority": "L0", "description": "", "run": print} | kw
    with pytest.raises(ValueError):
        Provider(**fields)


def test_a_name_registers_once():
    rt = Runtime("agent", trust=trust())
    rt.register(tool("t", "L0")[0])
    with pytest.raises(ValueError, match="already registered"):
        rt.register(tool("t", "L4")[0])


def reference_token(name: str, authority: str, version: str | None) -> str:
    """The token as the spec words it, with the standard library: sorted-key compact JSON."""
    body = json.dumps({"name": name, "authority": authority, "version": version},
                      sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "gt:" + hashlib.sha256(body.encode()).hexdigest()


names = st.from_regex(r"^[a-z][a-z0-9_.-]{0,127}$", fullmatch=True)
classes = st.sampled_from(["L0", "L2", "L4"])
versions = st.none() | st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20)


@given(names, classes, versions)
def test_grant_token_is_stable_and_canonical(name, authority, version):
    token = grant_token(Provider(name, authority, "a", print, version))
    assert token == grant_token(Provider(name, authority, "other text", len, version))
    assert token == reference_token(name, authority, version)


@given(st.tuples(names, classes, versions), st.tuples(names, classes, versions))
def test_grant_token_tells_tools_apart(a, b):
    ta, tb = (grant_token(Provider(n, c, "", print, v)) for n, c, v in (a, b))
    assert (ta == tb) == (a == b)


def test_grant_token_is_the_same_in_another_process():
    code = ("from improved.core.tools import Provider, grant_token; "
            "print(grant_token(Provider('deploy', 'L4', 'x', print, '1')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "123"},
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == grant_token(tool("deploy", "L4")[0])


def test_args_digest_ignores_key_order():
    assert args_digest({"a": 1, "b": {"y": 2, "x": [1]}}) == args_digest(
        {"b": {"x": [1], "y": 2}, "a": 1})
    assert args_digest({"a": 1}) != args_digest({"a": 1.5})


# -- the runtime's ceiling and its two registers -------------------------------------------------


def test_default_ceilings():
    assert DEFAULT_CEILINGS == {"interactive": "L4", "autonomous": "L2"}
    assert Runtime("a", mode="interactive").ceiling == "L4"
    assert Runtime("a", mode="autonomous").ceiling == "L2"
    assert Runtime("a").mode == "autonomous"  # no operator assumed unless declared


@pytest.mark.parametrize("kw", [{"ceiling": "L4", "mode": "autonomous"}, {"ceiling": "L3"},
                                {"ceiling": "L1"}, {"mode": "batch"}, {"name": "Agent"}])
def test_runtime_validates(kw):
    fields = {"name": "agent", "trust": trust()} | kw
    with pytest.raises(ValueError):
        Runtime(**fields)


def test_autonomous_catalog_gates_without_hiding():
    rt, tools = runtime()
    cat = by_name(rt.catalog())
    assert [e["name"] for e in rt.catalog()] == ["deploy", "read", "write"]
    assert cat["read"] == {"name": "read", "authority": "L0", "description": "the read tool",
                           "mountable": True, "grant_token": grant_token(tools["read"][0])}
    assert cat["write"]["mountable"] is True and cat["write"]["needs_acceptance"] is True
    assert cat["deploy"] == {"name": "deploy", "authority": "L4",
                             "description": "the deploy tool", "mountable": False,
                             "gated_authority": "L4",
                             "grant_token": grant_token(tools["deploy"][0])}


def test_interactive_catalog_mounts_everything():
    rt, _ = runtime("interactive")
    for entry in rt.catalog():
        assert entry["mountable"] is True
        assert "gated_authority" not in entry and "needs_acceptance" not in entry


# -- invoking -----------------------------------------------------------------------------------


async def test_l4_runs_once_per_grant():
    rt, tools = runtime()
    deploy, body = tools["deploy"]
    assert await rt.invoke("deploy", ARGS, None, NOW) == {"refused": {
        "reason": "authority_gated", "required": "L4",
        "detail": f"the tool is above this runtime's ceiling L2; present a grant signed for "
                  f"{grant_token(deploy)}"}}
    env = grant(deploy)
    assert await rt.invoke("deploy", ARGS, env, NOW + 1000) == {
        "ok": True, "result": "deploy ran", "granted_by": ALICE[0]}
    again = await rt.invoke("deploy", ARGS, env, NOW + 2000)
    assert again["refused"]["reason"] == "replayed"
    assert (await rt.invoke("deploy", ARGS, None, NOW + 3000))["refused"]["reason"] == (
        "authority_gated")  # spending a grant mounts nothing for later
    assert body.calls == [ARGS]


def resigned(env: Envelope, change) -> Envelope:
    """The envelope's grant with `change` applied, signed again by alice."""
    payload = msgspec.json.decode(base64.b64decode(env.payload), type=ToolGrant)
    return signing.sign(env.payloadType, to_json(change(payload)), ALICE[1])


def bad_grants(deploy: Provider, read: Provider) -> dict[str, Envelope]:
    env = grant(deploy)
    tampered = Envelope(payloadType=env.payloadType, signatures=env.signatures,
                        payload=base64.b64encode(base64.b64decode(env.payload).replace(
                            b"ticket 42", b"ticket 43")).decode())
    return {
        "unknown_key": grant(deploy, key=MALLORY),
        "principal_mismatch": sign_grant(ALICE[1], "operator:bob", deploy, "deploy", ARGS,
                                         "r", NOW, nonce="n" * 16),
        "bad_signature": tampered,
        "wrong_type": signing.sign(signing.PAYLOAD_TYPES["grant"],
                                   base64.b64decode(env.payload), ALICE[1]),
        "malformed": signing.sign(env.payloadType, b'{"tool": "deploy"}', ALICE[1]),
        "wrong_args": grant(deploy, {**ARGS, "force": False}),
        "wrong_tool": grant(read),
        "wrong_token": sign_grant(ALICE[1], ALICE[0], read, "deploy", ARGS, "r", NOW,
                                  nonce=secrets.token_hex(16)),
        "wrong_runtime": grant(deploy, runtime="other-agent"),
        "expired": grant(deploy, now=NOW - 400_000),
        "expired ": grant(deploy, now=NOW - 10_000, ttl_ms=5_000),
        "expired  ": grant(deploy, now=NOW + 400_000),
        "expired   ": resigned(env, lambda g: msgspec.structs.replace(g, expires_at=None,
                                                                       at=NOW - 300_001)),
    }


async def test_bad_grants_are_refused_with_their_reason_and_spend_nothing():
    rt, tools = runtime()
    (deploy, body), (read, _) = tools["deploy"], tools["read"]
    for reason, env in bad_grants(deploy, read).items():
        reply = await rt.invoke("deploy", ARGS, env, NOW)
        assert reply["refused"]["reason"] == reason.strip(), (reason, reply)
        assert reply["refused"]["required"] == "L4" and reply["refused"]["detail"]
    assert body.calls == []
    # a refused grant is not spent: refused for another tool or other arguments, it still runs
    env = grant(deploy)
    assert (await rt.invoke("write", ARGS, env, NOW))["refused"]["reason"] == "wrong_tool"
    assert (await rt.invoke("deploy", {}, env, NOW))["refused"]["reason"] == "wrong_args"
    assert (await rt.invoke("deploy", ARGS, env, NOW))["ok"] is True
    assert body.calls == [ARGS]


async def test_a_grant_without_expiry_lives_five_minutes():
    rt, tools = runtime()
    deploy, body = tools["deploy"]
    env = resigned(grant(deploy), lambda g: msgspec.structs.replace(g, expires_at=None))
    assert (await rt.invoke("deploy", ARGS, env, NOW + 299_999))["ok"] is True
    assert body.calls == [ARGS]


async def test_a_redressed_grant_is_still_a_replay():
    """Adding a signature changes the envelope digest, not the act."""
    rt, tools = runtime()
    deploy, body = tools["deploy"]
    env = grant(deploy)
    assert (await rt.invoke("deploy", ARGS, env, NOW))["ok"] is True
    extra = Envelope(payloadType=env.payloadType, payload=env.payload, signatures=[
        *env.signatures, DsseSignature(keyid="ed25519:" + "0" * 64, sig="AAAA")])
    assert signing.envelope_digest(extra) != signing.envelope_digest(env)
    assert (await rt.invoke("deploy", ARGS, extra, NOW))["refused"]["reason"] == "replayed"
    assert body.calls == [ARGS]


async def test_a_grant_for_a_reclassified_tool_does_not_carry_over():
    old, _ = tool("deploy", "L4", version="1")
    env = grant(old)
    rt = Runtime("agent", trust=trust())
    new, body = tool("deploy", "L4", version="2")
    rt.register(new)
    assert (await rt.invoke("deploy", ARGS, env, NOW))["refused"]["reason"] == "wrong_token"
    assert body.calls == []


async def test_l2_needs_acceptance_once():
    rt, tools = runtime()
    write, body = tools["write"]
    assert await rt.invoke("write", ARGS, None, NOW) == {"refused": {
        "reason": "acceptance_required", "required": "L2",
        "detail": "the first call of this tool needs an operator's signed grant"}}
    refusal = await rt.invoke("write", ARGS, grant(write, key=MALLORY), NOW)
    assert refusal["refused"]["reason"] == "unknown_key"
    assert by_name(rt.catalog())["write"]["needs_acceptance"] is True
    assert body.calls == []
    assert (await rt.invoke("write", ARGS, grant(write), NOW))["granted_by"] == ALICE[0]
    assert "needs_acceptance" not in by_name(rt.catalog())["write"]
    assert await rt.invoke("write", {"other": 1}, None, NOW) == {"ok": True,
                                                                "result": "write ran"}
    assert body.calls == [ARGS, {"other": 1}]


async def test_l2_over_a_lower_ceiling_is_gated_per_call():
    rt, tools = runtime(ceiling="L0")
    write, body = tools["write"]
    assert by_name(rt.catalog())["write"]["gated_authority"] == "L2"
    assert (await rt.invoke("write", ARGS, None, NOW))["refused"] == {
        "reason": "authority_gated", "required": "L2", "detail": (
            f"the tool is above this runtime's ceiling L0; present a grant signed for "
            f"{grant_token(write)}")}
    assert (await rt.invoke("write", ARGS, grant(write), NOW))["ok"] is True
    assert (await rt.invoke("write", ARGS, None, NOW))["refused"]["reason"] == "authority_gated"
    assert len(body.calls) == 1


async def test_interactive_runs_everything_and_ignores_grants():
    rt, tools = runtime("interactive")
    for name, (_, body) in tools.items():
        assert await rt.invoke(name, ARGS, None, NOW) == {"ok": True, "result": f"{name} ran"}
        assert body.calls == [ARGS]
    env = grant(tools["deploy"][0])
    assert "granted_by" not in await rt.invoke("deploy", ARGS, env, NOW)  # not needed: unspent
    auto, _ = runtime()
    assert (await auto.invoke("deploy", ARGS, env, NOW))["ok"] is True


async def test_unknown_is_not_gated():
    rt, _ = runtime()
    assert await rt.invoke("nope", {}, None, NOW) == {"error": {
        "code": "not_found", "message": "no tool named 'nope'", "field": "tool"}}


async def test_async_tools_and_failing_tools():
    async def fetch(args):
        return {"got": args["x"]}

    def broken(args):
        raise RuntimeError("disk full")

    rt = Runtime("agent", trust=trust(), mode="interactive")
    rt.register(Provider("fetch", "L0", "", fetch))
    rt.register(Provider("broken", "L0", "", broken))
    assert await rt.invoke("fetch", {"x": 1}, None, NOW) == {"ok": True, "result": {"got": 1}}
    assert await rt.invoke("broken", {}, None, NOW) == {"ok": False, "error": "RuntimeError: disk full"}
    with pytest.raises(TypeError):
        await rt.invoke("fetch", [1], None, NOW)


# -- over NATS ----------------------------------------------------------------------------------


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
