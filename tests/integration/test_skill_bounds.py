"""A Skill grain's references bind (OMS Skill grain): its calls through the reference tool
runtime go only to its `allowed_tools`, a Tool grain it names by address must be held by the
skills store, and each dependency must resolve to a Skill grain the store holds. Against a real
nats-server; the session daemon provides the tool runtimes' streams."""

from __future__ import annotations

import contextlib
import secrets
import time

import msgspec
import pytest
import pytest_asyncio

from improved.client.chains import read_sequenced
from improved.core.tools import chain_id as tools_chain_id
from improved.core.tools import sign_grant
from improved.protocol import canonical, subjects
from improved.protocol.model import to_json
from improved_reference.skill_definitions import bucket_names
from improved_reference.skills_store import Refused, SkillsStore
from improved_reference.tool_runtime import ToolRuntimeService
from tests.bus import daemon_key, send
from tests.integration.test_skills_store import order, proposal
from tests.keys import ALICE
from tests.tool_surfaces import ARGS, runtime

pytestmark = pytest.mark.usefixtures("daemon")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def tool_grain(name: str) -> dict:
    return {"type": "tool", "name": name, "description": f"the {name} tool",
            "created_at": 1768471200000}


def skill(name: str, **fields) -> dict:
    return {"name": name, "description": "Summarise a document",
            "instructions": "Read the text, then write three bullets.", **fields}


@pytest_asyncio.fixture(loop_scope="session")
async def store(nc, svc):
    s = SkillsStore(nc, f"{svc}-skills")
    await s.start()
    yield s
    await s.stop()
    for bucket in bucket_names(s.service):
        await nc.jetstream().delete_key_value(bucket)


async def ask(nc, subject: str, body: dict) -> dict:
    return msgspec.json.decode((await nc.request(subject, to_json(body), timeout=5)).data)


@contextlib.asynccontextmanager
async def serving(nc, rt, skills: str | None):
    service = ToolRuntimeService(nc, rt, daemon_key(), skills=skills)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


async def runtime_chain(nc, name: str) -> list[dict]:
    chain = await read_sequenced(nc.jetstream(), subjects.tools_audit(tools_chain_id(name)),
                                 stream=subjects.STREAM_TOOLS_AUDIT)
    return [dict(r.split(":", 1) for r in body["refs"]) | {"verdict": body["verdict"]}
            for _, body in chain]


# -- 1. the tool runtime binds a skill's calls to its allowed_tools -----------------------------


async def test_a_call_outside_allowed_tools_is_refused_recorded_and_spends_nothing(
        nc, svc, store):
    """A skill allowing `read` (by its Tool grain's address) calls `read`; its call of
    `deploy`, even under a valid grant, is refused `outside_allowed_tools`, recorded on the
    runtime's chain, and the grant stays unspent: the same grant then runs `deploy` for a
    call made for no skill."""
    held = await ask(nc, subjects.skills_tool(store.service), {"grain": tool_grain("read")})
    assert held["address"] == "mg:sha256:" + canonical.content_address(
        tool_grain("read"), canonical.TOOL)
    identity = await store.put_definition(skill(f"sum-{svc}",
                                                allowed_tools=[held["address"]]))
    rt, tools = runtime(name=svc)
    read_body, deploy_body = tools["read"][1], tools["deploy"][1]
    env = sign_grant(ALICE[1], ALICE[0], tools["deploy"][0], "deploy", ARGS, "ticket 9",
                     now_ms(), nonce=secrets.token_hex(16))
    async with serving(nc, rt, store.service):
        call = {"tool": "read", "args": ARGS, "skill": identity}
        assert (await ask(nc, subjects.tools_call(svc), call))["ok"] is True
        outside = {"tool": "deploy", "args": ARGS, "grant": env, "skill": identity}
        refused = (await ask(nc, subjects.tools_call(svc), outside))["refused"]
        assert refused["reason"] == "outside_allowed_tools"
        assert "allows the tools ['read'], not deploy" in refused["detail"]
        assert deploy_body.calls == []
        ran = await ask(nc, subjects.tools_call(svc), {"tool": "deploy", "args": ARGS,
                                                        "grant": env})
        assert ran == {"ok": True, "result": "deploy ran", "granted_by": ALICE[0]}
    assert read_body.calls == [ARGS] and deploy_body.calls == [ARGS]
    chain = await runtime_chain(nc, svc)
    assert [(r["verdict"], r.get("refused")) for r in chain[1:]] == [
        ("tool_call", None), ("refused", "outside_allowed_tools"), ("tool_call", None)]


async def test_a_skill_the_runtime_cannot_bind_calls_nothing(nc, svc, store):
    """A skill the store does not hold, a record altered after it was stored, or a runtime
    reading no skills store: each refuses `skill_unbound` in one line, and nothing runs."""
    identity = await store.put_definition(skill(f"sum-{svc}", allowed_tools=["read"]))
    unknown = f"sum-{svc}:" + "0" * 64
    rt, tools = runtime(name=svc)
    async with serving(nc, rt, store.service):
        reply = await ask(nc, subjects.tools_call(svc),
                          {"tool": "read", "args": ARGS, "skill": unknown})
        assert reply["refused"]["reason"] == "skill_unbound"
        assert "no stored skill" in reply["refused"]["detail"]
        kv = await nc.jetstream().key_value(bucket_names(store.service)[0])
        name, sha = identity.split(":")
        record = msgspec.json.decode((await kv.get(f"{name}.{sha}")).value)
        record["definition"]["allowed_tools"] = ["read", "deploy"]  # a widened bound
        await kv.put(f"{name}.{sha}", to_json(record))
        reply = await ask(nc, subjects.tools_call(svc),
                          {"tool": "deploy", "args": ARGS, "skill": identity})
        assert reply["refused"]["reason"] == "skill_unbound"
        assert "altered" in reply["refused"]["detail"] and "\n" not in reply["refused"]["detail"]
    rt2, tools2 = runtime(name=f"{svc}-b")
    async with serving(nc, rt2, None):
        reply = await ask(nc, subjects.tools_call(rt2.name),
                          {"tool": "read", "args": ARGS, "skill": identity})
        assert reply["refused"]["reason"] == "skill_unbound"
    assert tools["read"][1].calls == [] and tools["deploy"][1].calls == []
    assert tools2["read"][1].calls == []


async def test_allowed_tools_naming_a_tool_grain_the_store_does_not_hold_is_refused(
        nc, svc, store):
    """An `allowed_tools` address is checked: the store refuses, in one line, a skill naming a
    Tool grain it does not hold, and a string that is neither a tool name nor an address."""
    name = f"sum-{svc}"
    missing = "mg:sha256:" + "ab" * 32
    result, _ = await send(nc, store.service, order(proposal(
        store.service, {"skill": skill(name, allowed_tools=["read", missing])},
        target=f"skill:{name}")))
    assert not result.ok
    assert result.error == (f"allowed_tools[1] = {missing} names no Tool definition grain "
                            f"this store holds; keep it first on "
                            f"{subjects.skills_tool(store.service)}")
    with pytest.raises(Refused, match=r"allowed_tools\[0\] = 'Read Files' is neither"):
        await store.put_definition(skill(name, allowed_tools=["Read Files"]))
    bad = await ask(nc, subjects.skills_tool(store.service),
                    {"grain": {"type": "tool", "name": "x", "created_at": "yesterday"}})
    assert bad["error"]["code"] == "invalid_value" and bad["error"]["field"] == "grain"
    assert store.applies == 0


# -- 2. dependencies resolve to Skill grains the store holds ------------------------------------


async def test_a_dependency_resolves_to_a_skill_grain_the_store_holds(nc, svc, store):
    """A stored skill's `address` is a dependency the store resolves; an address it holds no
    grain for is refused in one line, and the `<name>:<sha256>` skill hash, which is no grain
    address, is refused naming the form expected."""
    base = f"assets-{svc}"
    applied, _ = await send(nc, store.service, order(proposal(
        store.service, {"skill": skill(base)}, target=f"skill:{base}")))
    assert applied.ok, applied.error
    address = (await store.record(applied.applied_id))["address"]
    name = f"threats-{svc}"

    async def propose_with(deps: list[str]):
        return (await send(nc, store.service, order(proposal(
            store.service, {"skill": skill(name, dependencies=deps)},
            target=f"skill:{name}"))))[0]

    unknown = "mg:sha256:" + "c" * 64
    result = await propose_with([unknown])
    assert not result.ok and result.error.startswith(
        f"dependencies[0] = {unknown} names no Skill grain this store holds")
    skill_hash = canonical.skill_hash(skill(base))
    result = await propose_with([skill_hash])  # the hash alone: well formed, no grain
    assert not result.ok and "not a <name>:<sha256> skill hash" in result.error
    result = await propose_with([applied.applied_id])  # <name>:<sha256>
    assert not result.ok and result.error.startswith(f"dependencies[0] = '{base}:")
    assert result.error.endswith(" is not a Skill grain's content address "
                                 "(mg:sha256:<64 lowercase hex>)")
    result = await propose_with(["mg:sha256:" + address])
    assert result.ok, result.error
    assert (await store.record(result.applied_id))["definition"]["dependencies"] == [
        "mg:sha256:" + address]
