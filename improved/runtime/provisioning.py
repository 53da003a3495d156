"""The deployment's shape: four streams, five buckets and the inbound consumer, made to match this
configuration by `Provisioning.ensure`, which looks before it changes anything. Under
deploy/accounts.conf only the provisioning user (`improved provision`) may create or change
most of them, and the daemon finds them as they should be: a change it may not make gets no
answer, which it reports as NeedsProvision. A look that gets no answer is tried again, since a
cluster electing its leaders answers nothing for a while.
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
    BucketNotFoundError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from improved.core import observe, retention
from improved.protocol import subjects as S
from improved.protocol.model import (
    Sentinel,
    to_json,
)
from improved.runtime.buckets import decoded

log = structlog.get_logger("improved.store")
T = TypeVar("T")

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


# How long the inbound consumer waits for an ack before it delivers a message again. Short: a
# delivery the broker hands to a pull request of a connection that is dying never arrives, and
# only this wait brings it back. The daemon extends it for every message it holds
# (`InboundConsumer._keep_alive`), however long the job takes.
INBOUND_ACK_WAIT_S = 5.0
INBOUND_MAX_AGE_S = 30 * 24 * 3600
REFUSED_MAX_AGE_S = 30 * 24 * 3600


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


STATE_TTL_S = 3600.0  # the state cache keeps a record this long after its last write
sentinel_decoder = msgspec.json.Decoder(Sentinel)


def stream_configs(replicas: int = 1, records_storage: str = "file") -> list[jsapi.StreamConfig]:
    return [
        jsapi.StreamConfig(
            name=S.STREAM_INBOUND, subjects=list(S.INBOUND_FILTERS),
            description="improved: inbound proposals, reviews, reports, signals, grants, votes",
            retention=jsapi.RetentionPolicy.LIMITS, storage=jsapi.StorageType.FILE,
            max_age=INBOUND_MAX_AGE_S, duplicate_window=120.0, num_replicas=replicas,
        ),
        jsapi.StreamConfig(
            name=S.STREAM_RECORDS, subjects=list(S.RECORD_FILTERS),
            description="improved: retained records, the latest per subject is current",
            retention=jsapi.RetentionPolicy.LIMITS, storage=jsapi.StorageType(records_storage),
            max_msgs_per_subject=1, allow_direct=True, num_replicas=replicas,
            allow_msg_ttl=True,  # the review index's tombstones expire (Nats-TTL)
        ),
        jsapi.StreamConfig(
            name=S.STREAM_AUDIT, subjects=[S.AUDIT_FILTER],
            description="improved: hash-chained audit trailers, append-only",
            retention=jsapi.RetentionPolicy.LIMITS, storage=jsapi.StorageType.FILE,
            # no message is ever deleted; a purge is how an operator removes an exported,
            # sealed epoch (runtime.archive), which only improved-archivist may ask for and
            # every checkpoint and verify checks against the seals
            deny_delete=True, deny_purge=False, allow_direct=True, num_replicas=replicas,
            # no limits, said out loud so that a limit set since is seen as a difference
            max_msgs=-1, max_bytes=-1, max_age=0, max_msgs_per_subject=-1,
        ),
        tools_audit_config(replicas),
        *tools_ledger_configs(replicas),
        jsapi.StreamConfig(
            name=S.STREAM_REFUSED, subjects=[S.REFUSED_FILTER],
            description="improved: refused inbound messages (what and why, never the payload)",
            retention=jsapi.RetentionPolicy.LIMITS, storage=jsapi.StorageType.FILE,
            max_age=REFUSED_MAX_AGE_S, max_msgs=100_000, num_replicas=replicas,
        ),
    ]


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


# The analyzers' windows: one key per (analyzer, service, target), one value each (history 1).
# A bus participant can name a million targets, so the bucket holds at most WINDOWS_MAX_KEYS
# windows and WINDOWS_MAX_BYTES, dropping the least recently written first (discard old): the
# bound the in-memory windows had (observe.MAX_TRACKED per analyzer), kept by the broker. A
# window dropped so loses evidence toward a proposal, never a decision. No max age: a stale
# skill's window lasts until a success, however long; the regression analyzer drops what is
# older than its hour itself.
WINDOWS_MAX_KEYS = 2 * observe.MAX_TRACKED
WINDOWS_MAX_BYTES = 256 * 1024 * 1024


def windows_config(replicas: int = 1) -> jsapi.StreamConfig:
    """The stream under the windows bucket, made as nats-py makes a KV bucket but for the
    discard policy and the key limit, which a KV config cannot say."""
    return jsapi.StreamConfig(
        name=f"KV_{S.BUCKET_WINDOWS}", subjects=[f"$KV.{S.BUCKET_WINDOWS}.>"],
        description="improved: the analyzers' windows (stage 1), shared by every replica",
        retention=jsapi.RetentionPolicy.LIMITS, storage=jsapi.StorageType.FILE,
        max_msgs_per_subject=1, max_msgs=WINDOWS_MAX_KEYS, max_bytes=WINDOWS_MAX_BYTES,
        discard=jsapi.DiscardPolicy.OLD, allow_rollup_hdrs=True, deny_delete=True,
        allow_direct=True, duplicate_window=120.0, num_replicas=replicas,
    )


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


def inbound_consumer(ack_wait_s: float = INBOUND_ACK_WAIT_S) -> jsapi.ConsumerConfig:
    return jsapi.ConsumerConfig(
        durable_name=S.CONSUMER_INBOUND, ack_policy=jsapi.AckPolicy.EXPLICIT,
        deliver_policy=jsapi.DeliverPolicy.ALL, ack_wait=ack_wait_s, max_ack_pending=1024,
        description="improved: the loop's shared work queue",
    )


class Provisioning:
    """Streams, buckets and the inbound consumer brought to this configuration (`ensure`), or
    bound as they are (`bind`); it opens the buckets the rest of the store reads and writes."""

    js: JetStreamContext
    replicas: int
    records_storage: str
    kv: KeyValue
    dedup: KeyValue
    ledger: KeyValue
    windows: KeyValue
    learned: KeyValue
    dedup_ttl: bool

    async def ensure(self, strict: bool = False) -> list[str]:
        """Bring every stream, the inbound consumer and the buckets to this configuration and
        say what was changed. It looks first and changes only what is missing or differs, so a
        provisioned deployment starts without a single create or update (which its daemon user
        may not make: NeedsProvision). Safe to run twice, and by two replicas at once. The one
        change it goes without unless `strict` (`improved provision`): per-message TTLs on the
        dedup bucket (`dedup_ttl`), without which its heads are simply kept for good."""
        done: list[str] = []
        for cfg in stream_configs(self.replicas, self.records_storage):
            done += await self._ensure_stream(cfg, strict)
        done += await self._ensure_consumer()
        # A cache: in memory, filled lazily, since every record can be rebuilt from its chain;
        # a record untouched for STATE_TTL_S leaves it, so its size follows the traffic
        self.kv = await self._bucket(S.BUCKET_STATE, "cached proposal records (rebuildable "
                                     "from the chain)", done, jsapi.StorageType.MEMORY,
                                     ttl=STATE_TTL_S)
        self.dedup = await self._bucket(S.BUCKET_DEDUP, "newest proposal per dedup_key", done)
        self.dedup_ttl = await self._allow_msg_ttl(S.BUCKET_DEDUP, done, strict)
        self.ledger = await self._bucket(S.BUCKET_LEDGER, "the rejection ledger by dedup_key",
                                         done)
        done += [c.replace(f"stream KV_{S.BUCKET_WINDOWS}", f"bucket {S.BUCKET_WINDOWS}")
                 for c in await self._ensure_stream(windows_config(self.replicas))]
        self.windows = await self._look(f"bucket {S.BUCKET_WINDOWS}",
                                        lambda: self.js.key_value(S.BUCKET_WINDOWS))
        self.learned = await self._bucket(S.BUCKET_LEARNED, "each analyzer's accepted and "
                                          "rejected proposals (stage 1's weights)", done)
        return done

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

    async def _ensure_consumer(self) -> list[str]:
        want = inbound_consumer()
        what = f"consumer {S.CONSUMER_INBOUND} of {S.STREAM_INBOUND}"
        try:
            have = await self._look(what, lambda: self.js.consumer_info(S.STREAM_INBOUND,
                                                                        S.CONSUMER_INBOUND))
        except NotFoundError:
            have = None
        diff = differences(want, have.config) if have is not None else []
        if have is not None and not diff:
            return []
        missing = f"{what} is missing" if have is None else (
            f"{what} differs from this configuration ({', '.join(diff)})")
        # creating a consumer that exists brings it to this config (its ack wait, say)
        made = await self._change(missing, lambda: self.js.add_consumer(S.STREAM_INBOUND, want),
                                  raced=(10148, 10013))  # another config / name in use
        if made is None:
            return []
        return [f"created {what}" if have is None else f"updated {what} ({', '.join(diff)})"]

    async def _bucket(self, name: str, what: str, done: list[str],
                      storage: jsapi.StorageType = jsapi.StorageType.FILE,
                      ttl: float | None = None) -> KeyValue:
        """Open a bucket, brought to the configured replicas (an R1 bucket of an earlier
        deployment becomes R3 when `replicas = 3`) and `ttl`, or create it when missing."""
        try:
            kv = await self._look(f"bucket {name}", lambda: self.js.key_value(name))
        except BucketNotFoundError:
            kv = None
        if kv is not None:
            done += await self._bucket_replicas(name, ttl)
            return kv
        kv = await self._change(f"bucket {name} is missing", lambda: self.js.create_key_value(
            bucket=name, history=1, storage=storage, replicas=self.replicas, ttl=ttl,
            description=f"improved: {what}"), raced=(10058,))
        if kv is None:  # another replica created it meanwhile
            return await self._look(f"bucket {name}", lambda: self.js.key_value(name))
        done.append(f"created bucket {name}")
        return kv

    async def _bucket_replicas(self, name: str, ttl: float | None = None) -> list[str]:
        """Update the stream under bucket `name` to the configured replicas (and `ttl`, when
        given) if it has others; the rest of a bucket's settings are the KV layer's."""
        stream = f"KV_{name}"
        have = await self._stream_config(stream)
        if have is None:
            return []
        changes = []
        if (have.num_replicas or 1) != self.replicas:
            changes.append(f"replicas {have.num_replicas or 1} -> {self.replicas}")
        if ttl is not None and (have.max_age or 0) != ttl:
            changes.append(f"ttl {have.max_age or 0:g} s -> {ttl:g} s")
        if not changes:
            return []
        what = f"bucket {name} differs from this configuration ({', '.join(changes)})"
        await self._change(what, lambda: self.js.update_stream(
            have.evolve(num_replicas=self.replicas,
                        max_age=ttl if ttl is not None else have.max_age)),
            refused="a memory bucket keeps its replicas only while the servers run")
        return [f"updated bucket {name} ({', '.join(changes)})"]

    async def _allow_msg_ttl(self, bucket: str, done: list[str], strict: bool) -> bool:
        """Whether the stream under `bucket` takes per-message TTLs (`allow_msg_ttl`: set on a
        bucket nats-py 2.16 creates, not on one an earlier version made), turned on when it
        does not. A change this user may not make, or that is refused, is one log line and
        False (the caller goes without TTLs), or with `strict` the error it is."""
        stream = f"KV_{bucket}"
        have = await self._stream_config(stream)
        if have is None:
            return False
        if have.allow_msg_ttl:
            return True
        try:
            await self._change(f"bucket {bucket} does not allow per-message TTLs",
                               lambda: self.js.update_stream(have.evolve(allow_msg_ttl=True)))
        except StoreError as exc:
            if strict:
                raise
            log.warning(f"bucket {bucket} does not allow per-message TTLs, and this user could "
                        "not allow them: the loop runs on, and its keys stay for good (a closed "
                        f"proposal's dedup head gets no TTL); to allow them, {PROVISION_HINT}",
                        **({} if isinstance(exc, NeedsProvision) else {"error": str(exc)}))
            return False
        done.append(f"updated bucket {bucket} (allow_msg_ttl)")
        return True

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

    async def bind(self) -> None:
        """Attach to an existing deployment without creating anything (read-only commands)."""
        self.kv = await self._look(f"bucket {S.BUCKET_STATE}",
                                   lambda: self.js.key_value(S.BUCKET_STATE))
        self.dedup = await self._look(f"bucket {S.BUCKET_DEDUP}",
                                      lambda: self.js.key_value(S.BUCKET_DEDUP))
        self.ledger = await self._look(f"bucket {S.BUCKET_LEDGER}",
                                       lambda: self.js.key_value(S.BUCKET_LEDGER))
