"""`improved mcp`: an MCP server that lets an AI agent use the loop as one agent of one
service, and never carry authority (`cli.agent_tools` says what it may do, `cli.mcp_server`
serves it). The MCP SDK is the `agents` extra, imported only when the command runs."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from improved.cli.common import (
    add_connection_args,
    config_of,
    connected,
    load_signing_key,
    url_of,
)
from improved.cli.errors import AGENTS_MODULES, USAGE, Failure, extra_note
from improved.client import connection
from improved.protocol import subjects as S


def cmd_mcp(args: argparse.Namespace) -> int:
    # here, not at the top: without the agents extra this is the one line that says so
    from improved.cli import mcp_server
    from improved.cli.agent_tools import AGENT_NAME_RE, Agent, AgentSurface

    if not S.SERVICE_RE.match(args.service):
        raise Failure(f"--service {args.service!r} is not a service name: lowercase letters, "
                      "digits, _ and -, first a letter", USAGE)
    if not AGENT_NAME_RE.match(args.agent):
        raise Failure(f"--agent {args.agent!r} is not an agent name: 1 to 128 letters, digits "
                      "and . _ @ + -", USAGE)
    key = load_signing_key(Path(args.key)) if args.key else None
    agent = Agent(args.service, args.agent, key)
    args.as_user = f"svc-{args.service}"  # under accounts, the service's own user
    config = config_of(args)
    url = url_of(args, config)

    sock = None
    if args.http is not None:
        try:
            sock = mcp_server.bound(args.http)
        except OSError as exc:
            raise Failure(f"cannot listen on 127.0.0.1:{args.http}: {exc.strerror or exc}; "
                          "give --http a free port", USAGE) from None

    async def main() -> int:
        async with connected(url):  # nothing reachable: one line now, before serving
            pass
        nc = await connection.connect(url, f"improved-mcp-{agent.service}")
        try:
            surface = AgentSurface(nc, agent, config, timeout=args.timeout)
            if sock is None:
                await mcp_server.serve_stdio(surface)
            else:
                await mcp_server.serve_http(surface, sock)
        finally:
            await connection.close(nc)
        return 0

    try:
        return asyncio.run(main())
    finally:
        if sock is not None:
            sock.close()


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `improved mcp` to the `improved` parser."""
    p = sub.add_parser(
        "mcp", help="an MCP server: an AI agent proposes and follows as one agent of a service",
        description="Serve the Model Context Protocol to an AI agent (over stdio, or with "
                    "--http over streamable HTTP on 127.0.0.1): it acts as agent:SVC:NAME of "
                    "one service and carries no authority. Tools: propose (service, origin and "
                    "created_at filled in; the answer is the id, class, gate and the triage "
                    "decision in words), show (by id or unique prefix), list_proposals (this "
                    "agent's), signal (learn-back evidence). Resources: improved://classes "
                    "(what L0-L4 mean, each scheme's minimum class and scope, the forbidden "
                    "targets) and improved://spec (the daemon's spec.get answer). No tool "
                    "approves, rejects, grants, revokes, votes or resolves a crisis. Bad input "
                    "is a tool error naming the field; the server keeps serving.",
        epilog=extra_note("mcp", "agents", AGENTS_MODULES))
    add_connection_args(p)
    p.add_argument("--service", required=True, metavar="SVC",
                   help="the service the agent belongs to: every proposal is for it")
    p.add_argument("--agent", required=True, metavar="NAME",
                   help="the agent's name: it proposes and signals as agent:SVC:NAME")
    p.add_argument("--key", metavar="FILE",
                   help="sign proposals and signals with this private key (`improved keys new "
                        "--signer agent:SVC:NAME`, bound in the daemon's [trust.signers]): "
                        "they are then the agent's verified identity (default: unsigned)")
    p.add_argument("--http", type="port", metavar="PORT",
                   help="serve streamable HTTP at http://127.0.0.1:PORT/mcp instead of stdio")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for the daemon's answer to a tool (10)")
    p.set_defaults(func=cmd_mcp)
