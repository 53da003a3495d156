"""The deployment's shape: four streams, four buckets and the inbound consumer, made to match this
configuration by `Provisioning.ensure`, which looks before it changes anything. Under
deploy/accounts.conf only the provisioning user (`improved provision`) may create or change
most of them, and the daemon finds them as they should be: a change it may not make gets no
answer, which it reports as NeedsProvision. A look that gets no answer is tried again, since a
cluster electing its leaders answers nothing for a while.
"""

from __future__ import annotations

import dataclasses

import structlog
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import (
    BucketNotFoundError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from improved.client.config import RECORDS_STORAGE
from improved.client.streams import (
    PROVISION_HINT,
    NeedsProvision,
    StoreError,
    Streams,
    differences,
    tools_audit_config,
    tools_ledger_configs,
)
from improved.core import observe
from improved.protocol import subjects as S

log = structlog.get_logger("improved.store")

# How long the inbound consumer waits for an ack before it delivers a message again. Short: a
# delivery the broker hands to a pull request of a connection that is dying never arrives, and
# only this wait brings it back. The daemon extends it for every message it holds
# (`InboundConsumer._keep_alive`), however long the job takes.
INBOUND_ACK_WAIT_S = 5.0
INBOUND_MAX_AGE_S = 30 * 24 * 3600
REFUSED_MAX_AGE_S = 30 * 24 * 3600


# What earlier versions kept and nothing uses any more: the state cache, a copy of each
# proposal's record that no decision read. `improved provision` removes it; the daemon never
# touches it.
RETIRED_BUCKETS = ("improved_state",)


def stream_configs(replicas: int = 1, records_storage: str = RECORDS_STORAGE
                   ) -> list[jsapi.StreamConfig]:
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


class Provisioning(Streams):
    """Streams, buckets and the inbound consumer brought to this configuration (`ensure`), or
    bound as they are (`bind`); it opens the buckets the rest of the store reads and writes."""

    js: JetStreamContext
    replicas: int
    records_storage: str
    move_records: bool = False  # `improved provision --move-records`: see `_records_storage`
    notes: list[str]  # what `ensure(strict=True)` found and left as it is: said, not changed
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
        self.notes = []
        for cfg in stream_configs(self.replicas, self.records_storage):
            if cfg.name == S.STREAM_RECORDS:
                cfg, note = await self._records_storage(cfg, strict)
                done += note
            done += await self._ensure_stream(cfg, strict)
        done += await self._ensure_consumer()
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

    async def _records_storage(self, cfg: jsapi.StreamConfig, strict: bool
                               ) -> tuple[jsapi.StreamConfig, list[str]]:
        """The records stream's config with the storage it is to have. A stream's storage is
        fixed when it is made, so an existing records stream keeps its own (one made on file
        storage before memory became the default, say), said in one line; with
        `move_records` (`improved provision --move-records`) it is removed and made again
        on the configured storage, and the daemon refills it from the chains (its refill
        marker went with it)."""
        have = await self._stream_config(S.STREAM_RECORDS)
        if have is None or have.storage == cfg.storage:
            return cfg, []
        was = jsapi.StorageType(have.storage or "file").value
        want = self.records_storage
        if strict and self.move_records:
            await self._change(f"stream {S.STREAM_RECORDS} is on {was} storage",
                               lambda: self.js.delete_stream(S.STREAM_RECORDS))
            return cfg, [f"removed stream {S.STREAM_RECORDS} ({was} storage) to make it again "
                         f"on {want}: the daemon refills its records from the chains"]
        note = (f"stream {S.STREAM_RECORDS} keeps its {was} storage (records_storage is "
                f"{want}; a stream's storage is fixed when it is made): `improved provision "
                f"--move-records` makes it again on {want}, and the daemon refills it")
        if strict:
            self.notes.append(note)
        else:
            log.info(note)
        return dataclasses.replace(cfg, storage=have.storage), []

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

    async def _bucket(self, name: str, what: str, done: list[str]) -> KeyValue:
        """Open a bucket, brought to the configured replicas (an R1 bucket of an earlier
        deployment becomes R3 when `replicas = 3`), or create it when missing."""
        try:
            kv = await self._look(f"bucket {name}", lambda: self.js.key_value(name))
        except BucketNotFoundError:
            kv = None
        if kv is not None:
            done += await self._bucket_replicas(name)
            return kv
        kv = await self._change(f"bucket {name} is missing", lambda: self.js.create_key_value(
            bucket=name, history=1, storage=jsapi.StorageType.FILE, replicas=self.replicas,
            description=f"improved: {what}"), raced=(10058,))
        if kv is None:  # another replica created it meanwhile
            return await self._look(f"bucket {name}", lambda: self.js.key_value(name))
        done.append(f"created bucket {name}")
        return kv

    async def _bucket_replicas(self, name: str) -> list[str]:
        """Update the stream under bucket `name` to the configured replicas if it has others;
        the rest of a bucket's settings are the KV layer's."""
        have = await self._stream_config(f"KV_{name}")
        if have is None or (have.num_replicas or 1) == self.replicas:
            return []
        change = f"replicas {have.num_replicas or 1} -> {self.replicas}"
        await self._change(f"bucket {name} differs from this configuration ({change})",
                           lambda: self.js.update_stream(have.evolve(num_replicas=self.replicas)))
        return [f"updated bucket {name} ({change})"]

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
        self.dedup, self.ledger = await self.existing_buckets()

    async def remove_retired(self) -> list[str]:
        """Delete the buckets earlier versions kept that nothing uses any more
        (RETIRED_BUCKETS), best effort: what was removed, and a line for each one that could
        not be (this user may not, say); one that is not there is left unsaid."""
        done = []
        for name in RETIRED_BUCKETS:
            try:
                await self.js.delete_key_value(name)
            except NotFoundError:
                continue
            except Exception as exc:  # best effort: it costs storage, never a decision
                why = ("JetStream did not answer: may this user delete it? deploy/accounts.conf "
                       "lets improved-admin" if isinstance(exc, TimeoutError | NatsTimeoutError)
                       else f"{type(exc).__name__}: {exc}")
                done.append(f"bucket {name} is no longer used and was not removed ({why})")
                continue
            done.append(f"removed bucket {name} (no longer used)")
        return done
