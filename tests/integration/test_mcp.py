"""`improved mcp` as an AI agent meets it: the MCP SDK's own client runs the command as a
subprocess (stdio, or streamable HTTP with --http) against the session's nats-server and
daemon, as one agent of one service. It proposes an L0 its service applies and an L2 that waits
for an operator, follows both by id prefix, lists them, signals on one (recorded on the chain),
gets a tool error naming the field for a malformed proposal and keeps serving, and finds no tool
that carries authority. Signed with its key, its proposals name it as their verified proposer.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives import serialization
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError

from improved import testing
from improved.core.guards import DEFAULT_FORBIDDEN
from improved.runtime import bus
from improved_reference.ranking_store import RankingStore
from tests.bus import eventually
from tests.cli import ENV, IMPROVED
from tests.keys import AGENT_A, SIGNED

on_the_session_loop = pytest.mark.asyncio(loop_scope="session")

AGENT = "tuner"
AUTHORITY_WORDS = ("approve", "reject", "grant", "revoke", "vote", "crisis", "resolve")


def stdio(nats_url: str, svc: str, cwd: Path, *extra: str) -> StdioServerParameters:
    """`improved mcp` for service `svc` as agent AGENT, run as an MCP client runs it."""
    return StdioServerParameters(
        command=IMPROVED[0], args=[*IMPROVED[1:], "mcp", "--nats", nats_url, "--service", svc,
                                   "--agent", AGENT, *extra],
        env={**ENV, "XDG_STATE_HOME": str(cwd / "state")}, cwd=str(cwd))


def bare(proposal) -> dict:
    """A proposal as an agent writes it: service, origin and created_at left out."""
    doc = msgspec.to_builtins(proposal)
    for field in ("service", "origin", "created_at"):
        doc.pop(field)
    return doc


async def call(client: Client, tool: str, **args) -> dict:
    """A tool's answer, which must not be an error."""
    result = await client.call_tool(tool, args)
    assert not result.is_error, result.content
    return json.loads(result.content[0].text)


async def error_of(client: Client, tool: str, **args) -> str:
    """A tool error's text, which it must be."""
    result = await client.call_tool(tool, args)
    assert result.is_error, result.content
    return result.content[0].text


@asynccontextmanager
async def ranking(nc, svc):
    store = RankingStore(nc, svc)
    await store.start()
    try:
        yield store
    finally:
        await store.stop()


@on_the_session_loop
async def test_an_agent_proposes_follows_lists_and_signals_and_carries_no_authority(
        daemon, nc, nats_url, svc, tmp_path):
    key = f"k{uuid.uuid4().hex[:8]}"
    async with ranking(nc, svc), Client(stdio(nats_url, svc, tmp_path)) as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
        assert names == {"propose", "show", "list_proposals", "signal"}
        assert not [n for n in names if any(word in n for word in AUTHORITY_WORDS)]

        l0 = await call(client, "propose", proposal=bare(testing.rank_proposal(svc, key=key)))
        assert (l0["class"], l0["gate"], l0["decision"]["verdict"]) == ("L0", "L0", "accept")
        assert "its service applies it" in l0["says"]
        l2 = await call(client, "propose",
                        proposal=bare(testing.skill_proposal(svc, name=f"s{key}")))
        assert (l2["class"], l2["status"]) == ("L2", "pending")
        assert l2["decision"]["cause"] == "awaiting_operator"

        async def applied():
            shown = await call(client, "show", proposal_id=l0["proposal_id"][:12])
            return shown if shown["status"] == "applied" else None

        shown = await eventually(applied, what="the L0 applied")
        assert shown["outcome"]["ok"] is True
        assert shown["origin"] == f"agent:{svc}:{AGENT}"
        waiting = await call(client, "show", proposal_id=l2["proposal_id"][:12])
        assert waiting["status"] == "pending"
        assert waiting["waits_for"] == "an operator's signed approval"
        # the chain's verdict as `improved show` says it: whole, its writers checked or not
        assert not waiting["chain"].startswith("BROKEN") and "verified" in waiting["chain"].lower()

        listed = await call(client, "list_proposals")
        assert {p["proposal_id"] for p in listed["proposals"]} == {l0["proposal_id"],
                                                                    l2["proposal_id"]}
        pending = await call(client, "list_proposals", status="pending")
        assert [p["proposal_id"] for p in pending["proposals"]] == [l2["proposal_id"]]

        said = await call(client, "signal", proposal_id=l2["proposal_id"][:12], kind="check",
                          positive=True)
        assert (said["counted"], said["independent"]) == (True, False)  # its own proposal

        async def counted():
            chain = await daemon.store.read_chain(svc, l2["proposal_id"])
            return [body for _, body in chain if body.get("verdict") == "signal"]

        recorded = await eventually(counted, what="the signal on the chain")
        assert recorded[0]["actor"] == f"agent:{svc}:{AGENT}"

        bad = bare(testing.rank_proposal(svc, key=f"{key}-bad"))
        bad["change_class"] = "L9"
        assert "change_class" in await error_of(client, "propose", proposal=bad)
        assert "proposal.service" in await error_of(
            client, "propose", proposal={**bare(testing.rank_proposal(svc)), "service": "other"})
        assert "proposal" in await error_of(client, "propose", proposal="not an object")
        assert "proposal_id" in await error_of(client, "show", proposal_id="zz")
        assert "positive" in await error_of(client, "signal", proposal_id=l2["proposal_id"],
                                            kind="check")
        again = await call(client, "list_proposals")  # still serving, nothing more made
        assert again["count"] == 2


@on_the_session_loop
async def test_the_classes_and_the_daemons_spec_are_resources(daemon, nats_url, svc, tmp_path):
    async with Client(stdio(nats_url, svc, tmp_path)) as client:
        uris = {str(r.uri) for r in (await client.list_resources()).resources}
        assert uris == {"improved://classes", "improved://spec"}
        classes = json.loads((await client.read_resource("improved://classes")).contents[0].text)
        assert classes["schemes"]["rank"] == {"min_class": "L0", "scope": "knowledge"}
        assert classes["schemes"]["code"]["min_class"] == "L4"
        assert set(DEFAULT_FORBIDDEN) <= set(classes["forbidden_targets"])
        assert classes["classes"]["L2"]["gate"] == "an operator's signed approval"
        spec = json.loads((await client.read_resource("improved://spec")).contents[0].text)
        assert spec["service"] == "improved" and "L4" in spec["classes"]
        with pytest.raises(MCPError, match="no resource improved://nothing"):
            await client.read_resource("improved://nothing")
        assert len((await client.list_tools()).tools) == 4  # and it keeps serving


@on_the_session_loop
async def test_with_its_key_the_agent_is_the_verified_proposer(daemon, nats_url, tmp_path):
    """The session daemon binds AGENT_A's key to agent:signed:a ([trust.signers])."""
    path = tmp_path / "agent.pem"
    path.write_bytes(AGENT_A[1].private_bytes(serialization.Encoding.PEM,
                                              serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
    params = stdio(nats_url, SIGNED, tmp_path, "--key", str(path))
    params.args[params.args.index(AGENT)] = "a"
    proposal = bare(testing.skill_proposal(SIGNED, name="s" + uuid.uuid4().hex[:10]))
    async with Client(params) as client:
        made = await call(client, "propose", proposal=proposal)
        assert made["signed_as"] == AGENT_A[0]
        shown = await call(client, "show", proposal_id=made["proposal_id"])
        assert shown["proposer"] == AGENT_A[0]


@on_the_session_loop
async def test_over_http_on_localhost(daemon, nats_url, svc, tmp_path):
    port = bus.free_port()
    proc = await asyncio.to_thread(
        subprocess.Popen, [*IMPROVED, "mcp", "--nats", nats_url, "--service", svc, "--agent",
                           AGENT, "--http", str(port)], cwd=tmp_path,
        env={**ENV, "XDG_STATE_HOME": str(tmp_path / "state")}, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stderr.readline), 30)
        assert f"at http://127.0.0.1:{port}/mcp" in line, line
        async with Client(f"http://127.0.0.1:{port}/mcp") as client:
            assert len((await client.list_tools()).tools) == 4
            made = await call(client, "propose",
                              proposal=bare(testing.skill_proposal(svc, name="h" + svc[-8:])))
            assert made["decision"]["cause"] == "awaiting_operator"
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)


def test_a_bad_flag_is_one_line_and_serves_nothing(nats_url, tmp_path):
    taken = bus.free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", taken))
        held.listen(1)
        for args, said in ((["--service", "Bad", "--agent", "a"], "--service 'Bad'"),
                           (["--service", "ok", "--agent", "a b"], "--agent 'a b'"),
                           (["--service", "ok", "--agent", "a", "--key", "/none"], "/none"),
                           (["--service", "ok", "--agent", "a", "--http", str(taken)],
                            f"127.0.0.1:{taken}")):
            done = subprocess.run([*IMPROVED, "mcp", "--nats", nats_url, *args], cwd=tmp_path,
                                  env=ENV, capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL)
            assert done.returncode == 2, done.stderr
            assert said in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
            assert done.stdout == ""

