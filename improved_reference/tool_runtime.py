"""An agent runtime's tool surface on NATS (SPEC 09 §3.1): list the catalog, call a tool,
revoke a session upgrade.

The authority rules are all in `improved.core.tools.Runtime`; this module carries them over
request/reply and keeps what they need beyond one process on JetStream, so what an agent sees on
the bus is exactly what the library decides:

- `<runtime>.tools.list` answers the whole catalog (gated tools included, with their grant
  tokens and scopes); `<runtime>.tools.call` answers one invocation, a refusal or the error
  reply of DESIGN §3.1; `<runtime>.tools.revoke` takes an operator's signed revocation of a
  session upgrade. Instances of one runtime share a queue group named after it.
- Spent grants and session proofs and revoked upgrades are marks on two streams of their own,
  `IMPROVE_TOOLS_SPENT` and `IMPROVE_TOOLS_REVOKED` (`JetStreamLedger`), shared by every
  replica and kept across restarts; L2 acceptances live in the `improved_tools` bucket. A
  call under a session upgrade carries a proof signed by the session's key (`proof`), spent
  like a grant, so an upgrade read off the chain calls nothing. A grant or a proof is spent by
  a publish that the server refuses when its subject holds a mark, so the first replica wins.
  The streams take one message per subject, refuse a second, and allow no delete, purge or
  roll-up: nobody can erase a mark (as a roll-up purge with a short TTL erased a KV key). A
  spent mark carries a per-message TTL (`Nats-TTL`, from `spent_until`: the act's lapse plus
  the replicas' clock skew), so the server removes it once its act is refused by its own time
  check anyway; a revocation carries none (its stream refuses TTLs). A forged mark can refuse
  a call, never allow one. An acceptance read back counts only when the signed grant it holds
  verifies (`Runtime`); an erased one only refuses (the runtime asks for a grant again).
- Every call's decision is a trailer of the runtime's chain
  `improve.tools.audit.<sha256("improved tools <runtime>")>` on the tool runtimes' audit
  stream `IMPROVE_TOOLS_AUDIT`, appended with the expected last sequence and signed with the
  runtime's key (which verifiers trust for that runtime's chain alone, `[trust.runtimes]`),
  before the tool runs: a call whose decision cannot be recorded does not run (the grant it
  spent stays spent).

Why a stream of its own, not the daemon's `IMPROVE_AUDIT`: every trailer in the daemon's log
must be signed by a trusted daemon key, or the daemon's next checkpoint opens a crisis and
applies stop mesh-wide. A runtime writing there would have to hold a key every daemon trusts
as one of its own (so it could also write any daemon trailer), and a runtime whose key one
daemon lacks, or anyone allowed to write its subjects, could halt the loop. Kept apart, the
daemon's log has daemons as its only writers, its checkpoints cover only what daemons
decide, and a tool trailer is never an input to a loop decision; a runtime's chain that does
not verify is that chain's problem, named by `improved audit verify` (the alternative, the
chains staying in the daemon's log with the checkpoint told to excuse them, would have kept
untrusted writers inside the log every checkpoint signs).

Every message gets a reply and none can stop the subscription: bad input, a tool that raises,
a result that is not JSON all become answers. Arguments are never logged nor recorded (only
their digest is, on the chain).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import APIError, BucketNotFoundError, KeyDeletedError, NotFoundError
from nats.js.kv import KeyValue

from improved.client.sdk import MAX_MESSAGE_BYTES, Served, serve_spec
from improved.core.tools import (
    ERROR_LIMIT,
    Decision,
    Runtime,
    SessionId,
    SessionProof,
    ToolName,
    call_draft,
    chain_id,
    spent_ttl_s,
)
from improved.protocol import subjects as S
from improved.protocol import wire
from improved.protocol.model import Envelope, _In, to_json
from improved.runtime.store import Store, StoreError, is_conflict, tools_ledger_configs

log = structlog.get_logger("improved_reference.tool_runtime")

MAX_PER_SUBJECT = 10077  # JetStream: "maximum messages per subject exceeded" (discard new)


class ToolCall(_In):
    """The request on `<runtime>.tools.call`."""

    tool: ToolName
    args: dict[str, Any] = {}
    grant: Envelope | None = None
    session: SessionId | None = None
    upgrade: Envelope | None = None
    proof: SessionProof | None = None  # by the upgrade's session key, for this very call


class Revoke(_In):
    """The request on `<runtime>.tools.revoke`."""

    revocation: Envelope


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class JetStreamLedger:
    """`improved.core.tools.Ledger` for the runtime `runtime`: a grant (its act id) or a session
    proof (its digest) is spent by a mark on `IMPROVE_TOOLS_SPENT`
    (`improve.tools.spent.<act>`, with its per-message TTL, `spent_until`), an upgrade revoked
    by one on `IMPROVE_TOOLS_REVOKED` (`improve.tools.revoked.<runtime>.<upgrade act id>`, for
    good): streams that take one message per subject, refuse a second, and allow no delete,
    purge or roll-up, so nobody can erase a mark. L2 acceptances stay in the `improved_tools`
    bucket (an erased one only refuses: the runtime asks for a grant again). A `spent.` or
    `revoked.` key left in the bucket by an earlier version still counts (`_legacy`)."""

    def __init__(self, js: JetStreamContext, kv: KeyValue, runtime: str):
        self.js, self.kv, self.runtime = js, kv, runtime
        self.bucket_stream = f"KV_{S.BUCKET_TOOLS}"

    @classmethod
    async def open(cls, js: JetStreamContext, runtime: str,
                   replicas: int = 1) -> JetStreamLedger:
        """The acceptances' bucket, created when missing (by whichever replica comes first).
        The mark streams are the caller's to ensure (`tools_ledger_configs`)."""
        try:
            kv = await js.key_value(S.BUCKET_TOOLS)
        except BucketNotFoundError:
            try:
                kv = await js.create_key_value(
                    bucket=S.BUCKET_TOOLS, history=1, replicas=replicas,
                    description="improved: the tool runtimes' L2 acceptances")
            except APIError as exc:
                if exc.err_code != 10058:  # another replica created it meanwhile
                    raise
                kv = await js.key_value(S.BUCKET_TOOLS)
        return cls(js, kv, runtime)

    async def _first(self, stream: str, subject: str, value: dict[str, Any],
                     ttl_s: int | None = None) -> bool:
        """Write the mark `subject` only if none is there (with the TTL `ttl_s`, seconds, when
        given); False when one is: the server refuses a second message on a subject."""
        try:
            await self.js.publish(subject, to_json(value), stream=stream,
                                  headers={"Nats-Expected-Last-Subject-Sequence": "0"},
                                  msg_ttl=ttl_s)
        except APIError as exc:
            if is_conflict(exc) or exc.err_code == MAX_PER_SUBJECT:
                return False
            raise
        return True

    async def _held(self, stream: str, subject: str) -> bool:
        """Whether a message is on `subject` (read from the stream's leader)."""
        try:
            await self.js.get_last_msg(stream, subject)
        except NotFoundError:
            return False
        return True

    async def _legacy(self, key: str) -> bool:
        """Whether the bucket's `key` holds anything (a value, a delete marker, a purge): a
        spent or revoked key an earlier version wrote there."""
        return await self._held(self.bucket_stream, f"$KV.{S.BUCKET_TOOLS}.{key}")

    async def spend(self, act: str, until: int, now: int) -> bool:
        if await self._legacy(f"spent.{act}"):
            return False
        return await self._first(S.STREAM_TOOLS_SPENT, S.tools_spent(act),
                                 {"at": now, "until": until}, spent_ttl_s(until, now))

    async def acceptance(self, runtime: str, token: str) -> Envelope | None:
        try:
            entry = await self.kv.get(f"accepted.{runtime}.{token.removeprefix('gt:')}")
            return msgspec.json.decode(entry.value or b"", type=Envelope)
        except (NotFoundError, KeyDeletedError, msgspec.MsgspecError):
            return None

    async def accept(self, runtime: str, token: str, grant: Envelope) -> None:
        await self.kv.put(f"accepted.{runtime}.{token.removeprefix('gt:')}", to_json(grant))

    async def revoked(self, upgrade: str) -> bool:
        return (await self._held(S.STREAM_TOOLS_REVOKED, S.tools_revoked(self.runtime, upgrade))
                or await self._legacy(f"revoked.{upgrade}"))

    async def revoke(self, upgrade: str, revocation: Envelope) -> None:
        await self._first(S.STREAM_TOOLS_REVOKED, S.tools_revoked(self.runtime, upgrade),
                          msgspec.to_builtins(revocation))


class ToolRuntimeService:
    """Serves one Runtime's catalog and calls over a nats-py Client; `key` signs the trailers
    of the runtime's `_tools` chain. `start` puts the runtime's ledger on JetStream."""

    def __init__(self, nc: Client, runtime: Runtime, key: Ed25519PrivateKey, *,
                 replicas: int = 1):
        self.nc = nc
        self.runtime = runtime
        self.store = Store(nc, replicas, audit_stream=S.STREAM_TOOLS_AUDIT)
        self.store.signer = key
        self.replicas = replicas
        self.chain = chain_id(runtime.name)
        self._subs: list[Served] = []

    def capabilities(self) -> dict[str, Any]:
        rt = self.runtime
        return {"service": rt.name, "improve": False, "tools": True, "ceiling": rt.ceiling,
                "mode": rt.mode}

    async def listing(self) -> dict[str, Any]:
        rt = self.runtime
        await rt.refresh()
        return {"runtime": rt.name, "ceiling": rt.ceiling, "mode": rt.mode,
                "tools": rt.catalog()}

    async def start(self) -> None:
        """Open the ledger and subscribe; RuntimeError, naming what is missing, when there is
        no audit stream to record calls on (the runtime does not make it: its durability is
        the provisioning step's to set), or when the mark streams are missing or differ and
        this user may not make them (`improved provision` does)."""
        name = self.runtime.name
        try:
            await self.store.js.stream_info(S.STREAM_TOOLS_AUDIT)
        except NotFoundError:
            raise RuntimeError(f"tool runtime {name}: the audit stream {S.STREAM_TOOLS_AUDIT} "
                               "does not exist, so no call could be recorded; run `improved "
                               "provision` (or start a daemon without accounts) first") from None
        for cfg in tools_ledger_configs(self.replicas):
            try:
                for change in await self.store.ensure_stream(cfg):
                    log.info(change, runtime=name)
            except StoreError as exc:
                raise RuntimeError(f"tool runtime {name}: {exc}") from None
        self.runtime.ledger = await JetStreamLedger.open(self.store.js, name, self.replicas)
        for subject, cb in ((S.tools_list(name), self._on_list),
                            (S.tools_call(name), self._on_call),
                            (S.tools_revoke(name), self._on_revoke)):
            self._subs.append(await self.nc.subscribe(subject, queue=name, cb=cb))
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
            decision = await self.runtime.decide(call.tool, call.args, call.grant, now_ms(),
                                                 session=call.session, upgrade=call.upgrade,
                                                 proof=call.proof)
            recorded = await self._record(decision)
            if decision.allowed and not recorded:
                reply: dict[str, Any] = {"refused": {
                    "reason": "unaudited", "required": decision.provider.authority
                    if decision.provider else "L0",
                    "detail": "the call could not be recorded on the runtime's audit chain, "
                              "so it did not run"}}
            else:
                reply = await self.runtime.run(decision)
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

    async def _record(self, decision: Decision) -> bool:
        """Append the decision to the runtime's `_tools` chain; False when it could not be."""
        draft = call_draft(self.runtime.name, decision)
        if draft is None or decision.provider is None:
            return True
        try:
            await self.store.append_sealed(S.tools_audit(self.chain), self.chain,
                                           decision.provider.authority, "operation",
                                           lambda chain, now: draft, clock=now_ms)
        except Exception as exc:
            log.error("tool call not recorded on the audit chain", runtime=self.runtime.name,
                      tool=decision.tool, error=f"{type(exc).__name__}: {exc}")
            return False
        return True

    def _log(self, tool: str, reply: dict[str, Any]) -> None:
        fields = {"runtime": self.runtime.name, "tool": tool}
        if "refused" in reply:
            log.info("tool call refused", **fields, **reply["refused"])
        elif "error" in reply and "ok" not in reply:
            log.info("tool call refused", **fields, code=reply["error"]["code"])
        else:
            log.info("tool called", **fields, ok=reply["ok"], granted_by=reply.get("granted_by"),
                     upgrade=reply.get("upgrade"), error=reply.get("error"))

    async def _on_call(self, msg: Msg) -> None:
        await self._respond(msg, await self.answer(msg.data))

    async def _on_list(self, msg: Msg) -> None:
        try:
            body = to_json(await self.listing())
        except Exception as exc:
            log.exception("tool catalog failed", runtime=self.runtime.name)
            body = wire.WireError(wire.INTERNAL, f"{type(exc).__name__}: {exc}").reply()
        await self._respond(msg, body)

    async def _on_revoke(self, msg: Msg) -> None:
        try:
            request = wire.decode(msg.data, Revoke, MAX_MESSAGE_BYTES)
            reply = await self.runtime.revoke(request.revocation)
            body = to_json(reply)
            log.info("upgrade revocation", runtime=self.runtime.name,
                     revoked=reply.get("revoked"), refused=reply.get("refused"))
        except wire.WireError as err:
            body = err.reply()
        except Exception as exc:
            log.exception("upgrade revocation failed", runtime=self.runtime.name)
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
