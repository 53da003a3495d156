"""The reference mesh service that applies L0 changes: a ranking/config store in NATS KV.

It exists so the loop closes end to end, and to show what DESIGN §3.4 asks of an owning service:
validate proposal_data itself, apply each proposal id exactly once, answer a repeated order with
the first result while changing nothing, and hand back an inverse so the change can be undone.

Accepted proposal_data: `{"set": {"key": K, "value": scalar}}`, and `{"delete": K}` so that the
inverse this store hands out can itself be applied; the target is `rank:K`, `score:K`, `cache:K`
or `config:K`.

Exactly once, crash-safe. Per order:
1. read the key's current value and revision: the prior;
2. `create` the ledger entry for the proposal id (atomic, so a second order finds it);
3. write the value with `Nats-Expected-Last-Subject-Sequence` = the prior's revision and an
   `Improve-Proposal-Id` header: the write cannot clobber a change it did not see as prior, and
   it can be recognised later;
4. complete the ledger entry with the write's revision.
A repeated order whose entry is complete changes nothing and returns the stored result; it does
not re-assert the value, which would undo a later proposal on the same key. An entry left
incomplete (a crash, or a twin order in flight on another instance) is finished: first look for
our own write in the key's history (kept 64 deep), and only if there is none write now, against
the current revision.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import signal as signals
import sys
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import Header
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)

from improved import subjects as S
from improved.model import ApplyOrder, ApplyResult, Proposal, to_json

from .sdk import MeshClient, failed, serve_spec

log = structlog.get_logger("services.ranking_store")

SCHEMES = ("rank", "score", "cache", "config")
# `[A-Za-z0-9_.-]+` without empty dot-tokens, which NATS KV keys cannot have.
KEY_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
MAX_KEY = 256
MAX_TEXT = 4096
HISTORY = 64  # revisions kept per key: how far back a recovering order looks for its own write
ROUNDS = 8  # optimistic-concurrency rounds before an order gives up
PROVENANCE = "Improve-Proposal-Id"
CONNECT_S = 10.0
KV_OP = "KV-Operation"
WRONG_LAST_SEQUENCE = (10071, 10164)


class Refused(Exception):
    """The order is well formed but this store will not apply it; the text says why."""


class _Conflict(Exception):
    """Someone else moved the key or the ledger entry: read again and retry."""


@dataclass(frozen=True)
class Change:
    key: str
    op: str  # "set" | "delete"
    value: Any = None


def bucket_names(service: str) -> tuple[str, str]:
    """(values bucket, ledger bucket): `rank_<svc>` and `applies_<svc>`, `-` made `_`."""
    token = service.replace("-", "_")
    return f"rank_{token}", f"applies_{token}"


def _check_scalar(value: Any) -> None:
    if value is None:
        raise Refused("value null cannot be stored; remove a key with {\"delete\": key}")
    if isinstance(value, bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Refused("value must be a finite number")
        return
    if isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise Refused(f"a string value is limited to {MAX_TEXT} characters")
        return
    kind = "object" if isinstance(value, dict) else "array" if isinstance(value, list) else \
        type(value).__name__
    raise Refused(f"value must be a JSON scalar (string, number or boolean), not an {kind}")


def parse_change(proposal: Proposal) -> Change:
    """The one change a proposal asks of this store, or Refused naming what is wrong. Pure."""
    if proposal.proposal_cal is not None or proposal.proposal_edit is not None:
        raise Refused("this store applies proposal_data only, not proposal_cal or proposal_edit")
    scheme, _, rest = proposal.target_ref.partition(":")
    if scheme not in SCHEMES:
        raise Refused(f"unsupported target scheme {scheme + ':'!r}; this store applies "
                      + ", ".join(f"{s}:" for s in SCHEMES) + " targets")
    if len(rest) > MAX_KEY or not KEY_RE.match(rest):
        raise Refused(f"target key {rest!r} must match [A-Za-z0-9_.-]+ (dot-separated, no empty "
                      f"parts, at most {MAX_KEY} characters)")
    data = proposal.proposal_data
    if data is None:
        raise Refused('proposal_data is missing; expected {"set": {"key": ..., "value": ...}}')
    if set(data) == {"delete"}:
        key = data["delete"]
        if key != rest:
            raise Refused(f"delete key {key!r} does not match the target_ref's key {rest!r}")
        return Change(key=rest, op="delete")
    if set(data) != {"set"}:
        raise Refused('proposal_data must be {"set": {"key": ..., "value": ...}} (or '
                      f'{{"delete": key}}); got keys {sorted(data)}')
    body = data["set"]
    if not isinstance(body, dict) or set(body) != {"key", "value"}:
        got = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise Refused(f'proposal_data.set must be {{"key": ..., "value": ...}}; got {got}')
    key = body["key"]
    if key != rest:
        raise Refused(f"set key {key!r} does not match the target_ref's key {rest!r}")
    _check_scalar(body["value"])
    return Change(key=rest, op="set", value=body["value"])


def _conflicted(exc: Exception) -> bool:
    return isinstance(exc, KeyWrongLastSequenceError) or (
        isinstance(exc, APIError) and exc.err_code in WRONG_LAST_SEQUENCE)


class RankingStore:
    """Values in KV `rank_<svc>`, the per-proposal apply ledger in KV `applies_<svc>`."""

    def __init__(self, nc: Client, service: str):
        self.nc = nc
        self.service = service
        self.client = MeshClient(nc, service)
        self.js = nc.jetstream()
        self.values_bucket, self.ledger_bucket = bucket_names(service)
        self.values_stream = f"KV_{self.values_bucket}"
        self.applies = 0  # new value writes made by this instance (distinct proposals applied)
        self.orders = 0  # decoded ApplyOrders handled by this instance
        self.ledger = None
        self._subs: list[Subscription] = []

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self._bucket(self.values_bucket, HISTORY, "ranking store values")
        self.ledger = await self._bucket(self.ledger_bucket, 1,
                                         "ranking store apply ledger, one entry per proposal")
        self._subs.append(await self.client.serve_apply(self.apply))
        self._subs.append(await serve_spec(self.nc, self.service, self.capabilities()))
        log.info("ranking store ready", service=self.service,
                 subject=S.apply_request(self.service), bucket=self.values_bucket)

    async def stop(self) -> None:
        """Stop taking orders, finishing the one in hand."""
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.drain()
            except Exception as exc:  # already closed with the connection
                log.debug("subscription drain failed", error=str(exc))

    async def _bucket(self, name: str, history: int, description: str):
        try:
            return await self.js.key_value(name)
        except BucketNotFoundError:
            pass
        try:
            return await self.js.create_key_value(bucket=name, history=history, direct=True,
                                                  description=description)
        except APIError:  # created meanwhile by a twin instance
            return await self.js.key_value(name)

    def capabilities(self) -> dict[str, Any]:
        return {
            "service": self.service,
            "improve": True,
            "apply": S.apply_request(self.service),
            "schemes": [f"{s}:" for s in SCHEMES],
            "proposal_data": ['{"set": {"key": K, "value": scalar}}', '{"delete": K}'],
            "buckets": {"values": self.values_bucket, "ledger": self.ledger_bucket},
        }

    # -- reading -------------------------------------------------------------------------------

    def _subject(self, key: str) -> str:
        return f"$KV.{self.values_bucket}.{key}"

    async def _current(self, key: str) -> tuple[Any, int]:
        """(value or None, revision of the key's last message, 0 if it never had one)."""
        try:
            msg = await self.js.get_msg(self.values_stream, subject=self._subject(key),
                                        direct=True)
        except NotFoundError:
            return None, 0
        headers = msg.headers or {}
        if headers.get(KV_OP) in ("DEL", "PURGE") or "Nats-Marker-Reason" in headers:
            return None, msg.seq
        try:
            return msgspec.json.decode(msg.data or b"null"), msg.seq
        except msgspec.DecodeError:  # written by someone else, not JSON: report it as text
            return (msg.data or b"").decode(errors="replace"), msg.seq

    async def value(self, key: str) -> Any:
        """The key's current value, or None when it has none."""
        return (await self._current(key))[0]

    async def _entry(self, pid: str) -> tuple[dict[str, Any] | None, int]:
        try:
            entry = await self.ledger.get(pid)
        except KeyNotFoundError:
            return None, 0
        return msgspec.json.decode(entry.value), entry.revision

    async def apply_count(self, proposal_id: str) -> int:
        """1 when the ledger holds the proposal id, else 0."""
        return 1 if (await self._entry(proposal_id))[0] is not None else 0

    # -- applying ------------------------------------------------------------------------------

    async def apply(self, order: ApplyOrder) -> ApplyResult:
        """The ApplyOrder handler: validate, then apply exactly once (see the module doc)."""
        self.orders += 1
        pid = order.proposal_id
        if not S.ID_RE.match(pid):
            return failed(f"proposal_id {pid!r} is not a 64-char lowercase hex id")
        try:
            change = parse_change(order.proposal)
        except Refused as exc:
            log.info("apply refused", service=self.service, proposal_id=pid, reason=str(exc))
            return failed(str(exc))
        for _ in range(ROUNDS):
            try:
                return await self._apply_once(pid, change)
            except _Conflict:
                continue
            except NatsTimeout:  # a lost ack: the next round finds the write if it happened
                await asyncio.sleep(0.05)
        return failed(f"could not apply {change.key!r}: it kept changing or the store did not "
                      f"answer ({ROUNDS} attempts)")

    async def _apply_once(self, pid: str, change: Change) -> ApplyResult:
        entry, rev = await self._entry(pid)
        if entry is None:
            prior, prior_rev = await self._current(change.key)
            entry = {"key": change.key, "op": change.op, "value": change.value,
                     "prior": prior, "prior_rev": prior_rev, "revision": None,
                     "applied_id": None}
            rev = await self._ledger_write(pid, entry, 0)
            written = await self._write(pid, entry, prior_rev)
        elif entry["revision"] is not None:
            return self._result(entry)
        else:
            # Unfinished: read the key first, then look for our write, so a write of ours that
            # lands after the search fails the compare-and-set below instead of repeating.
            prior, prior_rev = await self._current(entry["key"])
            written = await self._own_write(pid, entry["key"], entry["prior_rev"])
            if written is None:
                if prior_rev != entry["prior_rev"]:
                    entry = {**entry, "prior": prior, "prior_rev": prior_rev}
                    rev = await self._ledger_write(pid, entry, rev)
                written = await self._write(pid, entry, prior_rev)
        entry = {**entry, "revision": written,
                 "applied_id": f"{self.values_bucket}:{entry['key']}@{written}"}
        await self._ledger_write(pid, entry, rev)
        return self._result(entry)

    async def _ledger_write(self, pid: str, entry: dict[str, Any], last: int) -> int:
        """Create (last=0) or compare-and-set the ledger entry; _Conflict if someone moved it."""
        try:
            if last == 0:
                return await self.ledger.create(pid, to_json(entry))
            return await self.ledger.update(pid, to_json(entry), last=last)
        except APIError as exc:
            if _conflicted(exc):
                raise _Conflict(pid) from exc
            raise

    async def _write(self, pid: str, entry: dict[str, Any], prior_rev: int) -> int:
        """The value write, only on top of `prior_rev`, tagged with the proposal id."""
        headers = {Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(prior_rev), PROVENANCE: pid}
        data = b""
        if entry["op"] == "delete":
            headers[KV_OP] = "DEL"
        else:
            data = to_json(entry["value"])
        try:
            ack = await self.js.publish(self._subject(entry["key"]), data, headers=headers,
                                        stream=self.values_stream)
        except APIError as exc:
            if _conflicted(exc):
                raise _Conflict(entry["key"]) from exc
            raise
        self.applies += 1
        log.info("applied", service=self.service, proposal_id=pid, key=entry["key"],
                 revision=ack.seq)
        return ack.seq

    async def _own_write(self, pid: str, key: str, after: int) -> int | None:
        """The revision of a write tagged `pid` on `key` after revision `after`, if any."""
        seq = after + 1
        for _ in range(HISTORY + 1):
            try:
                msg = await self.js.get_msg(self.values_stream, seq=seq,
                                            subject=self._subject(key), next=True, direct=True)
            except NotFoundError:
                return None
            if (msg.headers or {}).get(PROVENANCE) == pid:
                return msg.seq
            seq = msg.seq + 1
        return None

    def _result(self, entry: dict[str, Any]) -> ApplyResult:
        """The one result of a completed ledger entry: the same every time it is asked for."""
        key, prior = entry["key"], entry["prior"]
        inverse = {"delete": key} if prior is None else {"set": {"key": key, "value": prior}}
        return ApplyResult(ok=True, applied_id=entry["applied_id"], inverse=inverse,
                           rollbackable=True)


# -- standalone ---------------------------------------------------------------------------------


async def run(url: str, service: str) -> int:
    from improved import bus

    try:  # reconnects are forever once up, but a first connection that never comes is an error
        nc = await asyncio.wait_for(bus.connect(url, f"ranking-store-{service}"), CONNECT_S)
    except TimeoutError:
        raise bus.BusError(f"cannot reach NATS at {url} within {CONNECT_S:g}s") from None
    store = RankingStore(nc, service)
    await store.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signals.SIGTERM, signals.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"ranking store {service!r} serving {S.apply_request(service)} "
          f"(values in KV {store.values_bucket}); Ctrl-C stops", file=sys.stderr, flush=True)
    await stop.wait()
    await store.stop()
    await nc.drain()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.ranking_store",
        description="Reference mesh service: applies L0 rank:/score:/cache:/config: changes "
                    "ordered by improved into a NATS KV bucket, exactly once per proposal.")
    parser.add_argument("--nats", default="nats://127.0.0.1:4222", metavar="URL",
                        help="NATS server with JetStream (default: %(default)s)")
    parser.add_argument("--service", required=True, metavar="NAME",
                        help="the service name this store owns, [a-z][a-z0-9_-]{0,62}")
    args = parser.parse_args(argv)
    if not S.SERVICE_RE.match(args.service):
        parser.error(f"--service {args.service!r} must match {S.SERVICE_RE.pattern}")
    try:
        return asyncio.run(run(args.nats, args.service))
    except Exception as exc:  # BusError and friends: one line, not a traceback
        print(f"ranking store: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
