"""The KV buckets a pass reads and writes besides the chains: the dedup heads (the newest
proposal per dedup_key) and the rejection ledger. Each is a hint anyone on the bus could
write: a value that is no such entry reads as none (`decoded`), and the chain decides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import (
    APIError,
    KeyNotFoundError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from improved.client.acks import Acks, PendingAck
from improved.client.chain_writer import MAX_APPEND_ATTEMPTS, pause_after_conflict
from improved.client.streams import decoded, is_conflict
from improved.protocol import subjects as S
from improved.protocol.model import (
    DedupHead,
    LedgerEntry,
    to_json,
)
from improved.runtime.conflicts import StateConflict, kv_create

T = TypeVar("T")


@dataclass(frozen=True)
class Claim:
    """What a claim of a dedup key found and left: `before`, the head the key held before
    (None: none, or a value that is no head); `revision`, where the head naming the claimant
    stands (0: not known to this claim); `leased`, whether that head carries the TTL a closed
    proposal's head carries (`Buckets.claim_dedup_head`)."""

    before: DedupHead | None
    revision: int
    leased: bool

dedup_head_decoder = msgspec.json.Decoder(DedupHead)
ledger_entry_decoder = msgspec.json.Decoder(LedgerEntry)


class Buckets:
    """The dedup heads and the rejection ledger, opened by `Provisioning`."""

    js: JetStreamContext
    acks: Acks
    dedup: KeyValue
    ledger: KeyValue

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
        value that is no head: written over). With `absent` (the caller expects the key to be
        new) the create is tried first, without a read."""
        return (await self.claim_dedup_head(svc, dedup, pid, created_at, absent)).before

    async def claim_dedup_head(self, svc: str, dedup: str, pid: str, created_at: int,
                               absent: bool = False, lease_s: int = 0) -> Claim:
        """`set_dedup_head`, and where the head naming `pid` now stands: the revision this call
        wrote it at (0: it wrote nothing), which a later compare-and-set may start from
        without reading the key. With `lease_s` the create without a read (`absent`) gives the
        head that TTL already — a closed proposal's, so one that closes in the pass that
        claimed it needs no second write (`DedupHeads.after_pass`); a pass that leaves it open
        takes the TTL off (`keep_dedup_head`). When the key already names `pid` with a TTL (a claim
        whose pass never ended: a crash), that head is reported leased at its revision, so the
        pass takes it off as well if the proposal stays open."""
        own = DedupHead(proposal_id=pid, created_at=created_at)
        value = to_json(own)
        subject = f"$KV.{S.BUCKET_DEDUP}.{S.dedup_key_of(svc, dedup)}"
        if absent and lease_s:
            try:  # a KV create with the TTL, as nats-py publishes a create
                return Claim(None, await self.acks.publish(subject, value, ttl_s=lease_s, headers={
                    "Nats-Expected-Last-Subject-Sequence": "0"}), True)
            except APIError as exc:
                if not is_conflict(exc):
                    raise
                absent = False  # there is a key: read it

        def newest(current: bytes | None) -> tuple[bytes | None, DedupHead | None]:
            head = decoded(dedup_head_decoder, current)
            if head is None:
                return value, None
            if (head.created_at, head.proposal_id) >= (created_at, pid):
                return None, head
            return value, head

        before, written = await self.compare_and_set(self.dedup, S.BUCKET_DEDUP,
                                                     S.dedup_key_of(svc, dedup), newest,
                                                     absent=absent)
        if written or before != own or not lease_s:
            return Claim(before, written, False)
        try:  # the key names this very proposal already: does its head carry a TTL?
            msg = await self.js.get_msg(f"KV_{S.BUCKET_DEDUP}", subject=subject)
        except NotFoundError:
            return Claim(before, 0, False)
        leased = bool((msg.headers or {}).get("Nats-TTL")) and decoded(
            dedup_head_decoder, msg.data) == own
        return Claim(before, (msg.seq or 0) if leased else 0, leased)

    async def keep_dedup_head(self, svc: str, dedup: str, head: DedupHead,
                              revision: int) -> int:
        """Write `head` again under `dedup` without a TTL, compare-and-set at `revision` (where
        a leased claim put it): an open proposal's head stays for as long as it is open. The
        revision written, or 0 when the key moved since (a newer proposal's claim: theirs)."""
        try:
            return await self.acks.publish(
                f"$KV.{S.BUCKET_DEDUP}.{S.dedup_key_of(svc, dedup)}", to_json(head),
                headers={"Nats-Expected-Last-Subject-Sequence": str(revision)})
        except APIError as exc:
            if is_conflict(exc):
                return 0
            raise

    async def expire_dedup_head(self, svc: str, dedup: str, ttl_s: int,
                                may_expire: Callable[[DedupHead], bool],
                                written: tuple[int, DedupHead] | None = None) -> bool:
        """Write the head under `dedup` again, as it is, with the per-message TTL `ttl_s`
        (Nats-TTL: the server then removes the key, without a delete marker), when
        `may_expire(head)` says so and it carries no TTL yet; True when it was written. The
        write is a compare-and-set at the revision read (Nats-Expected-Last-Subject-Sequence),
        so a head written meanwhile (a newer proposal's claim) stays as written, and this one
        is left alone: not retried. `written`: (revision, head) as this process wrote it
        (`claim_dedup_head`), taken as the read: the key is as written unless the write
        conflicts, and then it is read. nats-py's KeyValue.update takes no TTL, so this
        publishes to the key's subject as that update does. Needs `dedup_ttl`."""
        stream = f"KV_{S.BUCKET_DEDUP}"
        subject = f"$KV.{S.BUCKET_DEDUP}.{S.dedup_key_of(svc, dedup)}"
        if written is not None and may_expire(written[1]):
            try:
                await self.acks.publish(subject, to_json(written[1]), ttl_s=ttl_s, headers={
                    "Nats-Expected-Last-Subject-Sequence": str(written[0])})
                return True
            except APIError as exc:
                if not is_conflict(exc):
                    raise  # written over since: read it, as without `written`
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
                              absent: bool = False) -> tuple[T, int]:
        """Read `key` (None when absent or deleted), let `decide` say what to write (None: write
        nothing) and what to return, and write it only if the key is still as read: created
        when it was absent, else updated at the revision read; (what `decide` returned, the
        revision written or 0 when nothing was). On a conflict read again and decide again,
        so `decide` must be pure. StateConflict when every attempt lost.
        With `absent` (the caller expects a new key) the create is tried without a read, one
        round trip instead of two; a conflict, or nothing to write, falls back to reading."""
        if absent:
            value, result = decide(None)
            if value is not None:
                try:  # a KV create, as nats-py publishes one
                    return result, await self.acks.publish(f"$KV.{bucket}.{key}", value, headers={
                        "Nats-Expected-Last-Subject-Sequence": "0"})
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
                return result, 0
            try:
                if current is None:
                    return result, await kv_create(kv, key, value)
                return result, await kv.update(key, value, last=revision)
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
        return await ledger_entry(await self.ledger_send(svc, dedup))

    async def ledger_send(self, svc: str, dedup: str) -> PendingAck:
        """`ledger_get` in two halves: the read leaves now, `ledger_entry` awaits it."""
        key = S.dedup_key_of(svc, dedup)
        return await self.acks.send_get(f"KV_{S.BUCKET_LEDGER}", f"$KV.{S.BUCKET_LEDGER}.{key}")


async def ledger_entry(pending: PendingAck) -> LedgerEntry | None:
    """The rejection-ledger entry a read sent by `Buckets.ledger_send` found."""
    found = await pending.stored()
    if found is None or found.headers.get("KV-Operation") in ("DEL", "PURGE"):
        return None
    return decoded(ledger_entry_decoder, found.data)
