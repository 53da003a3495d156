"""Tool-surface authority (SPEC 09 §3.1): the library's rules; the same rules over a real
nats-server are in tests/integration/test_tool_runtime.py. Every tool counts its calls, so
"refused" is checked as "did not run", not only as the reply's shape."""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import subprocess
import sys
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
from improved.protocol.model import DsseSignature, Envelope, to_json
from tests.keys import ALICE, MALLORY
from tests.tool_surfaces import ARGS, NOW, by_name, grant, runtime, tool, trust

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
                         cwd=Path(__file__).resolve().parents[2])
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
