"""An agent runtime's tool surface on NATS (SPEC 09 §3.1): list the catalog, call a tool.

The authority rules are all in `improved.core.tools.Runtime`; this module only carries them over
request/reply, so what an agent sees on the bus is exactly what the library decides:
`<runtime>.tools.list` answers the whole catalog (gated tools included, with their grant
tokens) and `<runtime>.tools.call` answers one invocation, a refusal or the error reply of
DESIGN §3.1. Instances of one runtime share a queue group named after it. Every message gets a
reply and none can stop the subscription: bad input, a tool that raises, a result that is not
JSON all become answers. Arguments are never logged (they may carry anything).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from improved.client.sdk import MAX_MESSAGE_BYTES, Served, serve_spec
from improved.core.tools import ERROR_LIMIT, Runtime, ToolName
from improved.protocol import subjects as S
from improved.protocol import wire
from improved.protocol.model import Envelope, _In, to_json

log = structlog.get_logger("improved_reference.tool_runtime")


class ToolCall(_In):
    """The request on `<runtime>.tools.call`."""

    tool: ToolName
    args: dict[str, Any] = {}
    grant: Envelope | None = None


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class ToolRuntimeService:
    """Serves one Runtime's catalog and calls over a nats-py Client."""

    def __init__(self, nc: Client, runtime: Runtime):
        self.nc = nc
        self.runtime = runtime
        self._subs: list[Served] = []

    def capabilities(self) -> dict[str, Any]:
        rt = self.runtime
        return {"service": rt.name, "improve": False, "tools": True, "ceiling": rt.ceiling,
                "mode": rt.mode}

    def listing(self) -> dict[str, Any]:
        rt = self.runtime
        return {"runtime": rt.name, "ceiling": rt.ceiling, "mode": rt.mode,
                "tools": rt.catalog()}

    async def start(self) -> None:
        name = self.runtime.name
        self._subs.append(await self.nc.subscribe(S.tools_list(name), queue=name,
                                                  cb=self._on_list))
        self._subs.append(await self.nc.subscribe(S.tools_call(name), queue=name,
                                                  cb=self._on_call))
        self._subs.append(await serve_spec(self.nc, name, self.capabilities()))
        log.info("tool runtime ready", runtime=name, mode=self.runtime.mode,
                 ceiling=self.runtime.ceiling, tools=len(self.runtime.catalog()))

    async def stop(self) -> None:
        """Stop taking requests, finishing the ones in hand."""
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.drain()
            except Exception as exc:  # already closed with the connection
                log.debug("subscription drain failed", error=str(exc))

    async def answer(self, data: bytes) -> bytes:
        """One call request's bytes → the reply's bytes (no exceptions escape)."""
        try:
            call = wire.decode(data, ToolCall, MAX_MESSAGE_BYTES)
        except wire.WireError as err:
            log.info("tool call refused: bad request", runtime=self.runtime.name,
                     code=err.code, field=err.field)
            return err.reply()
        try:
            reply = await self.runtime.invoke(call.tool, call.args, call.grant, now_ms())
        except Exception as exc:
            log.exception("tool call failed", runtime=self.runtime.name, tool=call.tool)
            return wire.WireError(wire.INTERNAL, f"{type(exc).__name__}: {exc}"[:ERROR_LIMIT]
                                  ).reply()
        self._log(call.tool, reply)
        try:
            return to_json(reply)
        except (TypeError, msgspec.EncodeError) as exc:
            reply = {k: v for k, v in reply.items() if k != "result"}
            reply.update(ok=False, error=f"TypeError: the tool's result is not JSON: "
                         f"{exc}"[:ERROR_LIMIT])
            return to_json(reply)

    def _log(self, tool: str, reply: dict[str, Any]) -> None:
        fields = {"runtime": self.runtime.name, "tool": tool}
        if "refused" in reply:
            log.info("tool call refused", **fields, **reply["refused"])
        elif "error" in reply and "ok" not in reply:
            log.info("tool call refused", **fields, code=reply["error"]["code"])
        else:
            log.info("tool called", **fields, ok=reply["ok"], granted_by=reply.get("granted_by"),
                     error=reply.get("error"))

    async def _on_call(self, msg: Msg) -> None:
        await self._respond(msg, await self.answer(msg.data))

    async def _on_list(self, msg: Msg) -> None:
        try:
            body = to_json(self.listing())
        except Exception as exc:
            log.exception("tool catalog failed", runtime=self.runtime.name)
            body = wire.WireError(wire.INTERNAL, f"{type(exc).__name__}: {exc}").reply()
        await self._respond(msg, body)

    async def _respond(self, msg: Msg, body: bytes) -> None:
        if not msg.reply:
            return
        try:
            await msg.respond(body)
        except Exception as exc:
            log.warning("could not reply", runtime=self.runtime.name, subject=msg.subject,
                        error=str(exc))
