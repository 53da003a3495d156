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
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from improved.core import signing
from improved.core.scopes import CapabilityScope
from improved.core.signing import ActRefused
from improved.core.tools import (
    CLOCK_SKEW_MS,
    DEFAULT_CEILINGS,
    MAX_GRANT_MS,
    PROOF_SKEW_MS,
    SPENT_MARGIN_MS,
    Decision,
    LedgerUntrusted,
    Provider,
    ReadAcceptance,
    ReadRevoked,
    RecordAcceptance,
    RecordRevocation,
    Runtime,
    SessionProof,
    SessionUpgrade,
    Spend,
    ToolGrant,
    act_id,
    args_digest,
    call_draft,
    canonical_json,
    check_proof,
    grant_lapse,
    grant_token,
    proof_digest,
    proof_lapse,
    proof_message,
    sign_grant,
    sign_proof,
    sign_revocation,
    sign_upgrade,
    spent_ttl_s,
    spent_until,
    upgrade_id,
)
from improved.core.tools import chain_id as tools_chain_id
from improved.protocol.model import DsseSignature, Envelope, to_json
from improved_reference.tool_gate import ProcessLedger, ToolGate
from tests.keys import ALICE, MALLORY
from tests.tool_surfaces import (
    ARGS,
    NOW,
    SCOPE,
    SCOPED_ARGS,
    SESSION,
    by_name,
    gate,
    grant,
    proof,
    runtime,
    scoped,
    tool,
    trust,
    upgrade,
)

DAEMON = Ed25519PrivateKey.generate()  # the writer of the tools chain in these tests
DAEMON_KEYID = signing.keyid_of(signing.raw_public(DAEMON.public_key()))

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
    rt, tools = gate()
    deploy, body = tools["deploy"]
    assert await rt.invoke("deploy", ARGS, None, NOW) == {"refused": {
        "reason": "authority_gated", "required": "L4",
        "detail": f"the tool is above this runtime's ceiling L2; present a grant signed for "
                  f"{grant_token(deploy)} or a session upgrade"}}
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
        "window_too_long": resigned(env, lambda g: msgspec.structs.replace(
            g, expires_at=g.at + MAX_GRANT_MS + 1)),
    }


async def test_bad_grants_are_refused_with_their_reason_and_spend_nothing():
    rt, tools = gate()
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
    rt, tools = gate()
    deploy, body = tools["deploy"]
    env = resigned(grant(deploy), lambda g: msgspec.structs.replace(g, expires_at=None))
    assert (await rt.invoke("deploy", ARGS, env, NOW + 299_999))["ok"] is True
    assert body.calls == [ARGS]


async def test_a_redressed_grant_is_still_a_replay():
    """Adding a signature changes the envelope digest, not the act."""
    rt, tools = gate()
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
    rt = ToolGate(Runtime("agent", trust=trust()))
    new, body = tool("deploy", "L4", version="2")
    rt.runtime.register(new)
    assert (await rt.invoke("deploy", ARGS, env, NOW))["refused"]["reason"] == "wrong_token"
    assert body.calls == []


async def test_l2_needs_acceptance_once():
    rt, tools = gate()
    write, body = tools["write"]
    assert await rt.invoke("write", ARGS, None, NOW) == {"refused": {
        "reason": "acceptance_required", "required": "L2",
        "detail": "the first call of this tool needs an operator's signed grant naming this "
                  "runtime"}}
    refusal = await rt.invoke("write", ARGS, grant(write, key=MALLORY, runtime="agent"), NOW)
    assert refusal["refused"]["reason"] == "unknown_key"
    # an acceptance is shared by every replica and outlives a restart: it names its runtime
    refusal = await rt.invoke("write", ARGS, grant(write), NOW)
    assert refusal["refused"]["reason"] == "wrong_runtime"
    assert by_name(rt.runtime.catalog())["write"]["needs_acceptance"] is True
    assert body.calls == []
    assert (await rt.invoke("write", ARGS, grant(write, runtime="agent"), NOW))["granted_by"] == (
        ALICE[0])
    assert "needs_acceptance" not in by_name(rt.runtime.catalog())["write"]
    assert await rt.invoke("write", {"other": 1}, None, NOW) == {"ok": True,
                                                                "result": "write ran"}
    assert body.calls == [ARGS, {"other": 1}]


async def test_l2_over_a_lower_ceiling_is_gated_per_call():
    rt, tools = gate(ceiling="L0")
    write, body = tools["write"]
    assert by_name(rt.runtime.catalog())["write"]["gated_authority"] == "L2"
    assert (await rt.invoke("write", ARGS, None, NOW))["refused"] == {
        "reason": "authority_gated", "required": "L2", "detail": (
            f"the tool is above this runtime's ceiling L0; present a grant signed for "
            f"{grant_token(write)} or a session upgrade")}
    assert (await rt.invoke("write", ARGS, grant(write), NOW))["ok"] is True
    assert (await rt.invoke("write", ARGS, None, NOW))["refused"]["reason"] == "authority_gated"
    assert len(body.calls) == 1


async def test_interactive_runs_everything_and_ignores_grants():
    rt, tools = gate("interactive")
    for name, (_, body) in tools.items():
        assert await rt.invoke(name, ARGS, None, NOW) == {"ok": True, "result": f"{name} ran"}
        assert body.calls == [ARGS]
    env = grant(tools["deploy"][0])
    assert "granted_by" not in await rt.invoke("deploy", ARGS, env, NOW)  # not needed: unspent
    auto, _ = gate()
    assert (await auto.invoke("deploy", ARGS, env, NOW))["ok"] is True


async def test_unknown_is_not_gated():
    rt, _ = gate()
    assert await rt.invoke("nope", {}, None, NOW) == {"error": {
        "code": "not_found", "message": "no tool named 'nope'", "field": "tool"}}


async def test_async_tools_and_failing_tools():
    async def fetch(args):
        return {"got": args["x"]}

    def broken(args):
        raise RuntimeError("disk full")

    rt = ToolGate(Runtime("agent", trust=trust(), mode="interactive"))
    rt.runtime.register(Provider("fetch", "L0", "", fetch))
    rt.runtime.register(Provider("broken", "L0", "", broken))
    assert await rt.invoke("fetch", {"x": 1}, None, NOW) == {"ok": True, "result": {"got": 1}}
    assert await rt.invoke("broken", {}, None, NOW) == {"ok": False, "error": "RuntimeError: disk full"}
    with pytest.raises(TypeError):
        await rt.invoke("fetch", [1], None, NOW)


# -- capability scopes (paths, sets, origins), checked at every call ---------------------------


@pytest.mark.parametrize("args", [
    {"path": "/srv/data/a.csv"}, {"path": "/srv/data"}, {"path": "/srv/data/x/y/z"},
    {"path": "/srv//data/./b"}, {"path": "/tmp/run.log"}, {"paths": ["/srv/data/1", "/tmp/a.log"]},
    {"set": "blue"}, {"url": "https://api.example.com/v1/items?q=1"},
    {"url": "HTTPS://API.example.com:443/"}, {"url": "http://localhost:8080/x"},
    {"other": "/etc/passwd"}, {},
])
async def test_a_call_within_scope_runs(args):
    rt, _ = gate()
    files, body = scoped()
    rt.runtime.register(files)
    assert (await rt.invoke("files", args, None, NOW))["ok"] is True
    assert body.calls == [args]


@pytest.mark.parametrize("args, reason, cause", [
    ({"path": "/etc/passwd"}, "out_of_scope", "outside the tool scope"),
    ({"path": "/srv/database"}, "out_of_scope", "outside"),
    ({"path": "/srv/data/../../etc/shadow"}, "path_traversal", ".."),
    ({"path": "/srv/data/..\\..\\etc"}, "path_traversal", ".."),
    ({"path": "../srv/data/x"}, "path_traversal", ".."),
    ({"path": "/srv/data/x\0"}, "out_of_scope", "NUL"),
    ({"path": "/tmp/sub/run.log"}, "out_of_scope", "outside"),
    ({"path": ""}, "out_of_scope", "names no path"),
    ({"paths": ["/srv/data/ok", "/root/x"]}, "out_of_scope", "/root/x"),
    ({"path": 7}, "out_of_scope", "string or a list of strings"),
    ({"paths": ["/srv/data/a", 1]}, "out_of_scope", "string or a list of strings"),
    ({"set": "red"}, "out_of_scope", "outside"),
    ({"set": "Blue"}, "out_of_scope", "outside"),
    ({"url": "https://evil.example.com/"}, "out_of_scope", "outside"),
    ({"url": "https://api.example.com@evil.example.com/"}, "out_of_scope", "user info"),
    ({"url": "http://api.example.com/"}, "out_of_scope", "outside"),
    ({"url": "https://api.example.com:8443/"}, "out_of_scope", "outside"),
    ({"url": "https://api.example.com.evil.net/"}, "out_of_scope", "outside"),
    ({"url": "api.example.com"}, "out_of_scope", "not a URL"),
    ({"url": "http://localhost:99999/"}, "out_of_scope", "valid host"),
])
async def test_a_call_outside_scope_is_refused_and_nothing_runs(args, reason, cause):
    rt, tools = gate()
    files, body = scoped()
    rt.runtime.register(files)
    reply = await rt.invoke("files", args, None, NOW)
    assert reply["refused"]["reason"] == reason, reply
    assert cause in reply["refused"]["detail"]
    assert "\n" not in reply["refused"]["detail"]
    assert body.calls == []


async def test_an_out_of_scope_call_does_not_spend_its_grant():
    rt, _ = gate()
    files, body = scoped("push", "L4")
    rt.runtime.register(files)
    outside = {"path": "/etc/passwd"}
    env = grant(files, outside)
    assert (await rt.invoke("push", outside, env, NOW))["refused"]["reason"] == "out_of_scope"
    inside = {"path": "/srv/data/x"}
    env2 = grant(files, inside)
    assert (await rt.invoke("push", inside, env2, NOW))["ok"] is True
    assert body.calls == [inside]
    # the refused grant was not spent: with the scope widened by a new runtime, it runs
    wide = ToolGate(Runtime("agent", trust=trust()), rt.ledger)
    wider, body2 = scoped("push", "L4", CapabilityScope(paths=["/**"], sets=[], origins=[]))
    wide.runtime.register(wider)
    assert (await wide.invoke("push", outside, env, NOW))["ok"] is True
    assert (await wide.invoke("push", inside, env2, NOW))["refused"]["reason"] == "replayed"
    assert body2.calls == [outside]


async def test_the_runtime_policy_narrows_a_tool_scope():
    rt, _ = gate(scopes={"files": CapabilityScope(paths=["/srv/data/public/**"],
                                                     origins=[])})
    files, body = scoped()
    rt.runtime.register(files)
    assert (await rt.invoke("files", {"path": "/srv/data/public/a"}, None, NOW))["ok"] is True
    reply = await rt.invoke("files", {"path": "/srv/data/private"}, None, NOW)
    assert reply["refused"]["reason"] == "out_of_scope"
    assert "runtime policy scope" in reply["refused"]["detail"]
    reply = await rt.invoke("files", {"url": "https://api.example.com/"}, None, NOW)
    assert "runtime policy scope (no origins)" in reply["refused"]["detail"]
    assert (await rt.invoke("files", {"set": "green"}, None, NOW))["ok"] is True  # sets: tool's
    entry = by_name(rt.runtime.catalog())["files"]
    assert entry["scoped_args"] == SCOPED_ARGS and entry["scope"]["sets"] == ["blue", "green"]
    assert entry["policy_scope"] == {"paths": ["/srv/data/public/**"], "origins": []}
    assert body.calls == [{"path": "/srv/data/public/a"}, {"set": "green"}]


@pytest.mark.parametrize("kw, match", [
    ({"scoped_args": {"path": "path"}}, "declares no paths scope"),
    ({"scoped_args": {"path": "file"}, "scope": SCOPE}, "not one of"),
    ({"scoped_args": {"p": "path"}, "scope": CapabilityScope(paths=["/a/../b"])}, r"'\.\.'"),
    ({"scoped_args": {"u": "origin"}, "scope": CapabilityScope(origins=["https://a.b/x"])},
     "written"),
    ({"scoped_args": {"u": "origin"}, "scope": CapabilityScope(origins=["a.b"])}, "not a URL"),
])
def test_a_scope_that_cannot_be_checked_does_not_register(kw, match):
    with pytest.raises(ValueError, match=match):
        Provider("t", "L0", "", print, **kw)


def test_a_policy_scope_that_cannot_be_checked_is_refused():
    with pytest.raises(ValueError, match="policy scope of files"):
        Runtime("agent", scopes={"files": CapabilityScope(paths=["/../x"])})


# -- session-scoped policy upgrades -------------------------------------------------------------


async def test_an_upgrade_mounts_l4_for_its_session_until_it_lapses():
    rt, tools = gate()
    deploy, body = tools["deploy"]
    env = upgrade()
    for n in range(3):  # no grant per call, any arguments: a proof by the session's key
        reply = await rt.invoke("deploy", {"n": n}, None, NOW + n, session="s-1", upgrade=env,
                                proof=proof(env, "deploy", {"n": n}, now=NOW + n))
        assert reply == {"ok": True, "result": "deploy ran", "granted_by": ALICE[0],
                         "upgrade": upgrade_id(env)}
    lapsed = await rt.invoke("deploy", {}, None, NOW + 600_000, session="s-1", upgrade=env,
                             proof=proof(env, "deploy", now=NOW + 600_000))
    assert lapsed["refused"]["reason"] == "expired"
    assert len(body.calls) == 3


def bad_upgrades() -> dict[str, Envelope]:
    env = upgrade()
    tampered = Envelope(payloadType=env.payloadType, signatures=env.signatures,
                        payload=base64.b64encode(base64.b64decode(env.payload).replace(
                            b'"s-1"', b'"s-2"')).decode())
    unsigned = Envelope(payloadType=env.payloadType, payload=env.payload, signatures=[])
    return {
        "unsigned": unsigned,
        "unknown_key": upgrade(key=MALLORY),
        "bad_signature": tampered,
        "principal_mismatch": sign_upgrade(ALICE[1], "operator:bob", "agent", "s-1", "r", NOW,
                                           60_000, nonce="n" * 16, classes=["L4"],
                                           session_key=None),
        "wrong_type": signing.sign(signing.PAYLOAD_TYPES["tool_grant"],
                                   base64.b64decode(env.payload), ALICE[1]),
        "malformed": signing.sign(env.payloadType, b'{"runtime": "agent"}', ALICE[1]),
        "expired": upgrade(now=NOW - 700_000),
        "expired ": upgrade(now=NOW + 400_000),
        "window_too_long": upgrade(now=NOW - 1000, ttl_ms=25 * 3600 * 1000),
        "wrong_runtime": upgrade("other-agent"),
        "wrong_session": upgrade(session="s-2"),
        "wrong_tool": upgrade(tools=["read"]),
        "wrong_tool ": upgrade(classes=["L2"]),
    }


async def test_bad_upgrades_are_refused_and_nothing_runs():
    rt, tools = gate()
    deploy, body = tools["deploy"]
    for reason, env in bad_upgrades().items():
        reply = await rt.invoke("deploy", ARGS, None, NOW, session="s-1", upgrade=env,
                                proof=proof(env, "deploy", ARGS))
        assert reply["refused"]["reason"] == reason.strip(), (reason, reply)
        assert reply["refused"]["detail"] and "\n" not in reply["refused"]["detail"]
    env = upgrade()
    no_session = await rt.invoke("deploy", ARGS, None, NOW, upgrade=env,
                                 proof=proof(env, "deploy", ARGS))
    assert no_session["refused"]["reason"] == "wrong_session"
    assert body.calls == []


async def test_a_bad_upgrade_falls_back_to_a_grant_and_a_good_one_leaves_it_unspent():
    rt, tools = gate()
    deploy, body = tools["deploy"]
    env = grant(deploy)
    evil = upgrade(key=MALLORY)
    reply = await rt.invoke("deploy", ARGS, env, NOW, session="s-1", upgrade=evil,
                            proof=proof(evil, "deploy", ARGS))
    assert reply["ok"] is True and "upgrade" not in reply
    env2, good = grant(deploy), upgrade()
    assert (await rt.invoke("deploy", ARGS, env2, NOW, session="s-1", upgrade=good,
                            proof=proof(good, "deploy", ARGS)))["upgrade"]
    assert (await rt.invoke("deploy", ARGS, env2, NOW))["ok"] is True  # still unspent
    assert len(body.calls) == 3


async def test_an_upgrade_by_tool_name_and_its_scope():
    rt, _ = gate()
    push, body = scoped("push", "L4")
    rt.runtime.register(push)
    env = upgrade(tools=["push"], scope=CapabilityScope(paths=["/srv/data/releases/**"]))
    inside, outside = {"path": "/srv/data/releases/v2"}, {"path": "/srv/data/other"}
    ok = await rt.invoke("push", inside, None, NOW, session="s-1", upgrade=env,
                         proof=proof(env, "push", inside))
    assert ok["ok"] is True
    out = await rt.invoke("push", outside, None, NOW, session="s-1", upgrade=env,
                          proof=proof(env, "push", outside))
    assert out["refused"]["reason"] == "out_of_scope"
    assert "session upgrade scope" in out["refused"]["detail"]
    assert (await rt.invoke("deploy", {}, None, NOW, session="s-1", upgrade=env,
                            proof=proof(env, "deploy")))["refused"]["reason"] == "wrong_tool"
    assert body.calls == [{"path": "/srv/data/releases/v2"}]


async def test_a_revoked_upgrade_is_refused_on_every_runtime_sharing_the_ledger():
    rt, tools = gate()
    deploy, body = tools["deploy"]
    env = upgrade()
    assert (await rt.invoke("deploy", {}, None, NOW, session="s-1", upgrade=env,
                            proof=proof(env, "deploy")))["ok"] is True
    for bad, reason in ((sign_revocation(MALLORY[1], MALLORY[0], "agent", upgrade_id(env), "r",
                                         NOW), "unknown_key"),
                        (sign_revocation(ALICE[1], ALICE[0], "other", upgrade_id(env), "r",
                                         NOW), "wrong_runtime"),
                        (grant(deploy), "wrong_type")):
        assert (await rt.revoke(bad))["refused"]["reason"] == reason
    assert (await rt.invoke("deploy", {}, None, NOW, session="s-1", upgrade=env,
                            proof=proof(env, "deploy")))["ok"] is True
    done = await rt.revoke(sign_revocation(ALICE[1], ALICE[0], "agent", upgrade_id(env),
                                           "session over", NOW + 5))
    assert done == {"ok": True, "revoked": upgrade_id(env), "revoked_by": ALICE[0]}
    replica, _ = gate(ledger=rt.ledger)
    for r in (rt, replica):
        reply = await r.invoke("deploy", {}, None, NOW + 10, session="s-1", upgrade=env,
                               proof=proof(env, "deploy", now=NOW + 10))
        assert reply["refused"]["reason"] == "revoked"
    assert len(body.calls) == 2


# -- the session's proof of key: an upgrade is not a bearer token -----------------------------


OTHER_SESSION = Ed25519PrivateKey.generate()  # a key the upgrade does not name


def bad_proofs(env: Envelope) -> dict[str, SessionProof | None]:
    good = proof(env, "deploy", ARGS)
    return {
        "session_proof_missing": None,
        "session_proof_invalid": proof(env, "deploy", ARGS, key=OTHER_SESSION),  # wrong key
        "session_proof_invalid ": proof(env, "read", ARGS),  # made for another tool
        "session_proof_invalid  ": proof(env, "deploy", {"path": "/"}),  # other arguments
        "session_proof_invalid   ": proof(env, "deploy", ARGS, runtime_name="other-agent"),
        "session_proof_invalid    ": proof(upgrade(), "deploy", ARGS),  # another upgrade's
        "session_proof_invalid     ": msgspec.structs.replace(good, at=good.at + 1),
        "session_proof_invalid      ": msgspec.structs.replace(good, nonce=good.nonce + "x"),
        "session_proof_invalid       ": msgspec.structs.replace(good, sig="not base64!"),
        "session_proof_stale": proof(env, "deploy", ARGS, now=NOW - PROOF_SKEW_MS - 1),
        "session_proof_stale ": proof(env, "deploy", ARGS, now=NOW + PROOF_SKEW_MS + 1),
    }


async def test_a_call_under_an_upgrade_needs_the_session_keys_proof_used_once():
    rt, tools = gate()
    deploy, body = tools["deploy"]
    env = upgrade()
    assert isinstance(rt.ledger, ProcessLedger)
    for reason, bad in bad_proofs(env).items():
        reply = await rt.invoke("deploy", ARGS, None, NOW, session="s-1", upgrade=env,
                                proof=bad)
        assert reply["refused"]["reason"] == reason.strip(), (reason, reply)
        assert reply["refused"]["detail"] and "\n" not in reply["refused"]["detail"]
    assert body.calls == [] and rt.ledger.spent == {}  # nothing ran, nothing spent
    edge = proof(env, "deploy", ARGS, now=NOW - PROOF_SKEW_MS)  # the window's edge holds
    reply = await rt.invoke("deploy", ARGS, None, NOW, session="s-1", upgrade=env, proof=edge)
    assert reply == {"ok": True, "result": "deploy ran", "granted_by": ALICE[0],
                     "upgrade": upgrade_id(env)}
    digest = proof_digest(proof_message("agent", "deploy", args_digest(ARGS), upgrade_id(env),
                                        edge.at, edge.nonce))
    assert set(rt.ledger.spent) == {digest}
    replica, replica_tools = gate(ledger=rt.ledger)
    for r in (rt, replica):  # used once, on every runtime sharing the ledger
        again = await r.invoke("deploy", ARGS, None, NOW, session="s-1", upgrade=env,
                               proof=edge)
        assert again["refused"]["reason"] == "session_proof_replayed"
    fresh = proof(env, "deploy", ARGS, now=NOW + 2)
    assert (await replica.invoke("deploy", ARGS, None, NOW + 2, session="s-1", upgrade=env,
                                 proof=fresh))["ok"] is True
    assert body.calls == [ARGS] and replica_tools["deploy"][1].calls == [ARGS]


async def test_a_refused_upgraded_call_spends_no_proof():
    rt, _ = gate()
    push, body = scoped("push", "L4")
    rt.runtime.register(push)
    env = upgrade(tools=["push"])
    outside = {"path": "/etc/passwd"}
    reply = await rt.invoke("push", outside, None, NOW, session="s-1", upgrade=env,
                            proof=proof(env, "push", outside))
    assert reply["refused"]["reason"] == "out_of_scope"
    revoked = upgrade(tools=["push"])
    await rt.revoke(sign_revocation(ALICE[1], ALICE[0], "agent", upgrade_id(revoked), "r", NOW))
    reply = await rt.invoke("push", {}, None, NOW, session="s-1", upgrade=revoked,
                            proof=proof(revoked, "push"))
    assert reply["refused"]["reason"] == "revoked"
    assert isinstance(rt.ledger, ProcessLedger) and rt.ledger.spent == {}
    assert body.calls == []


async def test_an_upgrade_signed_without_a_session_key_is_refused_unbound():
    """An upgrade from before `session_key` existed is a bearer token: refused, with the fix
    in the reason; a grant sent alongside still runs its one call."""
    rt, tools = gate()
    deploy, body = tools["deploy"]
    env = upgrade(session_key=None)
    assert b"session_key" not in base64.b64decode(env.payload)  # as one signed before it
    for with_proof in (proof(env, "deploy", ARGS), None):
        reply = await rt.invoke("deploy", ARGS, None, NOW, session="s-1", upgrade=env,
                                proof=with_proof)
        assert reply["refused"]["reason"] == "upgrade_unbound"
        assert "re-issue" in reply["refused"]["detail"]
    assert body.calls == []
    reply = await rt.invoke("deploy", ARGS, grant(deploy), NOW, session="s-1", upgrade=env)
    assert reply["ok"] is True and "upgrade" not in reply


async def test_a_proof_written_into_the_ledger_beforehand_refuses_it():
    """Anyone who can write the ledger can refuse a proof (failing closed), never allow one."""
    ledger = ForgingLedger()
    rt, tools = gate(ledger=ledger)
    env = upgrade()
    made = proof(env, "deploy", ARGS)
    digest = proof_digest(proof_message("agent", "deploy", args_digest(ARGS), upgrade_id(env),
                                        made.at, made.nonce))
    ledger.spent[digest] = NOW + 10 * PROOF_SKEW_MS
    reply = await rt.invoke("deploy", ARGS, None, NOW, session="s-1", upgrade=env, proof=made)
    assert reply["refused"]["reason"] == "session_proof_replayed"
    assert tools["deploy"][1].calls == []


def test_signing_an_upgrade_for_a_key_that_is_not_one_fails():
    for bad in ("not base64!", base64.b64encode(b"x" * 31).decode(),
                base64.b64encode(b"x" * 33).decode()):
        with pytest.raises((ValueError, msgspec.ValidationError)):
            sign_upgrade(ALICE[1], ALICE[0], "agent", "s-1", "r", NOW, 60_000, nonce="n" * 16,
                         classes=["L4"], session_key=bad)


BOUND = msgspec.json.decode(base64.b64decode(upgrade().payload), type=SessionUpgrade)
PROOF_FIELDS = ("runtime", "tool", "args", "upgrade", "at", "nonce")
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.text(max_size=6))
a_call = st.fixed_dictionaries({
    "runtime": st.from_regex(r"[a-z][a-z0-9_-]{0,12}", fullmatch=True),
    "tool": st.from_regex(r"[a-z][a-z0-9_.-]{0,12}", fullmatch=True),
    "args": st.dictionaries(st.text(max_size=6), json_leaf, max_size=4),
    "upgrade": st.binary(min_size=32, max_size=32).map(bytes.hex),
    "at": st.integers(0, 2**45),
    "nonce": st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=8,
                     max_size=24),
})


@given(made=a_call, other=a_call, which=st.sampled_from(PROOF_FIELDS))
def test_a_proof_verifies_only_for_the_call_it_was_made_for(made, other, which):
    signed = proof_for(made)
    assert check_proof(BOUND, made["upgrade"], made["runtime"], made["tool"], made["args"],
                       signed, made["at"]) == proof_digest(proof_message(
        made["runtime"], made["tool"], args_digest(made["args"]), made["upgrade"], made["at"],
        made["nonce"]))
    changed = {**made, which: other[which]}
    if canonical_json(changed[which]) == canonical_json(made[which]):
        return  # the same call, or one the canonical JSON cannot tell apart
    presented = msgspec.structs.replace(signed, at=changed["at"], nonce=changed["nonce"])
    with pytest.raises(ActRefused) as refused:
        check_proof(BOUND, changed["upgrade"], changed["runtime"], changed["tool"],
                    changed["args"], presented, changed["at"])
    assert refused.value.code == "session_proof_invalid", which


def proof_for(call: dict) -> SessionProof:
    return sign_proof(SESSION, call["runtime"], call["tool"], call["args"], call["upgrade"],
                      call["at"], nonce=call["nonce"])


# -- the gate's steps, decided without a ledger ------------------------------------------------
#
# The core asks the ledger through steps and takes the answers as values; these drive the steps
# by hand, with no ledger and no event loop, and check what each one asks.


def test_a_call_that_needs_nothing_from_the_ledger_is_decided_at_once():
    rt, tools = runtime("interactive")
    decided = rt.gate("deploy", ARGS, grant(tools["deploy"][0]), NOW)
    assert decided == Decision("deploy", ARGS, tools["deploy"][0], via="mounted")
    assert rt.gate("nope", None, None, NOW) == Decision("nope", {}, reply={"error": {
        "code": "not_found", "message": "no tool named 'nope'", "field": "tool"}})


def test_a_granted_call_asks_the_ledger_to_spend_its_grant_and_decides_on_the_answer():
    rt, tools = runtime(spent_margin_ms=7)
    deploy, body = tools["deploy"]
    env = grant(deploy, ttl_ms=1000)
    step = rt.gate("deploy", ARGS, env, NOW)
    assert isinstance(step, Spend)  # the act id, its mark kept past its lapse by the margin
    assert (step.act, step.until, step.now) == (upgrade_id(env), NOW + 1000 + 7, NOW)
    allowed = step.then(True)
    assert isinstance(allowed, Decision) and allowed.allowed and allowed.via == "grant"
    assert allowed.principal == ALICE[0] and act_id(allowed.act) == upgrade_id(env)
    for answer, reason in ((False, "replayed"), (LedgerUntrusted("lost"), "ledger_untrusted")):
        refused = step.then(answer)
        assert isinstance(refused, Decision) and refused.reply is not None
        assert refused.reply["refused"]["reason"] == reason
    assert body.calls == []  # deciding runs nothing


def test_a_first_l2_call_reads_the_acceptance_then_spends_and_records_its_own():
    rt, tools = runtime()
    write, _ = tools["write"]
    env = grant(write, runtime="agent")
    read = rt.gate("write", ARGS, env, NOW)
    assert isinstance(read, ReadAcceptance)
    assert (read.runtime, read.token) == ("agent", grant_token(write))
    spend = read.then(None)  # the ledger holds none
    assert isinstance(spend, Spend) and spend.act == upgrade_id(env)
    record = spend.then(True)
    assert isinstance(record, RecordAcceptance)
    assert (record.runtime, record.token, record.grant) == ("agent", grant_token(write), env)
    assert rt.needs_acceptance(write)  # until the ledger has recorded it
    decided = record.then()
    assert isinstance(decided, Decision) and decided.via == "acceptance"
    assert not rt.needs_acceptance(write)  # recorded: the next call asks nothing
    assert rt.gate("write", {}, None, NOW) == Decision("write", {}, write, via="accepted")


def test_an_acceptance_the_ledger_holds_counts_only_when_it_verifies():
    rt, tools = runtime()
    write, _ = tools["write"]
    read = rt.gate("write", ARGS, None, NOW)
    assert isinstance(read, ReadAcceptance)
    forged = read.then(grant(write, key=MALLORY, runtime="agent"))
    assert isinstance(forged, Decision) and forged.reply is not None
    assert forged.reply["refused"]["reason"] == "acceptance_required"
    assert read.then(grant(write, runtime="agent")) == Decision("write", ARGS, write,
                                                               via="accepted")


def test_an_upgraded_call_asks_whether_its_upgrade_is_revoked_then_spends_its_proof():
    rt, tools = runtime()
    deploy, _ = tools["deploy"]
    env, fallback = upgrade(), grant(deploy)
    made = proof(env, "deploy", ARGS)
    step = rt.gate("deploy", ARGS, None, NOW, session="s-1", upgrade=env, proof=made)
    assert isinstance(step, ReadRevoked) and step.upgrade == upgrade_id(env)
    spend = step.then(False)
    digest = proof_digest(proof_message("agent", "deploy", args_digest(ARGS), upgrade_id(env),
                                        made.at, made.nonce))
    assert isinstance(spend, Spend)
    assert (spend.act, spend.until, spend.now) == (digest, proof_lapse(made) + SPENT_MARGIN_MS,
                                                   NOW)
    decided = spend.then(True)
    assert isinstance(decided, Decision) and decided.via == "upgrade" and decided.proof == digest
    for answer, reason in ((True, "revoked"), (LedgerUntrusted("lost 1"), "ledger_untrusted")):
        refused = step.then(answer)
        assert isinstance(refused, Decision) and refused.reply is not None
        assert refused.reply["refused"]["reason"] == reason
    # with a grant sent alongside, an upgrade the ledger does not clear leaves the call to it
    step = rt.gate("deploy", ARGS, fallback, NOW, session="s-1", upgrade=env, proof=made)
    assert isinstance(step, ReadRevoked)
    spend = step.then(True)
    lapse = grant_lapse(msgspec.json.decode(base64.b64decode(fallback.payload), type=ToolGrant))
    assert isinstance(spend, Spend)
    assert (spend.act, spend.until) == (upgrade_id(fallback), lapse + SPENT_MARGIN_MS)


def test_a_revocation_is_verified_before_it_is_recorded():
    rt, _ = runtime()
    env = upgrade()
    signed = sign_revocation(ALICE[1], ALICE[0], "agent", upgrade_id(env), "over", NOW)
    assert rt.revocation(signed) == RecordRevocation(upgrade_id(env), signed, ALICE[0])
    refused = rt.revocation(sign_revocation(ALICE[1], ALICE[0], "other", upgrade_id(env), "r",
                                            NOW))
    assert isinstance(refused, dict) and refused["refused"]["reason"] == "wrong_runtime"


# -- the ledger: what replicas share ------------------------------------------------------------


async def test_replicas_sharing_a_ledger_spend_a_grant_once_and_share_acceptances():
    ledger = ProcessLedger()
    a, ta = gate(ledger=ledger)
    b, tb = gate(ledger=ledger)
    env = grant(ta["deploy"][0])
    assert (await a.invoke("deploy", ARGS, env, NOW))["ok"] is True
    assert (await b.invoke("deploy", ARGS, env, NOW))["refused"]["reason"] == "replayed"
    accept = grant(ta["write"][0], runtime="agent")
    assert (await a.invoke("write", ARGS, accept, NOW))["ok"] is True
    assert by_name(b.runtime.catalog())["write"]["needs_acceptance"] is True  # not yet read
    assert (await b.invoke("write", {"n": 1}, None, NOW))["ok"] is True
    assert "needs_acceptance" not in by_name(b.runtime.catalog())["write"]
    c, _ = gate(ledger=ledger)
    await c.refresh()
    assert "needs_acceptance" not in by_name(c.runtime.catalog())["write"]
    assert tb["write"][1].calls == [{"n": 1}]


# -- how long a spent key is kept ----------------------------------------------------------------
#
# The spending replica gives the key a TTL from its own clock `now`; the key is there until
# `now + ttl` on that clock. Another replica's clock may run up to the margin behind (a replica
# ahead only refuses sooner). Whenever the key is gone, every such replica refuses the act by its
# own time check: the TTL reaches past the last instant the act could be accepted anywhere.

margins = st.integers(0, 2 * SPENT_MARGIN_MS)


@given(at=st.integers(CLOCK_SKEW_MS, 2**45), ttl=st.integers(1, MAX_GRANT_MS),
       into=st.floats(0, 1), margin=margins, skew=st.floats(0, 1), after=st.integers(0, 10**7))
def test_a_spent_grants_key_outlives_every_replicas_acceptance(at, ttl, into, margin, skew,
                                                                after):
    rt, tools = runtime(spent_margin_ms=margin)
    env = grant(tools["deploy"][0], now=at, ttl_ms=ttl)
    act = msgspec.json.decode(base64.b64decode(env.payload), type=ToolGrant)
    now = at + min(int(ttl * into), ttl - 1)  # an instant the spender accepts the grant
    key_gone = now + spent_ttl_s(spent_until(grant_lapse(act), margin), now) * 1000
    assert key_gone - now <= MAX_GRANT_MS + margin + 1000  # a mark never outlives a day much
    other = key_gone + after - int(margin * skew)  # a replica behind by skew * margin
    decided = rt.gate("deploy", ARGS, env, other)  # refused before asking the ledger anything
    assert isinstance(decided, Decision) and decided.reply is not None
    assert decided.reply["refused"]["reason"] == "expired"
    assert tools["deploy"][1].calls == []


@given(call=a_call, drift=st.integers(-PROOF_SKEW_MS, PROOF_SKEW_MS), margin=margins,
       skew=st.integers(-1, 1), behind=st.floats(0, 1), after=st.integers(0, 10**7))
def test_a_spent_proofs_key_outlives_every_replicas_acceptance(call, drift, margin, skew,
                                                               behind, after):
    signed = proof_for(call)
    now = call["at"] + drift  # the spender accepts it: within PROOF_SKEW_MS of its clock
    check_proof(BOUND, call["upgrade"], call["runtime"], call["tool"], call["args"], signed,
                now)
    key_gone = now + spent_ttl_s(spent_until(proof_lapse(signed), margin), now) * 1000
    other = key_gone + after + skew * int(margin * behind)  # behind or ahead by the margin
    with pytest.raises(ActRefused) as refused:
        check_proof(BOUND, call["upgrade"], call["runtime"], call["tool"], call["args"],
                    signed, other)
    assert refused.value.code == "session_proof_stale"


@given(until=st.integers(0, 2**53), now=st.integers(0, 2**53))
def test_a_spent_keys_ttl_is_whole_seconds_rounded_up(until, now):
    ttl = spent_ttl_s(until, now)
    assert ttl >= 1 and now + ttl * 1000 >= until
    assert ttl == 1 or now + (ttl - 1) * 1000 < until  # and no longer than that


def test_the_rule_in_numbers():
    assert SPENT_MARGIN_MS == 5 * 60 * 1000
    assert spent_until(NOW) == NOW + SPENT_MARGIN_MS
    assert spent_ttl_s(NOW + 1, NOW) == 1 and spent_ttl_s(NOW + 1001, NOW) == 2
    assert spent_ttl_s(NOW - 5000, NOW) == 1  # already past: the shortest a server keeps
    env = sign_grant(ALICE[1], ALICE[0], "gt:" + "0" * 64, "deploy", ARGS, "r", NOW,
                     nonce="n" * 16)
    act = msgspec.json.decode(base64.b64decode(env.payload), type=ToolGrant)
    assert grant_lapse(act) == NOW + CLOCK_SKEW_MS  # sign_grant's default window
    assert grant_lapse(msgspec.structs.replace(act, expires_at=None)) == NOW + CLOCK_SKEW_MS
    assert proof_lapse(proof(upgrade(), "deploy", now=NOW)) == NOW + PROOF_SKEW_MS + 1


async def test_the_runtime_hands_the_ledger_the_keep_until_of_each_act():
    ledger = ProcessLedger()
    rt, tools = gate("interactive", ceiling="L2", ledger=ledger, spent_margin_ms=7)
    env = grant(tools["deploy"][0], ttl_ms=1000)
    assert (await rt.invoke("deploy", ARGS, env, NOW))["ok"] is True
    assert ledger.spent == {upgrade_id(env): NOW + 1000 + 7}
    up = upgrade("agent", "s-1")
    signed = proof(up, "deploy", ARGS, now=NOW - 5)
    reply = await rt.invoke("deploy", ARGS, None, NOW, session="s-1", upgrade=up, proof=signed)
    assert reply["ok"] is True
    assert ledger.spent[next(a for a in ledger.spent if a != upgrade_id(env))] == (
        NOW - 5 + PROOF_SKEW_MS + 1 + 7)


@pytest.mark.parametrize("margin", [-1, 1.5, "300000", True, None])
def test_a_bad_spent_margin_is_refused_in_one_line(margin):
    with pytest.raises(ValueError, match="spent_margin_ms .* must be a whole number"):
        runtime(spent_margin_ms=margin)


class ForgingLedger(ProcessLedger):
    """A ledger anyone could have written: whatever acceptance the test plants."""


async def test_a_forged_acceptance_in_the_ledger_accepts_nothing():
    ledger = ForgingLedger()
    rt, tools = gate(ledger=ledger)
    write, body = tools["write"]
    token = grant_token(write)
    other, _ = runtime(name="other-agent")
    forged = {
        "mallory's key": grant(write, key=MALLORY, runtime="agent"),
        "another runtime's acceptance": grant(write, runtime="other-agent"),
        "no runtime named": grant(write),
        "another tool's grant": grant(tools["deploy"][0], runtime="agent"),
        "not a grant": upgrade(),
        "unsigned": Envelope(payloadType=signing.PAYLOAD_TYPES["tool_grant"],
                             payload=grant(write, runtime="agent").payload, signatures=[]),
    }
    for what, env in forged.items():
        ledger.accepted[("agent", token)] = env
        await rt.refresh()
        assert by_name(rt.runtime.catalog())["write"]["needs_acceptance"] is True, what
        reply = await rt.invoke("write", ARGS, None, NOW)
        assert reply["refused"]["reason"] == "acceptance_required", what
    assert body.calls == []


# -- the audit chain's trailers -----------------------------------------------------------------


async def test_decisions_are_drafted_for_the_tools_chain_without_the_arguments():
    from improved.core import audit, evidence
    from improved.core.record import ChainHead

    rt, tools = gate()
    deploy, _ = tools["deploy"]
    secret = {"password": "hunter2", "path": "/srv/data"}
    decisions = [
        await rt.decide("read", secret, None, NOW),
        await rt.decide("deploy", secret, None, NOW),
        await rt.decide("deploy", secret, grant(deploy, secret, runtime="agent"), NOW),
        await rt.decide("deploy", {}, None, NOW, session="s-1", upgrade=(up := upgrade()),
                        proof=proof(up, "deploy", nonce="nonce-of-the-call")),
    ]
    assert [d.allowed for d in decisions] == [True, False, True, True]
    cid = tools_chain_id("agent")
    head, trailers = ChainHead(), []
    for n, d in enumerate(decisions):
        draft = call_draft("agent", d)
        t = audit.seal_next(draft, cid, head, d.provider.authority, "operation", NOW + n)
        head = ChainHead(length=head.length + 1, last_hash=t.hash, stream_seq=n + 1)
        trailers.append(evidence.sign(t, DAEMON))
    bodies = [msgspec.to_builtins(t) for t in trailers]
    assert all(b"hunter2" not in to_json(t) for t in trailers)
    assert [t.verdict for t in trailers] == ["tool_call", "refused", "tool_call", "tool_call"]
    assert [t.gate_class for t in trailers] == ["L0", "L4", "L4", "L4"]
    refs = [dict(r.split(":", 1) for r in t.refs) for t in trailers]
    assert refs[0]["args"] == args_digest(secret) and refs[0]["via"] == "mounted"
    assert refs[1]["refused"] == "authority_gated"
    assert (refs[2]["via"], trailers[2].actor) == ("grant", ALICE[0])
    assert (refs[3]["via"], refs[3]["session"]) == ("upgrade", "s-1")
    assert refs[3]["proof"] == proof_digest(proof_message(
        "agent", "deploy", args_digest({}), upgrade_id(up), NOW, "nonce-of-the-call"))
    assert refs[3]["session_key"] == signing.keyid_of(signing.raw_public(SESSION.public_key()))
    assert "proof" not in refs[2] and "session_key" not in refs[2]
    assert trailers[2].envelope is not None and trailers[1].envelope is None
    readers = evidence.ChainTrust(frozenset({DAEMON_KEYID}),
                                  evidence.History(fallback=evidence.KeySet(trust())))
    assert audit.verify_chain(cid, bodies, readers) is None
    # the signed act must say what the trailer says
    for change in ({"args": "0" * 64}, {"tool": "read"}, {"session": "s-9"},
                   {"runtime": "other"}, {"session_key": "ed25519:" + "0" * 64}):
        at = 3 if {"session", "session_key"} & change.keys() else 2
        forged = [dict(b) for b in bodies[:at + 1]]
        forged[at]["refs"] = [f"{k}:{change.get(k, v)}" for k, v in refs[at].items()]
        resealed = audit.seal_next(audit.Draft(
            "apply", "apply", forged[at]["actor"], "human", forged[at]["reason"],
            "tool_call", refs=tuple(forged[at]["refs"]), envelope=trailers[at].envelope),
            cid, ChainHead(length=at, last_hash=bodies[at - 1]["hash"], stream_seq=at), "L4", "operation", NOW)
        forged[at] = msgspec.to_builtins(evidence.sign(resealed, DAEMON))
        brk = audit.verify_chain(cid, forged, readers)
        assert brk is not None and brk.seq == at and "signed act says" in brk.problem, change


async def _upgraded_chain(n: int = 2) -> tuple[str, list[dict], list]:
    """`n` upgraded calls of `deploy` on runtime `agent`, each with its own proof, as the
    runtime records them: the chain id, the signed trailers' bodies and their envelopes."""
    from improved.core import audit, evidence
    from improved.core.record import ChainHead

    rt, _ = gate()
    up = upgrade()
    cid, head, bodies = tools_chain_id("agent"), ChainHead(), []
    for k in range(n):
        args = {"path": f"/srv/data/{k}"}
        d = await rt.decide("deploy", args, None, NOW + k, session="s-1", upgrade=up,
                            proof=proof(up, "deploy", args, now=NOW + k))
        assert d.allowed, d.reply
        t = evidence.sign(audit.seal_next(call_draft("agent", d), cid, head, "L4",
                                          "operation", NOW + k), DAEMON)
        head = ChainHead(length=head.length + 1, last_hash=t.hash, stream_seq=k + 1)
        bodies.append(msgspec.to_builtins(t))
    return cid, bodies, up


def _relinked(cid: str, bodies: list[dict], at: int, refs: list[str]) -> list[dict]:
    """The chain with trailer `at`'s refs replaced, it and every later one re-hashed, re-linked
    and re-signed by the chain's writer: only what the refs say can be wrong."""
    from improved.core import audit, evidence
    from improved.protocol.model import Trailer

    out = [dict(b) for b in bodies]
    out[at]["refs"] = refs
    for k in range(at, len(out)):
        body = {key: v for key, v in out[k].items() if key not in ("hash", "sig")}
        if k:
            body["prev"] = out[k - 1]["hash"]
        body["hash"] = audit.trailer_hash(body)
        out[k] = msgspec.to_builtins(evidence.sign(msgspec.convert(body, Trailer), DAEMON))
    return out


def _readers():
    from improved.core import evidence

    return evidence.ChainTrust(frozenset({DAEMON_KEYID}),
                               evidence.History(fallback=evidence.KeySet(trust())))


async def test_an_upgraded_calls_trailer_records_its_proof_and_a_verifier_rechecks_it():
    """The session proof is on the trailer (`proof_at`, `proof_nonce`, `proof_sig`, beside the
    `proof:` digest), so a verifier holding the chain alone re-checks it against the upgrade's
    session key. A trailer whose recorded proof was altered — re-hashed and re-signed by the
    chain's own writer, so hashes, links and signatures all hold — is a break."""
    from improved.core import audit

    cid, bodies, up = await _upgraded_chain()
    assert audit.verify_chain(cid, bodies, _readers()) is None
    refs = dict(r.split(":", 1) for r in bodies[1]["refs"])
    made = proof(up, "deploy", {"path": "/srv/data/1"}, now=NOW + 1, nonce=refs["proof_nonce"])
    assert (int(refs["proof_at"]), refs["proof_sig"]) == (made.at, made.sig)
    other = Ed25519PrivateKey.generate()
    forged_sig = proof(up, "deploy", {"path": "/srv/data/1"}, key=other, now=NOW + 1,
                       nonce=refs["proof_nonce"]).sig
    cases = {
        "proof_nonce": ({"proof_nonce": "n" * 32}, "does not verify (session_proof_invalid)"),
        "proof_at": ({"proof_at": str(NOW + 2)}, "does not verify (session_proof_invalid)"),
        "proof_sig": ({"proof_sig": forged_sig}, "does not verify (session_proof_invalid)"),
        "args": ({"args": args_digest({"path": "/etc"})}, "does not verify"),
        "tool": ({"tool": "read"}, "does not verify"),
        "proof": ({"proof": "0" * 64}, "the recorded session proof has digest"),
        "a field left out": ({"proof_sig": None}, "recorded without proof_sig"),
        "not a number": ({"proof_at": "soon"}, "is not a proof"),
        "the whole proof left out after one was recorded": (
            {"proof_at": None, "proof_nonce": None, "proof_sig": None},
            "the session proof is not recorded"),
    }
    for what, (change, says) in cases.items():
        changed = [f"{k}:{change.get(k, v)}" for k, v in refs.items()
                   if change.get(k, v) is not None]
        brk = audit.verify_chain(cid, _relinked(cid, bodies, 1, changed), _readers())
        assert brk is not None and brk.seq == 1 and says in brk.problem, (what, brk)


async def test_a_trailer_written_before_proofs_were_recorded_still_verifies():
    """A chain whose upgraded calls carry only the proof's digest and the session key's id,
    as the runtime wrote them before the proof itself was recorded, verifies as before."""
    from improved.core import audit

    cid, bodies, _ = await _upgraded_chain()
    old = bodies
    for k in range(len(bodies)):
        old = _relinked(cid, old, k, [r for r in old[k]["refs"]
                                      if not r.startswith(("proof_at:", "proof_nonce:",
                                                           "proof_sig:"))])
    assert all("proof_sig" not in str(b["refs"]) for b in old)
    assert audit.verify_chain(cid, old, _readers()) is None


async def test_a_runtime_key_writes_its_own_chain_and_no_other():
    """[trust.runtimes] → chain id → (runtime, key id): a key trusted for runtime `agent`
    verifies `agent`'s chain only, as a runtime's (never a daemon's) signature."""
    from improved.core import audit, evidence
    from improved.core.record import ChainHead
    from improved.core.tools import claimed_runtime, runtime_writers

    key = Ed25519PrivateKey.generate()
    public = base64.b64encode(signing.raw_public(key.public_key())).decode()
    writers = runtime_writers(signing.TrustStore.from_config({"agent": public}))
    kid = signing.keyid_of(signing.raw_public(key.public_key()))
    assert writers == {tools_chain_id("agent"): ("agent", kid)}
    rt, _ = gate()
    draft = call_draft("agent", await rt.decide("read", ARGS, None, NOW))
    cid = tools_chain_id("agent")
    body = msgspec.to_builtins(evidence.sign(audit.seal_next(
        draft, cid, ChainHead(), "L0", "operation", NOW), key))
    assert claimed_runtime(body, cid) == "agent"
    assert claimed_runtime(body, tools_chain_id("other")) is None  # names another's chain
    history = evidence.History(fallback=evidence.KeySet(trust()))
    own = evidence.ChainTrust(frozenset({writers[cid][1]}), history, writer="runtime")
    assert audit.verify_chain(cid, [body], own) is None
    stranger = evidence.ChainTrust(frozenset({DAEMON_KEYID}), history, writer="runtime")
    brk = audit.verify_chain(cid, [body], stranger)
    assert brk is not None and "which is not a trusted runtime key" in brk.problem


def test_acts_outside_the_daemons_log_count_under_any_key_the_history_held():
    from improved.core import evidence

    old, new = (signing.TrustStore.from_config(
        {ALICE[0]: base64.b64encode(signing.raw_public(k.public_key())).decode()})
        for k in (ALICE[1], MALLORY[1]))
    history = evidence.History(((5, evidence.KeySet(old)), (9, evidence.KeySet(new))))
    assert set(evidence.ever(history).operators.keys) == set(old.keys) | set(new.keys)



def test_a_grant_is_signed_for_a_day_at_most():
    sign_grant(ALICE[1], ALICE[0], "gt:" + "0" * 64, "deploy", ARGS, "r", NOW, MAX_GRANT_MS,
               nonce="n" * 16)
    with pytest.raises(ValueError, match="a grant lives at most 86400 s"):
        sign_grant(ALICE[1], ALICE[0], "gt:" + "0" * 64, "deploy", ARGS, "r", NOW,
                   MAX_GRANT_MS + 1, nonce="n" * 16)
