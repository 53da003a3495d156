"""An agent runtime's tool surface on NATS (SPEC 09 §3.1): list the catalog, call a tool,
revoke a session upgrade.

The authority rules are all in `improved.core.tools.Runtime`, carried out by
`improved_reference.tool_gate.ToolGate`; this module carries them over request/reply and keeps
what they need beyond one process on JetStream, so what an agent sees on the bus is exactly what
the library decides:

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
  verifies (`Runtime.learn_acceptance`); an erased one only refuses (the runtime asks for a
  grant again).
- A limit set on a mark stream and set back, or the stream deleted and made again, would
  still erase marks; so before each spend and each look for a revocation the ledger reads the
  stream's info (one request, which for a revocation also says whether its mark is there) and
  `improved.core.retention` decides whether the stream can vouch that it forgot nothing: the
  incarnation this runtime trusts, configured as it must be, and the revocations' stream
  holding every message ever written to it, the spent marks' stream still holding its
  sentinel. If not, the call is refused `ledger_untrusted` and the problem logged at error.
  Which streams the runtime trusts is on its chain: the first time it sees them it appends a
  `ledger` trailer naming each one's creation time (and sentinel), every trailer after names
  them too, and each start compares the streams with what the chain's last trailer (its own,
  signed) names. Only an operator starting the runtime with `accept_ledger` makes it trust
  streams other than those (recorded again).
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

import asyncio
import time
from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

import msgspec
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from msgspec import Meta
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StreamInfo
from nats.js.errors import APIError, BucketNotFoundError, KeyDeletedError, NotFoundError
from nats.js.kv import KeyValue

from improved.client import connection
from improved.client.chain_writer import ChainWriter, decode_trailer
from improved.client.sdk import MAX_MESSAGE_BYTES, Served, serve_spec
from improved.client.streams import (
    SENTINELS,
    StoreError,
    is_conflict,
    seen_of,
    tools_audit_config,
    tools_ledger_configs,
)
from improved.core import audit, evidence, retention, trailers
from improved.core.signing import keyid_of, raw_public
from improved.core.tools import (
    ERROR_LIMIT,
    LEDGER_STREAMS,
    Decision,
    LedgerUntrusted,
    Runtime,
    SessionId,
    SessionProof,
    ToolName,
    call_draft,
    chain_id,
    ledger_draft,
    recorded_ledger,
    spent_ttl_s,
)
from improved.protocol import subjects as S
from improved.protocol import wire
from improved.protocol.model import Envelope, _In, to_json
from improved_reference.skill_bounds import SkillBounds
from improved_reference.skill_definitions import IDENTITY_RE
from improved_reference.tool_gate import ToolGate

log = structlog.get_logger("improved_reference.tool_runtime")
T = TypeVar("T")

MAX_PER_SUBJECT = 10077  # JetStream: "maximum messages per subject exceeded" (discard new)


SkillIdentity = Annotated[str, Meta(pattern=IDENTITY_RE.pattern)]


class ToolCall(_In):
    """The request on `<runtime>.tools.call`."""

    tool: ToolName
    args: dict[str, Any] = {}
    grant: Envelope | None = None
    session: SessionId | None = None
    upgrade: Envelope | None = None
    proof: SessionProof | None = None  # by the upgrade's session key, for this very call
    # the skill this call is made for: only its definition's `allowed_tools` may be called
    skill: SkillIdentity | None = None


class Revoke(_In):
    """The request on `<runtime>.tools.revoke`."""

    revocation: Envelope


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class JetStreamLedger:
    """`improved_reference.tool_gate.Ledger` for the runtime `runtime`: a grant (its act id) or a session
    proof (its digest) is spent by a mark on `IMPROVE_TOOLS_SPENT`
    (`improve.tools.spent.<act>`, with its per-message TTL, `spent_until`), an upgrade revoked
    by one on `IMPROVE_TOOLS_REVOKED` (`improve.tools.revoked.<runtime>.<upgrade act id>`, for
    good): streams that take one message per subject, refuse a second, and allow no delete,
    purge or roll-up, so nobody can erase a mark. L2 acceptances stay in the `improved_tools`
    bucket (an erased one only refuses: the runtime asks for a grant again). A `spent.` or
    `revoked.` key left in the bucket by an earlier version still counts (`_legacy`).

    Before a spend or a look for a revocation it reads the mark stream's info and raises
    LedgerUntrusted when the stream cannot vouch that it forgot nothing since it was trusted as
    `known` (`improved.core.retention.problem`), or when `untrusted` names why it cannot be
    trusted at all (found at start)."""

    def __init__(self, js: JetStreamContext, kv: KeyValue, runtime: str, replicas: int = 1):
        self.js, self.kv, self.runtime = js, kv, runtime
        self.bucket_stream = f"KV_{S.BUCKET_TOOLS}"
        self.wanted = {cfg.name: cfg for cfg in (*tools_ledger_configs(replicas),
                                                 tools_audit_config(replicas))}
        self.known: dict[str, retention.Known] = {}  # the streams it trusts, by name
        self.untrusted: str | None = None
        self._named: set[str] = set()  # the problems already logged at error

    @classmethod
    async def open(cls, js: JetStreamContext, runtime: str,
                   replicas: int = 1) -> JetStreamLedger:
        """The acceptances' bucket, created when missing (by whichever replica comes first),
        and the mark streams as they are now, trusted as first seen (`first_sight`; a runtime
        service then holds them to what its chain names). The mark streams are the caller's to
        ensure (`tools_ledger_configs`); RuntimeError, one line, when the spent marks' stream
        has no sentinel."""
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
        ledger = cls(js, kv, runtime, replicas)
        for stream in (S.STREAM_TOOLS_SPENT, S.STREAM_TOOLS_REVOKED):
            ledger.known[stream] = await ledger.first_sight(stream)
        return ledger

    async def look(self, stream: str, subject: str | None = None) -> retention.Seen:
        """`stream` as its info shows it now (one request; `subject`'s count included)."""
        return (await self._info(stream, subject))[0]

    async def _info(self, stream: str, subject: str | None
                    ) -> tuple[retention.Seen, StreamInfo]:
        info = await self.js.stream_info(stream, subjects_filter=subject)
        return seen_of(info, self.wanted[stream]), info

    async def sentinel(self, stream: str) -> int:
        """The sequence of `stream`'s sentinel; RuntimeError, one line, when it has none (made
        by an earlier version) or what is on the sentinel's subject carries a TTL (it is not
        one: it would leave)."""
        subject = SENTINELS[stream]
        try:
            msg = await self.js.get_last_msg(stream, subject)
        except NotFoundError:
            raise RuntimeError(f"tool runtime {self.runtime}: stream {stream} has no sentinel "
                               "(it was made by an earlier version, or its maker stopped "
                               "before writing it): run `improved provision` once, which "
                               "writes it") from None
        if (msg.headers or {}).get("Nats-TTL"):
            raise RuntimeError(f"tool runtime {self.runtime}: what is on {subject} carries a "
                               "TTL, so it is no sentinel; once it has expired, run `improved "
                               "provision`, which writes the sentinel")
        return msg.seq or 0

    async def first_sight(self, stream: str) -> retention.Known:
        """What to trust of `stream` seen now for the first time."""
        kind = LEDGER_STREAMS[stream][1]
        sentinel = await self.sentinel(stream) if stream in SENTINELS else None
        return retention.first_sight(kind, await self.look(stream), sentinel)

    async def accepted(self, stream: str) -> retention.Known:
        """What to trust of `stream` when an operator accepts it as it is now."""
        kind = LEDGER_STREAMS[stream][1]
        sentinel = await self.sentinel(stream) if stream in SENTINELS else None
        return retention.accepted(kind, await self.look(stream), sentinel)

    async def vouch(self, stream: str, subject: str | None = None) -> StreamInfo:
        """The stream's info (`subject`'s count in it) when the stream can vouch that it forgot
        nothing; else LedgerUntrusted, the problem logged at error (once per problem)."""
        seen, info = await self._info(stream, subject)
        problem = self.untrusted or retention.problem(self.known[stream], seen)
        if problem is not None:
            if problem not in self._named:
                self._named.add(problem)
                log.error("tool ledger untrusted: calls that rely on it are refused",
                          runtime=self.runtime, stream=stream, problem=problem)
            raise LedgerUntrusted(problem)
        return info

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
        _, legacy = await self._checked(self.vouch(S.STREAM_TOOLS_SPENT),
                                        self._legacy(f"spent.{act}"))
        if legacy:
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
        """Read from the stream's leader with the check itself: the info of the revocations'
        stream, filtered on this revocation's subject, counts its mark."""
        subject = S.tools_revoked(self.runtime, upgrade)
        info, legacy = await self._checked(self.vouch(S.STREAM_TOOLS_REVOKED, subject),
                                           self._legacy(f"revoked.{upgrade}"))
        return bool((info.state.subjects or {}).get(subject)) or legacy

    @staticmethod
    async def _checked(check: Awaitable[T], read: Awaitable[bool]) -> tuple[T, bool]:
        """`check`'s and `read`'s answers, both asked at once (one round trip); `check`'s
        exception (LedgerUntrusted, say) raised first, then `read`'s."""
        checked, answer = await asyncio.gather(check, read, return_exceptions=True)
        if isinstance(checked, BaseException):
            raise checked
        if isinstance(answer, BaseException):
            raise answer
        return checked, bool(answer)

    async def revoke(self, upgrade: str, revocation: Envelope) -> None:
        await self._first(S.STREAM_TOOLS_REVOKED, S.tools_revoked(self.runtime, upgrade),
                          msgspec.to_builtins(revocation))


class ToolRuntimeService:
    """Serves one Runtime's catalog and calls over a nats-py Client; `key` signs the trailers
    of the runtime's `_tools` chain. `start` puts the runtime's ledger (`gate.ledger`) on
    JetStream. With `skills` (a skills store's service), a call made for a skill is bound to
    that skill's `allowed_tools` (`skill_bounds`); without it, such a call is refused."""

    def __init__(self, nc: Client, runtime: Runtime, key: Ed25519PrivateKey, *,
                 replicas: int = 1, accept_ledger: bool = False, skills: str | None = None):
        self.nc = nc
        self.skills = SkillBounds(nc.jetstream(), skills) if skills is not None else None
        self.runtime = runtime
        self.gate = ToolGate(runtime)
        # its chain on the tool runtimes' audit stream, signed with its key; the mark streams
        self.chains = ChainWriter(nc, audit_stream=S.STREAM_TOOLS_AUDIT, signer=key)
        self.keyid = keyid_of(raw_public(key.public_key()))
        self.replicas = replicas
        self.chain = chain_id(runtime.name)
        # an operator's word that the mark streams, as they are now, are the ones to trust
        # (after one was made again, say): recorded on the chain at start
        self.accept_ledger = accept_ledger
        self.ledger: JetStreamLedger | None = None
        self._subs: list[Served] = []

    def capabilities(self) -> dict[str, Any]:
        rt = self.runtime
        return {"service": rt.name, "improve": False, "tools": True, "ceiling": rt.ceiling,
                "mode": rt.mode}

    async def listing(self) -> dict[str, Any]:
        rt = self.runtime
        await self.gate.refresh()
        return {"runtime": rt.name, "ceiling": rt.ceiling, "mode": rt.mode,
                "tools": rt.catalog()}

    async def start(self) -> None:
        """Open the ledger and subscribe; RuntimeError, naming what is missing, when there is
        no audit stream to record calls on (the runtime does not make it: its durability is
        the provisioning step's to set), or when the mark streams are missing or differ and
        this user may not make them (`improved provision` does)."""
        name = self.runtime.name
        try:
            await self.chains.js.stream_info(S.STREAM_TOOLS_AUDIT)
        except NotFoundError:
            raise RuntimeError(f"tool runtime {name}: the audit stream {S.STREAM_TOOLS_AUDIT} "
                               "does not exist, so no call could be recorded; run `improved "
                               "provision` (or start a daemon without accounts) first") from None
        for cfg in tools_ledger_configs(self.replicas):
            try:
                for change in await self.chains.ensure_stream(cfg):
                    log.info(change, runtime=name)
            except StoreError as exc:
                raise RuntimeError(f"tool runtime {name}: {exc}") from None
        self.ledger = await JetStreamLedger.open(self.chains.js, name, self.replicas)
        await self._settle_ledger(self.ledger)
        self.gate.ledger = self.ledger
        for subject, cb in ((S.tools_list(name), self._on_list),
                            (S.tools_call(name), self._on_call),
                            (S.tools_revoke(name), self._on_revoke)):
            self._subs.append(await self.nc.subscribe(subject, queue=name, cb=cb))
        self._subs.append(await serve_spec(self.nc, name, self.capabilities()))
        log.info("tool runtime ready", runtime=name, mode=self.runtime.mode,
                 ceiling=self.runtime.ceiling, tools=len(self.runtime.catalog()))

    async def _settle_ledger(self, ledger: JetStreamLedger) -> None:
        """Hold the ledger to the streams the chain's last trailer names (signed by this
        runtime's key); trust what is there now where it names none (first seen), or wherever
        an operator accepts it (`accept_ledger`), and record that on the chain. What cannot be
        vouched for is logged at error: the calls that rely on it are refused."""
        name, subject = self.runtime.name, S.tools_audit(self.chain)
        _, head = await self.chains.chain_head(subject)
        recorded, foreign = self._recorded(head)
        trusted: dict[str, retention.Known] = {}
        for stream in LEDGER_STREAMS:
            if self.accept_ledger:
                trusted[stream] = await ledger.accepted(stream)
            else:  # else first seen now (the mark streams: when the ledger opened)
                trusted[stream] = recorded.get(stream) or ledger.known.get(stream) or \
                    await ledger.first_sight(stream)
        ledger.known = trusted
        if foreign is not None and not self.accept_ledger:
            ledger.untrusted = (f"the last trailer of this runtime's chain is not its own "
                                f"({foreign}), so it cannot say which mark streams the "
                                "runtime trusted")
        else:
            audit_problem = retention.problem(trusted[S.STREAM_TOOLS_AUDIT],
                                              await ledger.look(S.STREAM_TOOLS_AUDIT))
            if audit_problem is not None:
                ledger.untrusted = (f"{audit_problem}; the runtime reads there which mark "
                                    "streams it trusts")
        for stream, known in trusted.items():
            problem = ledger.untrusted if stream == S.STREAM_TOOLS_AUDIT else \
                retention.problem(known, await ledger.look(stream))
            if problem is not None:
                log.error("tool ledger untrusted at start: calls that rely on it are refused "
                          "(an operator who has checked may start the runtime with "
                          "accept_ledger)", runtime=name, stream=stream, problem=problem)
        if trusted != recorded and (foreign is None or self.accept_ledger):
            why = ("accepted by an operator as they are now" if self.accept_ledger else
                   "seen for the first time" if not recorded else
                   "seen for the first time: " + ", ".join(s for s in trusted
                                                           if s not in recorded))
            await self._record_ledger(trusted, why)

    def _recorded(self, head: dict[str, Any] | None
                  ) -> tuple[dict[str, retention.Known], str | None]:
        """The streams the chain's last trailer names, and why it is not believed (it is not
        this runtime's own: its hash or signature), or None."""
        if head is None:
            return {}, None
        problem = (None if audit.trailer_hash(head) == head.get("hash")
                   else "its hash is not that of its content")
        problem = problem or evidence.writer_problem(head, frozenset({self.keyid}), "runtime")
        if problem is not None:
            return {}, problem
        try:
            data = trailers.decode(decode_trailer(head))
        except (msgspec.MsgspecError, trailers.TrailerDataError) as exc:
            return {}, f"not a trailer: {exc}"
        if not isinstance(data, trailers.ToolCall | trailers.ToolRefused
                          | trailers.LedgerTrusted):
            return {}, f"not a trailer of a tool runtime's chain ({type(data).__name__})"
        return recorded_ledger(data), None

    async def _record_ledger(self, trusted: dict[str, retention.Known], why: str) -> None:
        """Append the `ledger` trailer, unless the chain's last trailer (another replica's,
        written meanwhile) already names the same streams."""
        name = self.runtime.name

        def draft(chain: list[tuple[int, dict[str, Any]]], now: int) -> Any:
            if chain and self._recorded(chain[-1][1]) == (trusted, None):
                return None
            return ledger_draft(name, trusted, why)

        try:
            await self.chains.append_sealed(S.tools_audit(self.chain), self.chain, "L0",
                                           "operation", draft, clock=now_ms)
        except Exception as exc:
            raise RuntimeError(f"tool runtime {name}: could not record on its chain the mark "
                               f"streams it trusts ({type(exc).__name__}: {exc})") from None
        log.info("tool ledger recorded", runtime=name, why=why,
                 streams={s: k.ref() for s, k in trusted.items()})

    async def stop(self) -> None:
        """Stop taking requests, finishing the ones in hand."""
        subs, self._subs = self._subs, []
        await connection.drain_all(subs)

    async def answer(self, data: bytes) -> bytes:
        """One call request's bytes → the reply's bytes (no exceptions escape)."""
        try:
            call = wire.decode(data, ToolCall, MAX_MESSAGE_BYTES)
        except wire.WireError as err:
            log.info("tool call refused: bad request", runtime=self.runtime.name,
                     code=err.code, field=err.field)
            return err.reply()
        try:
            decision = await self._skill_bound(call) or await self.gate.decide(
                call.tool, call.args, call.grant, now_ms(), session=call.session,
                upgrade=call.upgrade, proof=call.proof)
            recorded = await self._record(decision)
            if decision.allowed and not recorded:
                reply: dict[str, Any] = {"refused": {
                    "reason": "unaudited", "required": decision.provider.authority
                    if decision.provider else "L0",
                    "detail": "the call could not be recorded on the runtime's audit chain, "
                              "so it did not run"}}
            else:
                reply = await self.gate.run(decision)
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

    async def _skill_bound(self, call: ToolCall) -> Decision | None:
        """The refusal of a call made for a skill whose `allowed_tools` do not include its
        tool (or cannot be read), before the gate: nothing is spent. None: on to the gate."""
        if call.skill is None:
            return None
        allowed = await self.skills.allowed(call.skill) if self.skills is not None else \
            "this runtime reads no skills store"
        return self.runtime.bound(call.tool, call.args, call.skill, allowed,
                                  session=call.session)

    async def _record(self, decision: Decision) -> bool:
        """Append the decision to the runtime's `_tools` chain; False when it could not be."""
        draft = call_draft(self.runtime.name, decision,
                           self.ledger.known if self.ledger is not None else None)
        if draft is None or decision.provider is None:
            return True
        try:
            await self.chains.append_sealed(S.tools_audit(self.chain), self.chain,
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
            reply = await self.gate.revoke(request.revocation)
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
