"""The MCP wiring of `improved mcp`: the official `mcp` SDK's low-level Server serving the
tools and resources of `cli.agent_tools`, over stdio or over streamable HTTP on 127.0.0.1.
Imported only when the command runs (`cli.mcp`), so the base install never needs the `agents`
extra. A tool that fails answers a tool error (`isError`) and the server keeps serving."""

from __future__ import annotations

import json
import socket
import sys
from typing import Any

import mcp.types as types
import structlog
from mcp.server import Server, ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

from improved.cli.agent_tools import CLASSES_URI, SPEC_URI, AgentSurface, ToolError, instructions
from improved.cli.agent_tools import tools as tool_specs

log = structlog.get_logger("improved.mcp")

RESOURCE_NOT_FOUND = -32002  # MCP's error code for a resource it does not have
# what a tool does to the mesh, as MCP's hints: only `propose` and `signal` send anything
READ_ONLY = frozenset({"show", "list_proposals"})


def as_text(result: Any) -> str:
    return json.dumps(result, indent=2, sort_keys=True)


def tool_result(result: dict[str, Any]) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=as_text(result))],
                                structured_content=result)


def tool_error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                is_error=True)


def server(surface: AgentSurface) -> Server[Any]:
    """The MCP server of one agent: its four tools and the two resources."""
    agent = surface.agent
    listed = [types.Tool(name=name, description=description, input_schema=schema,
                         annotations=types.ToolAnnotations(
                             read_only_hint=name in READ_ONLY, destructive_hint=False,
                             idempotent_hint=name != "signal"))
              for name, (description, schema) in tool_specs(agent).items()]
    resources = [
        types.Resource(uri=CLASSES_URI, name="classes", mime_type="application/json",
                       description="The change classes L0-L4 (what each means, its gate), "
                                   "each target scheme's minimum class and scope, and the "
                                   "forbidden targets: read before proposing."),
        types.Resource(uri=SPEC_URI, name="spec", mime_type="application/json",
                       description="The daemon's own spec (its answer on improved.spec.get)."),
    ]
    readers = {CLASSES_URI: surface.classes, SPEC_URI: surface.spec}

    async def list_tools(ctx: ServerRequestContext[Any],
                         params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listed)

    async def call_tool(ctx: ServerRequestContext[Any],
                        params: types.CallToolRequestParams) -> types.CallToolResult:
        try:
            return tool_result(await surface.call(params.name, params.arguments))
        except ToolError as exc:
            return tool_error(str(exc))
        except Exception as exc:  # the server keeps serving; the log has the rest
            log.exception("tool failed", tool=params.name)
            return tool_error(f"{params.name} failed: {type(exc).__name__}: {exc}")

    async def list_resources(ctx: ServerRequestContext[Any],
                             params: types.PaginatedRequestParams | None
                             ) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=resources)

    async def read_resource(ctx: ServerRequestContext[Any],
                            params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        reader = readers.get(str(params.uri))
        if reader is None:
            raise MCPError(RESOURCE_NOT_FOUND, f"no resource {params.uri}: the resources are "
                                               f"{', '.join(readers)}")
        try:
            text = as_text(await reader())
        except ToolError as exc:  # said to the agent as the error it is, nothing logged
            raise MCPError(types.INTERNAL_ERROR, str(exc)) from None
        return types.ReadResourceResult(contents=[types.TextResourceContents(
            uri=str(params.uri), mime_type="application/json", text=text)])

    return Server("improved", title=f"improved: {agent.actor}", instructions=instructions(agent),
                  on_list_tools=list_tools, on_call_tool=call_tool,
                  on_list_resources=list_resources, on_read_resource=read_resource)


async def serve_stdio(surface: AgentSurface) -> None:
    """Serve one MCP client on stdin and stdout until it closes them."""
    mcp = server(surface)
    async with stdio_server() as (read, write):
        await mcp.run(read, write, mcp.create_initialization_options())


def bound(port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:`port`; OSError when it cannot be had."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


async def serve_http(surface: AgentSurface, sock: socket.socket) -> None:
    """Serve MCP's streamable HTTP at http://127.0.0.1:<port>/mcp until SIGINT or SIGTERM
    (uvicorn's own handling: it stops taking connections and ends)."""
    import uvicorn

    app = server(surface).streamable_http_app(host="127.0.0.1")
    port = sock.getsockname()[1]
    print(f"improved mcp: serving {surface.agent.actor} at http://127.0.0.1:{port}/mcp",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    await uvicorn.Server(config).serve(sockets=[sock])
