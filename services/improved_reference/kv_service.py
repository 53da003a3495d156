"""What the reference stores share: a NATS KV values bucket changed exactly once per proposal.

DESIGN §3.4 asks an owning service to apply each proposal id exactly once, answer a repeated
order with the first result while changing nothing, and survive a crash mid-apply. Per order:
1. read the key's current value and revision: the prior;
2. `create` the ledger entry for the proposal id (atomic, so a second order finds it);
3. write the value with `Nats-Expected-Last-Subject-Sequence` = the prior's revision and an
   `Improve-Proposal-Id` header: the write cannot clobber a change it did not see as prior, and
   it can be recognised later;
4. complete the ledger entry with the write's revision.
A repeated order whose entry is complete changes nothing and returns the stored result; it does
not re-assert the value, which would undo a later proposal on the same key. An entry left
incomplete (a crash, or a twin order in flight on another instance) is finished: first look for
our own write in the key's history (kept `HISTORY` deep), and only if there is none write now,
against the current revision.

A store subclasses `KVService` and supplies what is its own: `_change` (validation),
`_new_entry` (a ledger entry with at least `key`, `prior_rev` and `revision` None), `_write`,
`_result` and `capabilities`; it may override `_decode` and `_rebase`, and `_prepare_change`
when validating needs I/O (it runs before the ledger is touched; the default calls `_change`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal as signals
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, cast

import msgspec
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import Header
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from improved.client import acceptance, connection, credentials
from improved.client.config import DATA_DIR_ENV, state_dir
from improved.client.keys import load_key
from improved.client.sdk import MeshClient, Served, failed, serve_spec
from improved.core import gradient
from improved.protocol import subjects as S
from improved.protocol.model import (
    AnalyzerRef,
    ApplyOrder,
    ApplyResult,
    ChangeClass,
    Origin,
    Proposal,
    Summary,
    TriageDecision,
    to_json,
)

HISTORY = 64  # revisions kept per key: how far back a recovering order looks for its own write
ROUNDS = 8  # optimistic-concurrency rounds before an order gives up
PROVENANCE = "Improve-Proposal-Id"
KV_OP = "KV-Operation"
WRONG_LAST_SEQUENCE = (10071, 10164)
CONNECT_S = 10.0


class Refused(Exception):
    """The order is well formed but the store will not apply it; the text says why."""


class Conflict(Exception):
    """Someone else moved the key or the ledger entry: read again and retry."""


def _conflicted(exc: Exception) -> bool:
    return isinstance(exc, KeyWrongLastSequenceError) or (
        isinstance(exc, APIError) and exc.err_code in WRONG_LAST_SEQUENCE)


async def read_json(kv: KeyValue, key: str) -> tuple[Any, int]:
    """(the JSON value at `key` in the KV bucket `kv`, its revision), or (None, 0) if absent."""
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return None, 0
    return msgspec.json.decode(entry.value or b""), entry.revision or 0


class Keyed(Protocol):
    """What every store's change names: the key of the values bucket it writes."""

    @property
    def key(self) -> str: ...


C = TypeVar("C", bound=Keyed)


class KVService(Generic[C]):
    """Values in KV `bucket` (history `HISTORY`), the apply ledger in KV `ledger_bucket`; `C`
    is the store's change, what `_change` makes of an order."""

    KIND = "kv service"  # how logs and the command line name the store
    VALUES = "values"  # what the values bucket holds
    ledger: KeyValue  # the apply ledger, once `open`

    def __init__(self, nc: Client, service: str, bucket: str, ledger_bucket: str,
                 verify_acceptance: bool = False):
        self.nc = nc
        self.service = service
        # Check every order against the audit chain before applying (SPEC 09 conformance L2);
        # off, the store trusts the bus permissions: only the daemon may send it orders.
        self.verify_acceptance = verify_acceptance
        self.client = MeshClient(nc, service)
        self.key: Ed25519PrivateKey | None = None  # signs every answer (`use_key`)
        self.js = nc.jetstream()
        self.bucket, self.ledger_bucket = bucket, ledger_bucket
        self.stream = f"KV_{bucket}"
        self.applies = 0  # value writes made by this instance through apply
        self.orders = 0  # decoded ApplyOrders handled by this instance
        self.log = structlog.get_logger(type(self).__module__)
        self._subs: list[Served] = []

    def use_key(self, key: Ed25519PrivateKey | None) -> None:
        """Sign every answer to the daemon (ApplyResults, measurements, the spec) with `key`,
        the one the daemon's `[trust.signers]` binds to `service:<svc>`: on a bus without
        accounts only such answers are attributable to this store (improved.core.boundary).
        Before `start`."""
        self.key = key
        self.client.key = key

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.open()
        await self._serve()

    async def open(self) -> None:
        """The store's buckets, created if absent, without taking orders: a host that routes
        orders to `apply` itself (the bench) calls this instead of `start`."""
        await self._bucket(self.bucket, HISTORY, f"{self.KIND} {self.VALUES}")
        self.ledger = await self._bucket(self.ledger_bucket, 1,
                                         f"{self.KIND} apply ledger, one entry per proposal")

    async def _serve(self) -> None:
        self._subs.append(await self.client.serve_apply(self.apply))
        self._subs.append(await self.client.serve_conformance(self.sample, self.take_decision))
        self._subs.append(await serve_spec(self.nc, self.service, self.capabilities(),
                                           key=self.key))
        self.log.info(f"{self.KIND} ready", service=self.service,
                      subject=S.apply_request(self.service), bucket=self.bucket)

    async def stop(self) -> None:
        """Stop taking orders, finishing the one in hand."""
        subs, self._subs = self._subs, []
        await connection.drain_all(subs)

    async def _bucket(self, name: str, history: int, description: str) -> KeyValue:
        try:
            return await self.js.key_value(name)
        except BucketNotFoundError:
            pass
        try:
            return await self.js.create_key_value(bucket=name, history=history, direct=True,
                                                  description=description)
        except APIError:  # created meanwhile by a twin instance
            return await self.js.key_value(name)

    # -- reading -------------------------------------------------------------------------------

    def _subject(self, key: str) -> str:
        return f"$KV.{self.bucket}.{key}"

    async def _current(self, key: str) -> tuple[Any, int]:
        """(value, None when absent or deleted; revision of the key's last message, 0 if none)."""
        try:
            msg = await self.js.get_msg(self.stream, subject=self._subject(key), direct=True)
        except NotFoundError:
            return None, 0
        headers = msg.headers or {}
        if headers.get(KV_OP) in ("DEL", "PURGE") or "Nats-Marker-Reason" in headers:
            return None, msg.seq or 0
        return self._decode(msg.data or b"null"), msg.seq or 0

    @staticmethod
    def _decode(data: bytes) -> Any:
        try:
            return msgspec.json.decode(data)
        except msgspec.DecodeError:  # written by someone else, not JSON: report it as text
            return data.decode(errors="replace")

    async def apply_count(self, proposal_id: str) -> int:
        """1 when the ledger holds the proposal id, else 0."""
        return 1 if (await read_json(self.ledger, proposal_id))[0] is not None else 0

    # -- applying ------------------------------------------------------------------------------

    async def apply(self, order: ApplyOrder) -> ApplyResult:
        """The ApplyOrder handler: validate, then apply exactly once (see the module doc)."""
        self.orders += 1
        pid = order.proposal_id
        if not S.ID_RE.match(pid):
            return failed(f"proposal_id {pid!r} is not a 64-char lowercase hex id")
        try:
            change = await self._prepare_change(order)
            for _ in range(ROUNDS):
                try:
                    return await self._apply_once(pid, change)
                except Conflict:
                    continue
                except NatsTimeout:  # a lost ack: the next round finds the write if it happened
                    await asyncio.sleep(0.05)
        except Refused as exc:
            self.log.info("apply refused", service=self.service, proposal_id=pid,
                          reason=str(exc))
            return failed(str(exc))
        return failed(f"could not apply {change.key!r}: it kept changing or the store did not "
                      f"answer ({ROUNDS} attempts)")

    async def _prepare_change(self, order: ApplyOrder) -> C:
        """The change an order asks for, or Refused: `_change`, after the acceptance check when
        the store verifies acceptance (a store may add checks that need I/O)."""
        if self.verify_acceptance and not await self._applied(order.proposal_id):
            await self._check_accepted(order)
        return self._change(order)

    async def _check_accepted(self, order: ApplyOrder) -> None:
        """Refused (`not_accepted: …`) unless the audit chain shows the order was accepted."""
        refusal = await acceptance.check(self.js, order)
        if refusal is not None:
            raise Refused(refusal)

    async def _applied(self, pid: str) -> bool:
        """The ledger holds a finished apply of `pid`: a repeated order gets its result."""
        entry, _ = await read_json(self.ledger, pid)
        return entry is not None and entry.get("revision") is not None

    # -- what the conformance kit asks (SPEC 09 §9, L1) ------------------------------------------

    async def sample(self) -> Proposal:
        """The sample proposal `improved conformance` checks: one of the kind this store
        takes, at its first scheme's minimum class, as it would be published."""
        schemes = self.capabilities().get("schemes") or ["config:"]
        scheme = str(schemes[0]).rstrip(":")
        key = "conformance-sample"
        return Proposal(
            service=self.service, target_ref=f"{scheme}:{key}",
            change_class=cast("ChangeClass", gradient.min_class(scheme)),
            scope=gradient.implied_scope(scheme),
            origin=Origin(actor=f"{self.service}:conformance", service=self.service),
            analyzer=AnalyzerRef(id=f"{self.service}.conformance/1"),
            summary=Summary(template_id="conformance-sample", args={"key": key}),
            created_at=int(time.time() * 1000), **self.sample_body(key))

    def sample_body(self, key: str) -> dict[str, Any]:
        """The sample's body and what its class must carry (a store overrides it)."""
        return {"proposal_data": {"set": {"key": key, "value": 1}}}

    async def take_decision(self, decision: TriageDecision) -> None:
        """A triage decision on one of this store's proposals: noted (what the store would
        do with it — stop proposing what was rejected — is its analyzer's business); it
        moves nothing: only an accepted ApplyOrder does."""
        self.log.info("triage decision taken", service=self.service,
                      proposal_id=decision.proposal_id, verdict=decision.verdict,
                      cause=decision.cause)

    def surface(self) -> dict[str, Any]:
        """What every such store's `spec.get` opens with: its service, where orders go, the
        level it claims — L3 with the acceptance gate in the store (for a store holding no
        skills L3 does not apply; for the skills store it is TOFU by hash), L1 trusting the
        bus — and how acceptance is checked."""
        return {"service": self.service, "improve": True,
                "apply": S.apply_request(self.service),
                "conformance": "L3" if self.verify_acceptance else "L1",
                **self.acceptance_claim()}

    def acceptance_claim(self) -> dict[str, str]:
        """What `spec.get` says about the acceptance gate, for the capabilities."""
        if self.verify_acceptance:
            return {"acceptance": "verified on the audit chain"}
        return {"acceptance": f"trusted to the bus: only the daemon may publish "
                              f"{S.apply_request(self.service)}"}

    async def _apply_once(self, pid: str, change: C) -> ApplyResult:
        entry, rev = await read_json(self.ledger, pid)
        if entry is not None and entry["revision"] is not None:
            return self._result(entry)
        # Read the key before looking for our write, so a write of ours that lands after the
        # search fails the compare-and-set below instead of repeating.
        current, cur_rev = await self._current(change.key if entry is None else entry["key"])
        if entry is None:
            entry = self._new_entry(change, current, cur_rev)
            rev = await self._ledger_write(pid, entry, 0)
            written = await self._write(pid, entry, current, cur_rev)
        else:
            found = await self._own_write(pid, entry["key"], entry["prior_rev"])
            if found is None:
                rebased = self._rebase(entry, current, cur_rev)
                if rebased != entry:
                    entry, rev = rebased, await self._ledger_write(pid, rebased, rev)
                found = await self._write(pid, entry, current, cur_rev)
            written = found
        entry = {**entry, "revision": written}
        await self._ledger_write(pid, entry, rev)
        return self._result(entry)

    def _rebase(self, entry: dict[str, Any], current: Any, cur_rev: int) -> dict[str, Any]:
        """The unfinished entry to write against `cur_rev` (a store may record a new prior)."""
        return entry

    # -- what each store supplies ----------------------------------------------------------------

    def capabilities(self) -> dict[str, Any]:
        """What `spec.get` answers: `surface()` and what the store adds."""
        raise NotImplementedError

    def _change(self, order: ApplyOrder) -> C:
        """The change `order` asks for, or Refused."""
        raise NotImplementedError

    def _new_entry(self, change: C, current: Any, cur_rev: int) -> dict[str, Any]:
        """The ledger entry of `change` read against `current` at `cur_rev`: at least `key`,
        `prior_rev` and `revision` None."""
        raise NotImplementedError

    async def _write(self, pid: str, entry: dict[str, Any], current: Any, cur_rev: int) -> int:
        """Write what `entry` says on top of `cur_rev`; the write's revision."""
        raise NotImplementedError

    def _result(self, entry: dict[str, Any]) -> ApplyResult:
        """The ApplyResult a finished ledger entry answers."""
        raise NotImplementedError

    async def _ledger_write(self, pid: str, entry: dict[str, Any], last: int) -> int:
        """Create (last=0) or compare-and-set the ledger entry; Conflict if someone moved it."""
        try:
            if last == 0:
                return await self.ledger.create(pid, to_json(entry))
            return await self.ledger.update(pid, to_json(entry), last=last)
        except APIError as exc:
            if _conflicted(exc):
                raise Conflict(pid) from exc
            raise

    async def _publish(self, key: str, data: bytes, prior_rev: int, pid: str | None = None,
                       delete: bool = False) -> int:
        """A write to `key` only on top of `prior_rev`; tagged and counted when it applies `pid`."""
        headers: dict[str, str] = {Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(prior_rev)}
        if pid is not None:
            headers[PROVENANCE] = pid
        if delete:
            headers[KV_OP] = "DEL"
        try:
            ack = await self.js.publish(self._subject(key), data, headers=headers,
                                        stream=self.stream)
        except APIError as exc:
            if _conflicted(exc):
                raise Conflict(key) from exc
            raise
        if pid is not None:
            self.applies += 1
            self.log.info("applied", service=self.service, proposal_id=pid, key=key,
                          revision=ack.seq)
        return ack.seq

    async def _store(self, key: str, make: Callable[[Any], bytes | None]) -> bool:
        """Write `make(current value)` to `key` outside the loop (seeding, an import): no
        proposal, no ledger entry, compare-and-set on the revision read, read again on a
        conflict. `make` returning None writes nothing (False); RuntimeError if the key kept
        changing."""
        for _ in range(ROUNDS):
            current, rev = await self._current(key)
            data = make(current)
            if data is None:
                return False
            try:
                await self._publish(key, data, rev)
            except Conflict:
                continue
            return True
        raise RuntimeError(f"could not store {key!r}: it kept changing ({ROUNDS} attempts)")

    async def _own_write(self, pid: str, key: str, after: int) -> int | None:
        """The revision of a write tagged `pid` on `key` after revision `after`, if any."""
        seq = after + 1
        for _ in range(HISTORY + 1):
            try:
                msg = await self.js.get_msg(self.stream, seq=seq, subject=self._subject(key),
                                            next=True, direct=True)
            except NotFoundError:
                return None
            if (msg.headers or {}).get(PROVENANCE) == pid:
                return msg.seq
            seq = (msg.seq or seq) + 1
        return None


# -- standalone ---------------------------------------------------------------------------------


DEFAULT_URL = "nats://127.0.0.1:4222"

Setup = Callable[["KVService[Any]"], Awaitable[list[str]]]


class StoreClass(Protocol):
    """A KVService subclass as `run` and `main` take it: how it is named and made."""

    KIND: str
    VALUES: str

    def __call__(self, nc: Client, service: str, *,
                 verify_acceptance: bool = False) -> KVService[Any]: ...


async def run(cls: StoreClass, url: str | None, service: str,
              verify_acceptance: bool = False, setup: Setup | None = None,
              data_dir: Path | None = None, key_file: Path | None = None) -> int:
    """Serve `service` until SIGTERM or SIGINT; `setup` runs once the buckets are open,
    before the first order is taken, and returns lines to print (what it did). With
    `key_file` (the service's Ed25519 key) every answer to the daemon is signed."""
    key = load_key(key_file) if key_file is not None else None

    name = f"{cls.KIND.replace(' ', '-')}-{service}"
    # credentials from the URL or the IMPROVED_NATS_* files; else, on the server of
    # `data_dir` run with --accounts, the service's own user's there
    where = credentials.target(url, data_dir or default_data_dir(), f"svc-{service}",
                               default=DEFAULT_URL)
    try:  # reconnects are forever once up, but a first connection that never comes is an error
        nc = await asyncio.wait_for(connection.connect(where, name), CONNECT_S)
    except TimeoutError:
        raise connection.BusError(f"cannot reach NATS at {where.where} within {CONNECT_S:g}s") from None
    store = cls(nc, service, verify_acceptance=verify_acceptance)
    store.use_key(key)
    try:
        if setup is not None:
            await store.open()
            for line in await setup(store):
                print(f"{cls.KIND} {service!r}: {line}", file=sys.stderr, flush=True)
        await store.start()
    except BaseException:
        await connection.close(nc)
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signals.SIGTERM, signals.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"{cls.KIND} {service!r} serving {S.apply_request(service)} "
          f"({cls.VALUES} in KV {store.bucket}); Ctrl-C stops", file=sys.stderr, flush=True)
    await stop.wait()
    await store.stop()
    await nc.drain()
    return 0


def pairs(flag: str, given: list[str], shape: str,
          valid: Callable[[str], object] = bool) -> list[tuple[str, str]]:
    """Each `flag LEFT=RIGHT` argument split in two, or ValueError in one line naming the
    bad one (`shape` says what was expected, e.g. "NAME=FILE")."""
    out = []
    for item in given:
        left, sep, right = item.partition("=")
        if not sep or not left or not valid(left) or not right.strip():
            raise ValueError(f"{flag} {item!r}: expected {shape}")
        out.append((left, right))
    return out


def seed_texts(flag: str, given: list[str], shape: str = "NAME=FILE",
               valid: Callable[[str], object] = bool) -> dict[str, tuple[str, str]]:
    """`flag NAME=FILE` arguments: name → (file, its UTF-8 text); ValueError in one line."""
    seeds: dict[str, tuple[str, str]] = {}
    for name, path in pairs(flag, given, shape, valid):
        try:
            seeds[name] = (path, Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ValueError(f"{flag} {name}: cannot read {path} as UTF-8 text: {why}") from None
    return seeds


def default_data_dir() -> Path:
    """Where `improved run` keeps its data by default: $IMPROVED_DATA_DIR, else the per-user
    state directory, never the working directory."""
    return Path(os.environ[DATA_DIR_ENV]) if os.environ.get(DATA_DIR_ENV) else state_dir()


def parser(module: str, description: str) -> argparse.ArgumentParser:
    """The command line every reference store shares: --nats, --service, --verify-acceptance."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    p.add_argument("--nats", default=os.environ.get("IMPROVED_NATS_URL") or None,
                   metavar="URL",
                   help=f"NATS server with JetStream (default: $IMPROVED_NATS_URL, else the "
                        f"server running in --data-dir, else {DEFAULT_URL}); credentials from "
                        "IMPROVED_NATS_USER and IMPROVED_NATS_PASSWORD_FILE (or _TOKEN_FILE, "
                        "_CREDS_FILE, _TLS_*), else, on the server of --data-dir run with "
                        "--accounts, the user svc-<service>'s password file there")
    p.add_argument("--data-dir", metavar="DIR",
                   help="the data directory of `improved run` on this machine (default: "
                        "$IMPROVED_DATA_DIR, else $XDG_STATE_HOME/improved, i.e. "
                        "~/.local/state/improved)")
    p.add_argument("--service", required=True, metavar="NAME",
                   help="the service name this store owns, [a-z][a-z0-9_-]{0,62}")
    p.add_argument("--key", metavar="FILE",
                   help="sign every answer to the daemon with this Ed25519 key (PEM), the one "
                        "the daemon's [trust.signers] binds to service:<service> (`improved "
                        "keys new --signer service:NAME` makes one): on a bus without "
                        "accounts only signed answers are the store's own (its measurements, "
                        "its spec)")
    p.add_argument("--verify-acceptance", action="store_true",
                   help="refuse any order whose acceptance (operator approval, active "
                        "grant, quorum) is not on the audit chain, instead of trusting "
                        "the bus permissions (needs read access to IMPROVE_AUDIT)")
    return p


def main(cls: StoreClass, argv: list[str] | None, module: str, description: str,
         p: argparse.ArgumentParser | None = None,
         setup: Callable[[argparse.Namespace], Setup | None] | None = None) -> int:
    """Parse the shared command line (or `p`, built on `parser`), then serve; `setup(args)`
    gives what to do before serving (or None). Errors are one line, exit 2."""
    p = p or parser(module, description)
    args = p.parse_args(argv)
    if not S.SERVICE_RE.match(args.service):
        p.error(f"--service {args.service!r} must match {S.SERVICE_RE.pattern}")
    try:
        before = setup(args) if setup is not None else None
        return asyncio.run(run(cls, args.nats, args.service, args.verify_acceptance, before,
                               Path(args.data_dir) if args.data_dir else None,
                               Path(args.key) if args.key else None))
    except Exception as exc:  # BusError and friends: one line, not a traceback
        print(f"{cls.KIND}: {exc}", file=sys.stderr)
        return 2
