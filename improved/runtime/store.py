"""JetStream streams, the state bucket, and the chain append (DESIGN §7 "store").

Four streams, five buckets and the inbound consumer, made to match this configuration by
`Store.ensure`, which looks before it changes anything: under deploy/accounts.conf only the
provisioning user (`improved provision`) may create or change most of them, and the daemon
finds them as they should be.
- IMPROVE_IN: inbound requests (`improve.proposals.<svc>`, …), kept so nothing is lost while no
  daemon runs; one durable pull consumer shared by every replica.
- IMPROVE_RECORDS: retained records, one message per subject (the current state), among them
  the review index (`improve.review.<svc>.<id>`, one entry per open item of the operator's
  queue; an item that leaves is overwritten by an empty message with a per-message TTL, so its
  subject disappears) and the marker a complete refill leaves (`improve.review._filled.records`,
  naming the stream's incarnation, its creation time, and the index format): it lives and dies
  with what it vouches for, so a broker restart over file storage keeps both, and a re-created
  (memory storage) or purged stream loses both and is refilled.
- IMPROVE_AUDIT: the trailers, append-only (deny delete, no limits); purged only by an
  operator removing an exported, sealed epoch (runtime.archive).
- KV `improved_state`: a cache of each proposal's record, in memory, filled lazily: a record
  missing or different from its chain is rebuilt from the chain and put back when read.
- KV `improved_windows` and `improved_learned`: stage 1's analyzer windows and learned weights,
  shared by every replica (`runtime.observing`); outputs of signals and of committed trailers,
  read by nothing but the analyzers, so never an input to an authority decision.

The chain append is the commit point of every transition (`improved.client.chain_writer`,
which `Store` extends). It carries `Nats-Expected-Last-Subject-Sequence`, so a trailer joins
the chain only if nothing joined since the writer last looked: a redelivery, a restart or a
second replica gets a conflict instead of a duplicate trailer, re-reads the chain, and finds
its transition already made.
"""

from __future__ import annotations

import asyncio
import datetime
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from typing import Any, NamedTuple, TypeVar

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from improved.client import chains
from improved.client.chain_writer import MAX_APPEND_ATTEMPTS, ChainWriter, pause_after_conflict
from improved.client.streams import (
    PROVISION_HINT,
    NeedsProvision,
    StoreError,
    decoded,
    differences,
    is_conflict,
    retention_differences,
    tools_audit_config,
    tools_ledger_configs,
)
from improved.core import audit, checkpoint, indexes, observe, queue
from improved.core.authority import GrantActs, grant_as_of, grant_covers
from improved.core.record import ProposalRecord, record_decoder, record_encoder
from improved.protocol import subjects as S
from improved.protocol.model import (
    DedupHead,
    IndexMarker,
    LedgerEntry,
    MeasureDue,
    Refusal,
    ReviewEntry,
    Trailer,
    to_json,
)

log = structlog.get_logger("improved.store")
T = TypeVar("T")


async def kv_create(kv: KeyValue, key: str, value: bytes) -> int:
    """`kv.create`, with a conflict always raised as KeyWrongLastSequenceError. nats-py's
    create, answered a conflict, reads the key to tell a deleted key (which it then updates)
    from a live one; on a cluster that read can miss the write that won (still in flight, or
    served by a replica behind the leader) and raise KeyNotFoundError instead."""
    try:
        return await kv.create(key, value)
    except KeyNotFoundError as exc:
        raise KeyWrongLastSequenceError(description="wrong last sequence") from exc


PUBLISH_ACK_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 1.0  # a status read during a restore (Store._probe)
# How long the inbound consumer waits for an ack before it delivers a message again. Short: a
# delivery the broker hands to a pull request of a connection that is dying never arrives, and
# only this wait brings it back. The daemon extends it for every message it holds
# (`Daemon._keep_alive`), however long the job takes.
INBOUND_ACK_WAIT_S = 5.0
READ_IDLE_S = 5.0  # a read of the audit log that receives nothing this long has ended


async def _nothing_pending(sub: JetStreamContext.PullSubscription) -> bool:
    """Whether a consumer just made has nothing to deliver, so a read need not wait
    READ_IDLE_S to find out; False when its info does not come (a clustered consumer whose
    leader is not elected yet): the read then finds out by waiting."""
    try:
        return (await sub.consumer_info()).num_pending == 0
    except Exception:
        return False
# How long an index tombstone (an item that left the index) stays before its subject is gone,
# with checkpoints every 300 s (`indexes.tombstone_ttl_s`; the daemon sets its own from its
# checkpoint interval): past the next two checkpoints, so a reader finds every member of the
# last one among the subjects, and short enough that tombstones do not pile up with the history.
TOMBSTONE_TTL_S = indexes.tombstone_ttl_s(300)
INBOUND_MAX_AGE_S = 30 * 24 * 3600
REFUSED_MAX_AGE_S = 30 * 24 * 3600


class StateConflict(Exception):
    """Someone updated the cached record since we read it."""


review_entry_decoder = msgspec.json.Decoder(ReviewEntry)
dedup_head_decoder = msgspec.json.Decoder(DedupHead)
ledger_entry_decoder = msgspec.json.Decoder(LedgerEntry)
due_entry_decoder = msgspec.json.Decoder(MeasureDue)
# what a subject of an index holds (core.indexes.INDEXES), and its decoder
IndexEntry = ReviewEntry | MeasureDue
IndexDecoder = msgspec.json.Decoder[ReviewEntry] | msgspec.json.Decoder[MeasureDue]
E = TypeVar("E", ReviewEntry, MeasureDue)
# index name (core.indexes.INDEXES) → (its subjects, an entry's subject, its entries' decoder)
INDEX_SUBJECTS: dict[str, tuple[str, Callable[[str, str], str], IndexDecoder]] = {
    "review": (S.REVIEW_FILTER, S.review_entry, review_entry_decoder),
    "due": (S.DUE_FILTER, S.due_entry, due_entry_decoder),
}


GRANT_MEMO_SIZE = 4096  # grant chains whose verified end each process remembers
FOLLOW_BATCH = 512  # trailers a reader of the log pulls at once
STATE_TTL_S = 3600.0  # the state cache keeps a record this long after its last write


def _chain_key(subject: str) -> tuple[str, str]:
    """(service token, chain id) of an audit subject `improve.audit.<svc>.<id>`."""
    return S.token(subject, 2) or "", S.token(subject, 3) or ""


class _GrantChain(NamedTuple):
    """A grant chain as read whole from the leader: the trust it was verified under, its last
    trailer then (stream sequence, hash), the trailers (stream sequence, body) and its acts
    (None: it does not verify whole)."""

    trust: audit.Authenticity | None
    end: tuple[int, str]
    chain: chains.Sequenced
    acts: GrantActs | None


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


def inbound_consumer(ack_wait_s: float = INBOUND_ACK_WAIT_S) -> jsapi.ConsumerConfig:
    return jsapi.ConsumerConfig(
        durable_name=S.CONSUMER_INBOUND, ack_policy=jsapi.AckPolicy.EXPLICIT,
        deliver_policy=jsapi.DeliverPolicy.ALL, ack_wait=ack_wait_s, max_ack_pending=1024,
        description="improved: the loop's shared work queue",
    )


class Store(ChainWriter):
    # the buckets, opened by `ensure` (or `bind`, for the first three)
    kv: KeyValue
    dedup: KeyValue
    ledger: KeyValue
    windows: KeyValue
    learned: KeyValue

    def __init__(self, nc: Client, replicas: int = 1, records_storage: str = "file", *,
                 audit_stream: str = S.STREAM_AUDIT):
        # the daemon's log (or `audit_stream`), its trailers signed with the daemon's key once
        # it is loaded (`signer`)
        super().__init__(nc, audit_stream=audit_stream)
        # for the small status reads of a restore: a server still loading its streams after a
        # restart answers nothing, and the restore tries again sooner than the default 5 s
        self._probe: JetStreamContext = nc.jetstream(timeout=PROBE_TIMEOUT_S)
        self.replicas = replicas
        self.records_storage = records_storage
        self.tombstone_ttl_s = TOMBSTONE_TTL_S
        # whether the dedup bucket's stream takes per-message TTLs (`ensure` finds out)
        self.dedup_ttl = False
        # skill hash → the grant chain as last read whole: re-read only when it has moved
        self._grants: OrderedDict[str, _GrantChain] = OrderedDict()

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

    async def bind(self) -> None:
        """Attach to an existing deployment without creating anything (read-only commands)."""
        self.kv = await self._look(f"bucket {S.BUCKET_STATE}",
                                   lambda: self.js.key_value(S.BUCKET_STATE))
        self.dedup = await self._look(f"bucket {S.BUCKET_DEDUP}",
                                      lambda: self.js.key_value(S.BUCKET_DEDUP))
        self.ledger = await self._look(f"bucket {S.BUCKET_LEDGER}",
                                       lambda: self.js.key_value(S.BUCKET_LEDGER))

    # -- supersession and the rejection ledger ----------------------------------------------------

    async def dedup_head(self, svc: str, dedup: str) -> DedupHead | None:
        """The head under `dedup`; None when there is none, or the key holds no head (the
        bucket is a hint anyone on the bus could write)."""
        try:
            entry = await self.dedup.get(S.dedup_key_of(svc, dedup))
        except KeyNotFoundError:
            return None
        return decoded(dedup_head_decoder, entry.value)

    async def set_dedup_head(self, svc: str, dedup: str, pid: str,
                             created_at: int, absent: bool = False) -> DedupHead | None:
        """Record `pid` as the newest content under `dedup` unless something newer is there;
        return the head that was there before (None for a first proposal under the key, or a
        value that is no head: written over). With `absent` (the caller just read the key as
        absent) the create is tried first."""
        value = to_json(DedupHead(proposal_id=pid, created_at=created_at))

        def newest(current: bytes | None) -> tuple[bytes | None, DedupHead | None]:
            head = decoded(dedup_head_decoder, current)
            if head is None:
                return value, None
            if (head.created_at, head.proposal_id) >= (created_at, pid):
                return None, head
            return value, head

        return await self.compare_and_set(self.dedup, S.BUCKET_DEDUP,
                                          S.dedup_key_of(svc, dedup), newest, absent=absent)

    async def expire_dedup_head(self, svc: str, dedup: str, ttl_s: int,
                                may_expire: Callable[[DedupHead], bool]) -> bool:
        """Write the head under `dedup` again, as it is, with the per-message TTL `ttl_s`
        (Nats-TTL: the server then removes the key, without a delete marker), when
        `may_expire(head)` says so and it carries no TTL yet; True when it was written. The
        write is a compare-and-set at the revision read (Nats-Expected-Last-Subject-Sequence),
        so a head written meanwhile (a newer proposal's claim) stays as written, and this one
        is left alone: not retried. nats-py's KeyValue.update takes no TTL, so this publishes to
        the key's subject as that update does. Needs `dedup_ttl`."""
        stream = f"KV_{S.BUCKET_DEDUP}"
        subject = f"$KV.{S.BUCKET_DEDUP}.{S.dedup_key_of(svc, dedup)}"
        try:  # from the bucket's stream leader (its buckets take no direct gets)
            msg = await self.js.get_msg(stream, subject=subject)
        except NotFoundError:
            return False
        headers = msg.headers or {}
        if headers.get("KV-Operation") in ("DEL", "PURGE") or headers.get("Nats-TTL"):
            return False
        try:
            head = dedup_head_decoder.decode(msg.data or b"")
        except msgspec.MsgspecError:
            return False
        if not may_expire(head):
            return False
        try:
            # no Nats-Expected-Stream: the bucket's stream keeps every header, for the TTL
            await self.js.publish(subject, msg.data or b"", msg_ttl=ttl_s,
                                  headers={"Nats-Expected-Last-Subject-Sequence": str(msg.seq)})
        except APIError as exc:
            if is_conflict(exc):
                return False
            raise
        return True

    async def compare_and_set(self, kv: KeyValue, bucket: str, key: str,
                              decide: Callable[[bytes | None], tuple[bytes | None, T]], *,
                              absent: bool = False) -> T:
        """Read `key` (None when absent or deleted), let `decide` say what to write (None: write
        nothing) and what to return, and write it only if the key is still as read: created
        when it was absent, else updated at the revision read. On a conflict read again and
        decide again, so `decide` must be pure. StateConflict when every attempt lost.
        With `absent` (the caller expects a new key) the create is tried without a read, one
        round trip instead of two; a conflict, or nothing to write, falls back to reading."""
        if absent:
            value, result = decide(None)
            if value is not None:
                try:
                    await kv_create(kv, key, value)
                    return result
                except APIError as exc:
                    if not is_conflict(exc):
                        raise
        leader = False
        for attempt in range(MAX_APPEND_ATTEMPTS):
            if leader:
                await pause_after_conflict(attempt - 1)
            current, revision = await self.kv_read(kv, bucket, key, leader)
            value, result = decide(current)
            if value is None:
                return result
            try:
                if current is None:
                    await kv_create(kv, key, value)
                else:
                    await kv.update(key, value, last=revision)
                return result
            except APIError as exc:
                if not is_conflict(exc):
                    raise
                # someone wrote first: read what they wrote where it was written (a direct
                # get may be served by a replica that has not seen it yet)
                leader = True
        raise StateConflict(f"{key}: still conflicting after {MAX_APPEND_ATTEMPTS} attempts")

    async def kv_read(self, kv: KeyValue, bucket: str, key: str,
                      leader: bool = False) -> tuple[bytes | None, int]:
        """(value, revision) of a key, (None, revision) when absent or deleted; with `leader`
        read from the bucket's stream leader rather than any replica."""
        if not leader:
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:  # or deleted
                return None, 0
            return entry.value, entry.revision or 0
        try:
            msg = await self.js.get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}")
        except NotFoundError:
            return None, 0
        if msg.headers and msg.headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None, msg.seq or 0
        return msg.data, msg.seq or 0

    async def ledger_put(self, svc: str, dedup: str, entry: LedgerEntry) -> None:
        await self.ledger.put(S.dedup_key_of(svc, dedup), to_json(entry))

    async def ledger_get(self, svc: str, dedup: str) -> LedgerEntry | None:
        """The rejection-ledger entry under `dedup`; None when there is none, or the key holds
        no entry (a hint, like the dedup bucket)."""
        try:
            entry = await self.ledger.get(S.dedup_key_of(svc, dedup))
        except KeyNotFoundError:
            return None
        return decoded(ledger_entry_decoder, entry.value)

    # -- the state cache -------------------------------------------------------------------------

    async def load(self, svc: str, pid: str) -> tuple[ProposalRecord | None, int]:
        try:
            entry = await self.kv.get(S.state_key(svc, pid))
        except KeyNotFoundError:
            return None, 0
        if entry.value is None:
            return None, entry.revision or 0
        return record_decoder.decode(entry.value), entry.revision or 0

    async def save(self, record: ProposalRecord, revision: int) -> int:
        key = S.state_key(record.service, record.proposal_id)
        data = record_encoder.encode(record)
        try:
            if revision == 0:
                return await kv_create(self.kv, key, data)
            return await self.kv.update(key, data, last=revision)
        except APIError as exc:
            if is_conflict(exc):
                raise StateConflict(key) from exc
            raise

    async def keys(self) -> list[str]:
        """The keys of every cached record (a marker an earlier version kept here left out)."""
        try:
            keys = await self.kv.keys()
        except Exception:  # nats-py raises NoKeysError on an empty bucket
            return []
        return [k for k in keys if not k.startswith("_")]

    # -- are the records and the review index whole? -----------------------------------------

    async def incarnation(self) -> IndexMarker:
        """What a complete refill vouches for: the records stream as it is now (its creation
        time: a re-created stream is a new one) and the index format of this version."""
        records = await self._probe.stream_info(S.STREAM_RECORDS)
        return IndexMarker(records=str(records.created), index=queue.INDEX_VERSION)

    async def filled(self, seen: IndexMarker | None = None) -> bool:
        """True when the retained records and the review index are complete: the marker a
        refill leaves is in the records stream and names this very stream and index format.
        A purge or a re-created stream takes the marker with it; an upgrade from a version
        without the index finds none."""
        try:
            seen = seen or await self.incarnation()
            data = await self.last(S.FILLED_MARKER)
        except NotFoundError:  # no records stream at all
            return False
        try:
            return data is not None and msgspec.json.decode(data, type=IndexMarker) == seen
        except msgspec.MsgspecError:
            return False

    async def mark_filled(self, seen: IndexMarker) -> None:
        """Record that the records and the index of incarnation `seen` are complete."""
        await self.publish(S.FILLED_MARKER, seen)

    async def has_chains(self) -> bool:
        return (await self._probe.stream_info(S.STREAM_AUDIT)).state.messages > 0

    # -- the chain -------------------------------------------------------------------------------

    async def append(self, record: ProposalRecord, trailer: Trailer) -> int:
        """Append a trailer if the chain still ends where `record` says; its stream sequence."""
        return await self.append_to(S.audit(record.service, record.proposal_id), trailer,
                                    record.chain.stream_seq)

    async def read_chain(self, svc: str, pid: str) -> list[tuple[int, dict[str, Any]]]:
        """Every trailer of one chain as (stream sequence, raw JSON body), in order."""
        return await self.read_chain_at(S.audit(svc, pid))

    async def audit_log(self, pid: str | None = None) -> list[tuple[int, str, dict[str, Any]]]:
        """Every trailer (or one proposal's) as (stream sequence, subject, body), in stream
        order, read once through an ordered consumer (what could not be read is left out:
        `read_audit` names it)."""
        return (await self.read_audit(pid))[0]

    async def read_audit(self, pid: str | None = None,
                         ) -> tuple[list[tuple[int, str, dict[str, Any]]], checkpoint.StreamView]:
        """The trailers as `audit_log` gives them, and what was found of the stream: its
        creation time (None when it does not exist), its last sequence, and — over the whole
        log — the sequences it holds but could not give back (a damaged block: the server
        skips the message, so an ordered consumer would wait for it forever). Bounded: a
        read that stalls ends after READ_IDLE_S."""
        try:
            info = await self.js.stream_info(S.STREAM_AUDIT)
        except NotFoundError:
            return [], checkpoint.StreamView(None)
        state = info.state
        subject = S.audit("*", pid) if pid else S.AUDIT_FILTER
        log: list[tuple[int, str, dict[str, Any]]] = []
        if state.messages and (not pid or await self._holds(subject)):
            log = await self._read_ordered(subject, state.last_seq)
        unreadable: tuple[int, ...] = ()
        if not pid and len(log) < state.messages:
            seen = {seq for seq, _, _ in log}
            unreadable = tuple(s for s in range(state.first_seq, state.last_seq + 1)
                               if s not in seen)
        return log, checkpoint.StreamView(str(info.created), state.last_seq, unreadable)

    async def _holds(self, subject: str) -> bool:
        filtered = await self.js.stream_info(S.STREAM_AUDIT, subjects_filter=subject)
        return bool(filtered.state.subjects)

    async def _read_ordered(self, subject: str, last_seq: int
                            ) -> list[tuple[int, str, dict[str, Any]]]:
        """Read `subject` up to stream sequence `last_seq` (or until nothing is pending)."""
        return [(seq, subj, body) async for seq, subj, body, _ in self.follow(subject, 1, last_seq)
                if body is not None]

    async def follow(self, subject: str, start: int, upto: int, *,
                     start_ms: int | None = None,
                     ) -> AsyncIterator[tuple[int, str, dict[str, Any] | None, dict[str, str]]]:
        """(stream sequence, subject, body or None when it is not JSON, headers) of every
        trailer on `subject` from stream sequence `start` to `upto`, one at a time: a reader of
        the whole log holds one batch (FOLLOW_BATCH trailers), not the log. It pulls each
        batch when the one before is read, so a slow reader never makes the server push the
        log into its buffers. Ends early when nothing arrives for READ_IDLE_S (a message the
        server holds but cannot read). `start_ms` (epoch ms): from the first trailer the
        server stored at or after that time instead of from `start`."""
        if upto < start:
            return
        config = jsapi.ConsumerConfig(ack_policy=jsapi.AckPolicy.NONE,
                                      inactive_threshold=READ_IDLE_S * 6, mem_storage=True)
        if start_ms is not None:
            config.deliver_policy = jsapi.DeliverPolicy.BY_START_TIME
            config.opt_start_time = datetime.datetime.fromtimestamp(start_ms / 1000, datetime.UTC)
        else:
            config.deliver_policy = jsapi.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = start
        sub = await self.js.pull_subscribe(subject, stream=self.audit_stream, config=config)
        try:
            if await _nothing_pending(sub):
                return  # nothing there (a purged chain, a window past the end): no wait
            while True:
                try:
                    msgs = await self._pull(sub)
                except TimeoutError:  # nats-py raises its own or asyncio's, by timing
                    return
                for msg in msgs:
                    seq = msg.metadata.sequence.stream
                    if seq > upto:
                        return
                    try:
                        body = msgspec.json.decode(msg.data)
                    except msgspec.DecodeError:
                        body = None  # not JSON: counted as unreadable by the caller
                    yield seq, msg.subject, body if isinstance(body, dict) else None, \
                        dict(msg.headers or {})
                    if msg.metadata.num_pending == 0 or seq >= upto:
                        return
        finally:
            with suppress(Exception):  # it goes by itself once inactive
                await self.js.delete_consumer(self.audit_stream, config.name or "")
            await sub.unsubscribe()

    @staticmethod
    async def _pull(sub: JetStreamContext.PullSubscription) -> list[Msg]:
        """The next batch of a log read. A consumer just made on a clustered stream may not
        answer until its leader is elected (the server says "no responders"): try again for
        up to READ_IDLE_S, as for a silent read."""
        for _ in range(int(READ_IDLE_S / 0.1)):
            try:
                return await sub.fetch(FOLLOW_BATCH, timeout=READ_IDLE_S)
            except ServiceUnavailableError:
                await asyncio.sleep(0.1)
        return await sub.fetch(FOLLOW_BATCH, timeout=READ_IDLE_S)

    async def audit_view(self) -> checkpoint.StreamView:
        """The audit stream as its state says, in O(1): creation time, first and last
        sequence and how many messages it holds (fewer than its sequences: some are gone)."""
        try:
            info = await self.js.stream_info(self.audit_stream)
        except NotFoundError:
            return checkpoint.StreamView(None)
        state = info.state
        return checkpoint.StreamView(str(info.created), state.last_seq,
                                     first_seq=state.first_seq, messages=state.messages)

    async def audit_retention(self) -> tuple[checkpoint.StreamView, list[str]]:
        """The audit stream as its state says (`audit_view`, O(1)) and which of the settings
        it keeps every trailer by differ from the loop's (a limit set, deletes allowed): what
        a decision that relies on the log not forgetting checks first."""
        try:
            info = await self.js.stream_info(self.audit_stream)
        except NotFoundError:
            return checkpoint.StreamView(None), []
        state = info.state
        want = next(c for c in stream_configs(self.replicas) if c.name == S.STREAM_AUDIT)
        changed = retention_differences(want, info.config)
        return (checkpoint.StreamView(str(info.created), state.last_seq,
                                      first_seq=state.first_seq, messages=state.messages),
                changed)

    async def trailer_at(self, seq: int
                         ) -> tuple[str, dict[str, Any] | None, dict[str, str]] | None:
        """(subject, body or None when not JSON, headers) of the message at `seq` of this
        store's audit stream."""
        try:
            msg = await self.js.get_msg(self.audit_stream, seq=seq, direct=True)
        except NotFoundError:
            return None
        try:
            body = msgspec.json.decode(msg.data or b"")
        except msgspec.DecodeError:
            body = None
        return (msg.subject or "", body if isinstance(body, dict) else None,
                dict(msg.headers or {}))

    async def all_chains(self, pid: str | None = None
                         ) -> dict[tuple[str, str], list[dict[str, Any]]]:
        """Every chain (or one proposal's), keyed by (service token, chain id), in order."""
        chains: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _, subject, body in await self.audit_log(pid):
            chains.setdefault(_chain_key(subject), []).append(body)
        return chains

    async def sequenced_chains(self
                               ) -> dict[tuple[str, str], list[tuple[int, dict[str, Any]]]]:
        """Every chain as (stream sequence, body) pairs, keyed like `all_chains`."""
        chains: dict[tuple[str, str], list[tuple[int, dict[str, Any]]]] = {}
        for seq, subject, body in await self.audit_log():
            chains.setdefault(_chain_key(subject), []).append((seq, body))
        return chains

    # -- retained records ------------------------------------------------------------------------

    async def publish(self, subject: str, record: msgspec.Struct | None,
                      ttl_s: int | None = None) -> None:
        """Publish a retained record, pipelined: sent at once, acknowledged when awaited. With
        `ttl_s` it carries that TTL (Nats-TTL): the server removes it then, with its subject;
        a None record is an empty message (a tombstone)."""
        ack = await self.js.publish_async(subject, b"" if record is None else to_json(record),
                                          stream=S.STREAM_RECORDS, msg_ttl=ttl_s)
        # an ack lost in a broker restart must not wedge the job: time out, nak, retry
        await asyncio.wait_for(ack, timeout=PUBLISH_ACK_TIMEOUT_S)

    # -- the review index --------------------------------------------------------------------------

    async def index(self, svc: str, pid: str, entry: ReviewEntry | None) -> None:
        """Put `pid` in the review index (`entry`), or take it out (None)."""
        await self._retain(S.review_entry(svc, pid), entry)

    async def mark_due(self, svc: str, pid: str, entry: MeasureDue | None) -> None:
        """Put `pid` in the measurement index (`entry`), or take it out (None)."""
        await self._retain(S.due_entry(svc, pid), entry)

    async def _retain(self, subject: str, entry: IndexEntry | None) -> None:
        """An index entry, or for None a tombstone that replaces it and, after
        `tombstone_ttl_s`, leaves the stream with its subject."""
        if entry is not None:
            await self.publish(subject, entry)
        else:
            await self.publish(subject, None, ttl_s=self.tombstone_ttl_s)

    async def index_entry(self, index: str, svc: str, pid: str,
                          entry: IndexEntry | None) -> None:
        """Put `pid` in the index named `index` (`entry`), or take it out (None)."""
        await self._retain(INDEX_SUBJECTS[index][1](svc, pid), entry)

    async def index_subject(self, index: str, svc: str, pid: str) -> IndexEntry | None:
        """The entry the subject of `pid` in the index named `index` holds: None when there
        is none, a tombstone, or anything that is no entry of its own."""
        _, subject, decoder = INDEX_SUBJECTS[index]
        data = await self.last(subject(svc, pid))
        try:
            entry = decoder.decode(data) if data else None
        except msgspec.MsgspecError:
            return None
        return entry if entry is not None and (entry.service, entry.proposal_id) == (svc, pid) \
            else None

    async def read_index(self) -> list[ReviewEntry]:
        """Every entry of the review index, tombstones and anything malformed left out."""
        return await self._read_entries(S.REVIEW_FILTER, review_entry_decoder)

    async def read_due(self) -> list[MeasureDue]:
        """Every entry of the measurement index, tombstones and anything malformed left out."""
        return await self._read_entries(S.DUE_FILTER, due_entry_decoder)

    async def _read_entries(self, subjects: str, decoder: msgspec.json.Decoder[E]) -> list[E]:
        """The entries on `subjects` (`improve.<index>.<svc>.<id>`) whose service and id are
        their subject's (`_read_named`, tombstones left out). An entry only says where to
        look."""
        return [n.entry for n in await self._read_named(subjects, decoder)
                if n.entry is not None]

    async def read_named(self, index: str) -> list[indexes.Named]:
        """Every subject of the index named `index` (core.indexes), tombstones included: a
        tombstone still names the proposal that left."""
        subjects, _, decoder = INDEX_SUBJECTS[index]
        return await self._read_named(subjects, decoder)

    async def _read_named(self, subjects: str, decoder: IndexDecoder) -> list[indexes.Named]:
        """What each subject on `subjects` (`improve.<index>.<svc>.<id>`) names: the last
        message per subject, read once through an ordered consumer (O(open items and recent
        tombstones), never the history); its entry when it holds one for its own service and
        id, else None (a tombstone, or anything else)."""
        config = jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.LAST_PER_SUBJECT)
        sub = await self.js.subscribe(subjects, ordered_consumer=True,
                                      stream=S.STREAM_RECORDS, config=config)
        out: list[indexes.Named] = []
        try:
            info = await sub.consumer_info()
            if info.num_pending == 0 and not (info.delivered and info.delivered.consumer_seq):
                return out  # nothing to deliver: do not wait for it
            while True:
                try:
                    msg = await sub.next_msg(timeout=READ_IDLE_S)
                except TimeoutError:  # nats-py raises its own or asyncio's, by timing
                    return out
                svc, pid = S.token(msg.subject, 2) or "", S.token(msg.subject, 3) or ""
                if S.SERVICE_RE.match(svc) and S.ID_RE.match(pid):
                    try:
                        entry = decoder.decode(msg.data) if msg.data else None
                    except msgspec.MsgspecError:
                        entry = None
                    if entry is not None and (entry.service, entry.proposal_id) != (svc, pid):
                        entry = None
                    out.append(indexes.Named(svc, pid, entry,
                                             int(msg.metadata.timestamp.timestamp() * 1000)))
                if msg.metadata.num_pending == 0:
                    return out
        finally:
            await sub.unsubscribe()

    async def publish_once(self, subject: str, record: msgspec.Struct) -> None:
        """Publish an immutable record: only if the subject holds nothing yet."""
        try:
            await self.js.publish(subject, to_json(record), stream=S.STREAM_RECORDS,
                                  headers={"Nats-Expected-Last-Subject-Sequence": "0"})
        except APIError as exc:
            if not is_conflict(exc):
                raise

    async def service_of(self, pid: str) -> str | None:
        """The service whose chain holds proposal `pid` (a vote names only the proposal)."""
        info = await self.js.stream_info(S.STREAM_AUDIT, subjects_filter=S.audit("*", pid))
        for subject in (info.state.subjects or {}):
            svc = S.token(subject, 2)
            if svc and svc not in S.MESH_CHAINS:
                return svc
        return None

    async def last(self, subject: str) -> bytes | None:
        try:
            msg = await self.js.get_msg(S.STREAM_RECORDS, subject=subject, direct=True)
        except NotFoundError:
            return None
        return msg.data

    async def grant_active(self, identity: str | None, now_ms: int,
                           trust: audit.Authenticity | None = None) -> bool:
        """An active, unexpired grant for exactly `<name>:<sha256>`, as its verified grant
        chain says (never the retained record, never a lookup by name), read from the stream
        leader: a grant revoked a moment ago is never read as active here."""
        read = await self._grant_chain(identity, trust)
        grant = grant_as_of(read.acts) if read is not None and read.acts else None
        return (grant is not None and identity is not None
                and grant_covers(grant, identity, now_ms))

    async def grant_active_as_of(self, identity: str | None, seq: int, at: int,
                                 trust: audit.Authenticity | None = None) -> bool:
        """Was the grant of exactly `<name>:<sha256>` active as of stream sequence `seq` of the
        audit stream — only the grant chain's acts recorded below `seq` count — and unexpired
        at `at`? Whether the intent at `seq` (recorded at `at`) stands. Asked after that
        intent's append was acknowledged, so the read from the leader sees every act below it,
        and judged on the chain's trailers below `seq` alone: whatever lands later (a revoke,
        or a trailer that does not verify) changes no verdict already given on it."""
        read = await self._grant_chain(identity, trust)
        if read is None or identity is None:
            return False
        acts = read.acts
        if acts is None:  # a break somewhere: what stood below `seq` is what its prefix says
            acts = chains.verified_acts(identity, [t for t in read.chain if t[0] < seq], trust)
        grant = grant_as_of(acts, seq) if acts else None
        return grant is not None and grant_covers(grant, identity, at)

    async def _grant_chain(self, identity: str | None,
                           trust: audit.Authenticity | None) -> _GrantChain | None:
        """The grant chain of `identity` read from the leader and verified under `trust`;
        None for a bad identity or no chain. It is read and verified whole only when its last
        trailer (one read) is not the one it ended with at the last whole read under the same
        trust: a grant chain only ever grows, so a verified prefix stays verified, and one read
        of its end, made now, says whether anything was added since."""
        subject = chains.grant_chain_subject(identity)
        if subject is None or identity is None:
            return None
        sha = identity.split(":", 1)[1]
        try:
            msg = await self.js.get_msg(S.STREAM_AUDIT, subject=subject)
        except NotFoundError:
            return None
        end = (msg.seq or 0, msgspec.json.decode(msg.data or b"{}").get("hash", ""))
        memo = self._grants.get(sha)
        if memo is not None and memo.trust is trust and memo.end == end:
            self._grants.move_to_end(sha)
            return memo
        chain = await chains.read_from_leader(self.js, subject)
        read = _GrantChain(trust, end, chain, chains.verified_acts(identity, chain, trust))
        self._grants[sha] = read
        while len(self._grants) > GRANT_MEMO_SIZE:
            self._grants.popitem(last=False)
        return read

    # -- refusals --------------------------------------------------------------------------------

    async def refuse(self, svc: str, refusal: Refusal) -> None:
        await self.js.publish(S.refused(svc), to_json(refusal), stream=S.STREAM_REFUSED)
