"""A stream brought to the configuration it must have, and what a stream's info says of what it
keeps: how the daemon's store makes the loop's streams and a tool runtime its mark streams
(`Streams.ensure_stream`), and how either tells a stream that can vouch it forgot nothing
(`seen_of`, read by `improved.core.retention`).

A stream is looked at before anything is changed: under deploy/accounts.conf only the
provisioning user (`improved provision`) may create or change most of them, so a provisioned
deployment starts without a single create or update, and a change this user may not make is
NeedsProvision. A stream that forgets by its messages' own TTLs yet must not lose one early
gets its sentinel written first when it is made (SENTINELS).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import structlog
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import (
    APIError,
    KeyWrongLastSequenceError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from improved.core import retention
from improved.protocol import subjects as S
from improved.protocol.model import Sentinel, to_json

log = structlog.get_logger("improved.store")
T = TypeVar("T")

# The answers JetStream gives a publish whose expected last sequence (of the stream or of the
# subject: a chain append, a KV create or update) no longer holds: someone wrote first. A single
# server answers 10071 ("wrong last sequence: N"); a clustered stream also answers 10164 ("wrong
# last sequence", no number) to a write that finds another write to the same subject still in
# flight (nats-server's jetstream_batching.go checkMsgHeadersPreClusteredProposal). Both are a
# conflict: re-read and decide again. Every conflict check uses this one set.
CONFLICT_CODES = frozenset({
    10071,  # JSStreamWrongLastSequenceErrF
    10164,  # JSStreamWrongLastSequenceConstantErr
})


def is_conflict(exc: BaseException) -> bool:
    """A JetStream answer that someone wrote first (CONFLICT_CODES), as nats-py raises it."""
    return isinstance(exc, KeyWrongLastSequenceError) or (
        isinstance(exc, APIError) and exc.err_code in CONFLICT_CODES)


# A look at the deployment's shape (stream info, a bucket's binding) that gets no answer, or a
# 503, is tried again this often, waiting a little longer each time: a cluster that has just
# restarted answers nothing while it elects its stream leaders (about 10 s on three nodes).
LOOK_ATTEMPTS = 6
LOOK_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 5.0)


async def _patiently(what: str, call: Callable[[], Awaitable[T]],
                     silent: tuple[type[BaseException], ...]) -> T:
    """`call()`, tried LOOK_ATTEMPTS times in all with a log line and a growing wait between,
    while JetStream answers 503 (not ready) or one of `silent` (no answer); the last such
    exception is raised. No responders at all (a 503 without a code) means no JetStream here:
    raised at once, not waited out."""
    caught: tuple[type[BaseException], ...] = (ServiceUnavailableError, *silent)
    for attempt in range(1, LOOK_ATTEMPTS + 1):
        try:
            return await call()
        except caught as exc:
            if isinstance(exc, ServiceUnavailableError) and exc.err_code is None:
                raise
            if attempt == LOOK_ATTEMPTS:
                raise
            wait = LOOK_BACKOFF_S[min(attempt, len(LOOK_BACKOFF_S)) - 1]
            log.warning("JetStream did not answer or is not ready; trying again (a cluster "
                        "electing its leaders answers nothing for a while)", what=what,
                        error=type(exc).__name__, attempt=attempt, of=LOOK_ATTEMPTS,
                        retry_in_s=wait)
            await asyncio.sleep(wait)
    raise AssertionError("unreachable")


class StoreError(RuntimeError):
    """The deployment's streams cannot be brought to the configuration asked for."""


PROVISION_HINT = ("run `improved provision` as the provisioning user first (improved-admin: "
                  "IMPROVED_NATS_USER=improved-admin IMPROVED_NATS_PASSWORD_FILE=FILE)")


class NeedsProvision(StoreError):
    """Something the loop needs is missing or differs, and this connection's change got no
    answer: the server drops a request the user may not make (deploy/accounts.conf gives
    stream changes to the provisioning user only), so a timeout is all the daemon sees."""

    def __init__(self, what: str):
        self.what = what
        super().__init__(f"{what}, and this user may not change it (JetStream did not answer): "
                         f"{PROVISION_HINT}")


sentinel_decoder = msgspec.json.Decoder(Sentinel)


def decoded(decoder: msgspec.json.Decoder[T], value: bytes | None) -> T | None:
    """A bucket's value as `decoder` types it; None when empty or not of that type."""
    try:
        return decoder.decode(value) if value else None
    except msgspec.MsgspecError:
        return None


def tools_audit_config(replicas: int = 1) -> jsapi.StreamConfig:
    """The tool runtimes' audit chains (`S.tools_audit`): durable as the daemon's log (file
    storage, no limits, no message deletes), but a stream of its own that no daemon writes
    or checkpoints (a checkpoint witnesses each chain's last trailer, no more), so a runtime's chain (or a trailer someone forged on it) is never
    part of the daemon's log: `improved audit verify` checks it against `[trust.runtimes]`."""
    return jsapi.StreamConfig(
        name=S.STREAM_TOOLS_AUDIT, subjects=[S.TOOLS_AUDIT_FILTER],
        description="improved: the tool runtimes' hash-chained call trailers, append-only",
        retention=jsapi.RetentionPolicy.LIMITS, storage=jsapi.StorageType.FILE,
        deny_delete=True, deny_purge=False, allow_direct=True, num_replicas=replicas,
        max_msgs=-1, max_bytes=-1, max_age=0, max_msgs_per_subject=-1,
    )


def tools_ledger_configs(replicas: int = 1) -> list[jsapi.StreamConfig]:
    """The tool runtimes' spent marks (`S.tools_spent`, each with its per-message TTL) and
    upgrade revocations (`S.tools_revoked`, kept for good): one message per subject, a second
    refused (discard new per subject), and no delete, purge or roll-up, so a mark once written
    stays until its own TTL ends it. A forged mark can refuse a call, never allow one. The
    revocations' stream refuses TTLs: a forged mark written first with a short one would
    otherwise stand in for the operator's revocation and then expire."""
    def config(name: str, subject: str, what: str, ttl: bool) -> jsapi.StreamConfig:
        return jsapi.StreamConfig(
            name=name, subjects=[subject], description=f"improved: {what}, never erased",
            retention=jsapi.RetentionPolicy.LIMITS, storage=jsapi.StorageType.FILE,
            max_msgs_per_subject=1, discard=jsapi.DiscardPolicy.NEW,
            discard_new_per_subject=True, allow_rollup_hdrs=False, deny_delete=True,
            deny_purge=True, allow_msg_ttl=ttl, allow_direct=False, num_replicas=replicas,
            max_msgs=-1, max_bytes=-1, max_age=0)

    return [config(S.STREAM_TOOLS_SPENT, S.TOOLS_SPENT_FILTER,
                   "the tool runtimes' spent grants and session proofs", True),
            config(S.STREAM_TOOLS_REVOKED, S.TOOLS_REVOKED_FILTER,
                   "the tool runtimes' revoked session upgrades", False)]


# The streams that forget by their messages' own TTLs yet must not lose one early, and the
# subject of each one's sentinel (core/retention.py): written first when the stream is made.
SENTINELS = {S.STREAM_TOOLS_SPENT: S.TOOLS_SPENT_SENTINEL}

# What a stream's configuration says about what it keeps. Compared when the wanted config sets
# them: a limit, the discard policy, subjects, storage, retention (a work queue removes what is
# acked).
RETENTION_LIMITS = ("subjects", "retention", "storage", "max_msgs", "max_bytes", "max_age",
                    "max_msgs_per_subject", "discard")
RETENTION_GUARDS = ("deny_delete", "deny_purge", "discard_new_per_subject")  # only True keeps
RETENTION_OPENINGS = ("allow_rollup_hdrs", "allow_msg_ttl")  # only False keeps
RETENTION_UNSET = ("subject_transform", "subject_delete_marker_ttl", "mirror")


def retention_differences(want: jsapi.StreamConfig, have: jsapi.StreamConfig) -> list[str]:
    """The settings of `have` that let the stream lose what `want` keeps: a limit, a discard
    policy, subjects or storage other than wanted, a guard (`deny_delete`, …) off where it
    is wanted on, an opening (`allow_msg_ttl`, roll-ups) on where it is wanted off, a subject
    transform, delete markers or a mirror. Stricter than wanted is no difference; replicas,
    descriptions and the rest say nothing of what it keeps."""
    mine, theirs = want.as_dict(), have.as_dict()

    def norm(value: Any) -> Any:
        return sorted(value) if isinstance(value, list) else value

    found = [k for k in RETENTION_LIMITS
             if mine.get(k) is not None and norm(mine[k]) != norm(theirs.get(k))]
    found += [k for k in RETENTION_GUARDS if mine.get(k) and not theirs.get(k)]
    found += [k for k in RETENTION_OPENINGS if theirs.get(k) and not mine.get(k)]
    found += [k for k in RETENTION_UNSET if theirs.get(k)]
    if theirs.get("sealed"):
        found.append("sealed")
    return found


def created_of(info: jsapi.StreamInfo) -> str:
    """When the server made the stream, as a stream's identity: another incarnation (deleted
    and made again, or restored from a snapshot) has another."""
    created = info.created
    return created.isoformat() if isinstance(created, datetime.datetime) else str(created)


def seen_of(info: jsapi.StreamInfo, want: jsapi.StreamConfig) -> retention.Seen:
    """A stream info as `core.retention` reads it, against the config the stream must have."""
    state = info.state
    return retention.Seen(info.config.name or "", created_of(info), state.first_seq or 0,
                          state.last_seq or 0, state.messages or 0,
                          tuple(retention_differences(want, info.config)))


# Left at 0 in a config, the server fills these in (the 2-minute deduplication window).
SERVER_DEFAULTED = frozenset({"duplicate_window"})


def differences(want: Any, have: Any) -> list[str]:
    """The settings `want` (a stream or consumer config) asks for that `have` does not hold;
    what `want` leaves unset is the server's to fill in, and is not compared."""
    asked = {f.name for f in dataclasses.fields(want) if getattr(want, f.name) is not None
             and not (f.name in SERVER_DEFAULTED and not getattr(want, f.name))}
    mine, theirs = want.as_dict(), have.as_dict()

    def norm(value: Any) -> Any:
        return sorted(value) if isinstance(value, list) else value

    return sorted(k for k in asked & mine.keys() if norm(mine[k]) != norm(theirs.get(k)))


class Streams:
    """The streams of one JetStream context (`js`), each brought to its configuration."""

    def __init__(self, js: JetStreamContext):
        self.js = js

    async def _ensure_stream(self, cfg: jsapi.StreamConfig, strict: bool = False) -> list[str]:
        """One stream brought to `cfg`; a stream that needs a sentinel (SENTINELS) gets it
        written first when made here, and, with `strict` (`improved provision`), written into
        one an earlier version made without it."""
        name = cfg.name or ""
        have = await self._stream_config(name)
        if have is None:
            if await self._change(f"stream {name} is missing", lambda: self.js.add_stream(cfg),
                                  raced=(10058,)) is not None:
                if name in SENTINELS:
                    await self._sentinel_of_new(name)
                return [f"created stream {name}"]
            have = await self._stream_config(name)  # another replica created it meanwhile
            if have is None:
                raise StoreError(f"stream {name} is missing and could not be created")
        done = await self._sentinel_upgrade(name) if strict and name in SENTINELS else []
        if name == S.STREAM_AUDIT and have.deny_purge:
            # created before epochs could be archived: a purge can never be allowed again
            # (the server refuses to cancel deny_purge), and stricter is no difference
            cfg = dataclasses.replace(cfg, deny_purge=True)
        diff = differences(cfg, have)
        if not diff:
            return done
        what = f"stream {name} differs from this configuration ({', '.join(diff)})"
        await self._change(what, lambda: self.js.update_stream(cfg),
                           refused="keep its storage and replicas, or remove it first")
        return [*done, f"updated stream {name} ({', '.join(diff)})"]

    async def _write_sentinel(self, stream: str, made: bool) -> int:
        """Write `stream`'s sentinel (no TTL), its first message when it was `made` just now
        (expected last sequence 0), else the first on its subject; its sequence."""
        subject = SENTINELS[stream]
        expect = ("Nats-Expected-Last-Sequence" if made
                  else "Nats-Expected-Last-Subject-Sequence")
        body = to_json(Sentinel(sentinel=stream, at=time.time_ns() // 1_000_000))
        what = f"stream {stream} has no sentinel"
        ack = await self._change(what, lambda: self.js.publish(
            subject, body, stream=stream, headers={expect: "0"}),
            refused="someone wrote on it first; remove the stream and make it again"
            if made else "a message is on its sentinel's subject")
        assert ack is not None  # nothing counts as raced here: a refusal raises
        return ack.seq

    async def _sentinel_of_new(self, stream: str) -> None:
        """The sentinel of a stream just made: written as its first message, unless another
        replica making it at the same moment (creating a stream that exists with this config
        succeeds) wrote it first, which is the same sentinel."""
        try:
            await self._write_sentinel(stream, made=True)
        except StoreError as refused:
            try:
                first = await self._look(f"stream {stream}", lambda: self.js.get_msg(stream, 1))
            except NotFoundError:
                raise refused from None
            theirs = decoded(sentinel_decoder, first.data)
            if first.subject != SENTINELS[stream] or theirs is None or theirs.sentinel != stream:
                raise

    async def _sentinel_upgrade(self, stream: str) -> list[str]:
        """Write the sentinel into a stream an earlier version made without one: the one-time
        upgrade of `improved provision`. From then on nothing written after it can be removed
        by a limit unseen; what was written before it (marks that leave by their TTL within a
        day) is trusted as it is now."""
        info = await self._look(f"stream {stream}", lambda: self.js.stream_info(
            stream, subjects_filter=SENTINELS[stream]))
        if (info.state.subjects or {}).get(SENTINELS[stream]):
            return []
        seq = await self._write_sentinel(stream, made=False)
        return [f"wrote the sentinel of stream {stream} (sequence {seq}): it was made by an "
                "earlier version"]

    async def ensure_stream(self, cfg: jsapi.StreamConfig) -> list[str]:
        """One stream brought to `cfg` (created or updated), as `ensure` brings each of the
        loop's: what was changed; NeedsProvision when this user may not change it."""
        return await self._ensure_stream(cfg)


    async def existing_buckets(self) -> tuple[KeyValue, KeyValue]:
        """The daemon's dedup and ledger buckets, found without creating anything (how a
        read-only command attaches to a deployment)."""
        return (await self._look(f"bucket {S.BUCKET_DEDUP}",
                                 lambda: self.js.key_value(S.BUCKET_DEDUP)),
                await self._look(f"bucket {S.BUCKET_LEDGER}",
                                 lambda: self.js.key_value(S.BUCKET_LEDGER)))

    async def _stream_config(self, name: str) -> jsapi.StreamConfig | None:
        try:
            return (await self._look(f"stream {name}", lambda: self.js.stream_info(name))).config
        except NotFoundError:
            return None

    @staticmethod
    async def _look(what: str, call: Callable[[], Awaitable[T]]) -> T:
        """A read of the deployment's shape. No answer (or a 503) is tried again (`_patiently`):
        a restarted cluster answers nothing while it elects its leaders. Still silent, it is an
        error of one line."""
        try:
            return await _patiently(what, call, (TimeoutError, NatsTimeoutError))
        except (TimeoutError, NatsTimeoutError, ServiceUnavailableError) as exc:
            if isinstance(exc, ServiceUnavailableError) and exc.err_code is None:
                raise  # no responders: no JetStream here at all
            raise StoreError(
                f"cannot read {what}: JetStream did not answer {LOOK_ATTEMPTS} times "
                "(is it enabled, has the cluster a leader, and may this user read the "
                "loop's streams?)") from exc

    @staticmethod
    async def _change(what: str, call: Callable[[], Awaitable[T]], *,
                      raced: tuple[int, ...] = (), refused: str = "") -> T | None:
        """Make one change: its result, or None when JetStream answers one of the `raced`
        codes (someone made it meanwhile). No answer means this user may not (NeedsProvision);
        a 503 (JetStream not ready, a cluster without a leader yet) is tried again as a look
        is; any other refusal is a StoreError naming it."""
        try:
            return await _patiently(what, call, ())
        except (TimeoutError, NatsTimeoutError) as exc:
            raise NeedsProvision(what) from exc
        except ServiceUnavailableError as exc:
            if exc.err_code is None:
                raise  # no responders: no JetStream here at all
            raise StoreError(f"{what}, and JetStream is not available to change it "
                             f"({exc.description})") from exc
        except APIError as exc:
            if exc.err_code in raced:
                return None
            raise StoreError(f"{what}, and JetStream refused the change ({exc.description})"
                             + (f": {refused}" if refused else "")) from exc
