"""The reference L4 service: artefacts swapped atomically, with a last-known-good to go back to.

L4 changes (binaries, code, schemas) are the ones a mesh cannot afford to half-apply or to apply
without a way back (SPEC 09 §7). This store shows the contract: every artefact a proposal
touches must have a healthy last-known-good (LKG) before anything moves, new content must pass
its smoke test first, all artefacts swap in one compare-and-set write or none does, and the
inverse names the LKG versions so a rollback is just another (restore) proposal.

Storage (`<svc>` with `-` made `_`):
- Object Store `artefacts_<svc>`: content-addressed blobs, object name = hex SHA-256 of the
  content, so uploading the same content twice is harmless and a blob never changes.
- KV `artefacts_heads_<svc>` (history 64), one key `manifest` → `{"<name>": "sha256:<hex>"}`: the
  current, last-known-good version of every artefact. Changed exactly once per proposal by the
  ledger protocol of `services.kv_service` (ledger KV `artefacts_applies_<svc>`).

Accepted proposal_data, with `lkg` = `[{"artefact", "digest": "sha256:<new>", "smoke_test"}]`:
- `{"artefacts": {"<name>": "<new UTF-8 content>"}}`: a swap; `lkg` lists exactly these names.
- `{"restore": {"<name>": "sha256:<hex>"}}`: back to blobs the store holds (the inverse it hands
  out); `lkg` is optional here (the daemon's rollback proposal has none), and when given must
  name the same digests; its smoke tests then run on the restored content.
Every order is first checked against the public evidence that it was accepted
(`services.acceptance`). `<svc>.improve.lkg` answers the read-only pre-apply LKG check.
A `schema:` target's artefacts are JSON Schemas under `schema_gate`'s discipline: classified
against the store's own head, forward applied, backward refused, breaking only on an operator's
own approval, the revert to the current schema required; the class found is answered as the
ApplyResult's `schema_class`, and `<svc>.improve.classify` answers it for a pending proposal.

Supervised artefacts (SPEC 08 §6, SPEC 09 §7): an artefact given a runner (`run={name: command}`,
`--run NAME=COMMAND`) is materialised to a file of its own under the work directory and its
command kept running on it (restarted with backoff if it exits). A swap or restore touching it
is a success only once the new content has been started and came through the health window: the
process stayed up `health_window` seconds and the artefact's health command, if any, exited 0 at
the end of it. Otherwise the manifest goes back to the digests it held before (a compare-and-set
write tagged with the proposal id, like the swap), the runner restarts on that content, and the
order is answered ok=false naming the artefact, what failed and the digest it is back at. The
ledger entry records the verdict (`health`: pending → ok | failed, with the error and the
rollback's revision) before the answer, so a repeated order gets the same answer and an
interrupted one is finished rather than repeated.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from improved.client.sdk import failed
from improved.protocol import subjects as S
from improved.protocol.model import ApplyOrder, ApplyResult, Proposal, to_json
from improved_reference import kv_service, schema_gate
from improved_reference.artefact_blobs import NAME_RE, ArtefactBlobs, digest_of
from improved_reference.artefact_changes import KEY, Change, parse_lkg, restore_change
from improved_reference.kv_service import Conflict, KVService, Refused, read_json
from improved_reference.lkg_checks import RC_UNKNOWN, LkgChecks
from improved_reference.supervised_artefacts import HEALTH_WINDOW_S, SupervisedArtefacts, runners

__all__ = ["ArtefactStore", "Change", "bucket_names", "digest_of", "main", "run"]

SmokeTest = Callable[[bytes], int]
SCHEMES = ("binary:", "lkg:", "code:", "schema:")


def _nonempty(data: bytes) -> int:
    return 0 if data else 1


def _json(data: bytes) -> int:
    try:
        json.loads(data)
    except ValueError:
        return 1
    return 0


def _utf8(data: bytes) -> int:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return 1
    return 0


DEFAULT_SMOKE_TESTS: dict[str, SmokeTest] = {"nonempty": _nonempty, "json": _json,
                                             "utf8": _utf8,
                                             schema_gate.SMOKE_TEST: schema_gate.smoke}


def bucket_names(service: str) -> tuple[str, str, str]:
    """(object store, manifest KV, ledger KV) of a service, `-` made `_`."""
    token = service.replace("-", "_")
    return f"artefacts_{token}", f"artefacts_heads_{token}", f"artefacts_applies_{token}"


class ArtefactStore(KVService[Change]):
    """Blobs in Object Store `artefacts_<svc>`, the LKG manifest in KV `artefacts_heads_<svc>`,
    the per-proposal apply ledger in KV `artefacts_applies_<svc>`."""

    KIND = "artefact store"
    VALUES = "manifest"

    def __init__(self, nc: Client, service: str,
                 smoke_tests: Mapping[str, SmokeTest] | None = None,
                 verify_acceptance: bool = True, *, run: Mapping[str, str] | None = None,
                 health: Mapping[str, str] | None = None,
                 health_window: float = HEALTH_WINDOW_S, workdir: str | Path | None = None):
        """An L4 store always verifies acceptance; the flag exists for `kv_service.run`.
        `run`, `health`, `health_window` and `workdir` are `configure`'s."""
        self.objects_bucket, heads, ledger = bucket_names(service)
        super().__init__(nc, service, heads, ledger, verify_acceptance=True)
        self.smoke_tests: dict[str, SmokeTest] = {**DEFAULT_SMOKE_TESTS, **(smoke_tests or {})}
        self.blobs = ArtefactBlobs(self.js, self.objects_bucket, self.KIND)
        self.supervision = SupervisedArtefacts(self.blobs, self.manifest, service, self.log)
        self.lkg_checks = LkgChecks(self)
        self._settling = asyncio.Lock()  # one swap and its health window at a time
        self.configure(run, health, health_window, workdir)

    def configure(self, run: Mapping[str, str] | None, health: Mapping[str, str] | None = None,
                  health_window: float = HEALTH_WINDOW_S,
                  workdir: str | Path | None = None) -> None:
        """Before `start`: the runners of supervised artefacts (`SupervisedArtefacts.configure`)."""
        self.supervision.configure(run, health, health_window, workdir)

    async def open(self) -> None:
        """The blobs' Object Store and the manifest and ledger buckets, created if absent."""
        await self.blobs.open()
        await super().open()

    async def start(self) -> None:
        """Open, start every runner on its artefact's current content, then take orders."""
        await self.open()
        try:
            await self.supervision.start()
            await self._serve()
            await self.lkg_checks.subscribe()
        except BaseException:
            await self.supervision.stop()
            raise

    async def stop(self) -> None:
        """Stop taking orders (finishing the one in hand, its health window included), then
        every artefact's process."""
        await super().stop()
        async with self._settling:
            await self.supervision.stop()

    def capabilities(self) -> dict[str, Any]:
        return {
            "service": self.service,
            "improve": True,
            "conformance": "L4",
            "apply": S.apply_request(self.service),
            "lkg": S.lkg_request(self.service),
            "classify": S.classify_request(self.service),
            "schemes": list(SCHEMES),
            "proposal_data": ['{"artefacts": {name: "<UTF-8 content>"}}',
                              '{"restore": {name: "sha256:<hex>"}}'],
            **self.acceptance_claim(),
            "smoke_tests": sorted(self.smoke_tests),
            "schema": "JSON Schema: forward applied, backward refused, breaking on an "
                      "operator's own approval; the revert to the current schema required",
            "buckets": {"objects": self.objects_bucket, "manifest": self.bucket,
                        "ledger": self.ledger_bucket},
            # all or none: every artefact's version is this one value, written once per swap
            "window": {"bucket": self.bucket, "key": KEY},
        }

    def sample_body(self, key: str) -> dict[str, Any]:
        """An L4 swap of one artefact, with the `lkg` entry every L4 must carry."""
        content = "conformance sample"
        return {"proposal_data": {"artefacts": {key: content}},
                "lkg": [{"artefact": key, "digest": digest_of(content.encode()),
                         "smoke_test": "nonempty"}]}

    # -- reading -------------------------------------------------------------------------------

    async def manifest(self) -> dict[str, str]:
        """The current (last-known-good) digest of every artefact."""
        value = (await self._current(KEY))[0]
        return value if isinstance(value, dict) else {}

    async def blob(self, digest: str) -> bytes | None:
        """The content stored under `sha256:<hex>`, or None when missing or corrupt."""
        return await self.blobs.get(digest)

    async def content(self, name: str) -> bytes | None:
        """The current content of artefact `name`, or None when it has none (or it is corrupt)."""
        digest = (await self.manifest()).get(name)
        return None if digest is None else await self.blob(digest)

    def smoke(self, test_id: str, data: bytes) -> int:
        """The smoke test's return code on `data`: 0 healthy, 127 no such test."""
        test = self.smoke_tests.get(test_id)
        if test is None:
            return RC_UNKNOWN
        try:
            rc = test(data)
        except Exception as exc:
            self.log.info("smoke test raised", test=test_id, error=repr(exc))
            return 1
        return rc if isinstance(rc, int) else 1

    # -- seeding (the service author's, outside the loop) --------------------------------------

    async def seed(self, artefacts: dict[str, str]) -> dict[str, str]:
        """Install versions directly (initial LKGs): upload, then one manifest write."""
        digests = {name: await self.blobs.put(text.encode()) for name, text in artefacts.items()}
        for _ in range(kv_service.ROUNDS):
            current, rev = await self._current(KEY)
            base = current if isinstance(current, dict) else {}
            try:
                await self._publish(KEY, to_json({**base, **digests}), rev)
            except Conflict:
                continue
            running = self.supervision.artefacts
            for name in digests.keys() & running.keys():  # seeded while running
                await running[name].start(artefacts[name].encode(), digests[name])
            return digests
        raise RuntimeError("the manifest kept changing while seeding")

    async def seed_missing(self, artefacts: dict[str, str]) -> dict[str, tuple[str, bool]]:
        """`seed` the artefacts that have no last-known-good yet; the others are left as they
        are (a restart with the same --seed must not undo an applied swap). Each name's
        digest, and whether it was seeded now."""
        manifest = await self.manifest()
        missing = {name: text for name, text in artefacts.items() if name not in manifest}
        seeded = await self.seed(missing) if missing else {}
        return {name: (seeded[name], True) if name in seeded else (manifest[name], False)
                for name in artefacts}

    async def check_lkg(self, request: Any) -> dict[str, Any]:
        """The reply to a `<svc>.improve.lkg` request (read-only; `LkgChecks.check_lkg`)."""
        return await self.lkg_checks.check_lkg(request)

    # -- applying (the protocol is kv_service's) -----------------------------------------------

    async def _prepare_change(self, order: ApplyOrder) -> Change:
        """Acceptance, validation and blob uploads: everything before the one manifest write."""
        entry, _ = await read_json(self.ledger, order.proposal_id)
        if entry is not None and entry.get("revision") is not None:
            return Change(op=entry["op"], set=entry["set"])  # applied: the ledger answers
        await self._check_accepted(order)
        change = self.parse_change(order.proposal)
        manifest = await self.manifest()
        for name in change.set:
            prior = manifest.get(name)
            if prior is None:
                raise Refused(f"artefact {name}: no last-known-good to swap from; nothing "
                              f"{'swapped' if change.op == 'swap' else 'restored'}")
            if change.op == "swap" and not await self.blobs.has(prior):
                raise Refused(f"artefact {name}: its last-known-good blob {prior} is missing; "
                              "nothing swapped")
        if change.op == "restore":
            await self._check_restore(change, order.proposal)
        classes = await schema_gate.check(self, order, change, manifest)
        if classes is not None:
            change = dataclasses.replace(change, schema=classes)
        for data in change.blobs.values():  # before the manifest write, idempotent by address
            await self.blobs.put(data)
        return change

    def parse_change(self, proposal: Proposal) -> Change:
        """The swap or restore a proposal asks for, checked as far as needs no I/O."""
        if proposal.proposal_cal is not None or proposal.proposal_edit is not None:
            raise Refused("this store applies proposal_data only, not proposal_cal or "
                          "proposal_edit")
        data = proposal.proposal_data or {}
        if set(data) == {"artefacts"}:
            return self._swap(data["artefacts"], proposal.lkg)
        if set(data) == {"restore"}:
            return restore_change(data["restore"], proposal.lkg)
        raise Refused('proposal_data must be {"artefacts": {name: content}} or {"restore": '
                      f'{{name: "sha256:<hex>"}}}}; got keys {sorted(data)}')

    def _swap(self, artefacts: Any, lkg: Any) -> Change:
        if not isinstance(artefacts, dict) or not artefacts:
            raise Refused("proposal_data.artefacts must be a non-empty {name: content} object")
        entries = parse_lkg(lkg)
        if set(entries) != set(artefacts):
            raise Refused(f"lkg must list exactly the artefacts swapped: lkg has "
                          f"{sorted(entries)}, proposal_data has {sorted(artefacts)}")
        blobs: dict[str, bytes] = {}
        for name, entry in entries.items():
            text = artefacts[name]
            if not isinstance(text, str):
                raise Refused(f"artefact {name}: content must be UTF-8 text")
            blobs[name] = text.encode()
            if entry["digest"] != digest_of(blobs[name]):
                raise Refused(f"artefact {name}: digest mismatch")
        for name, entry in entries.items():
            rc = self.smoke(entry["smoke_test"], blobs[name])
            if rc != 0:
                raise Refused(f"artefact {name}: smoke test {entry['smoke_test']} failed "
                              f"(rc {rc}); nothing swapped")
        return Change(op="swap", set={n: digest_of(b) for n, b in blobs.items()}, blobs=blobs)

    async def _check_restore(self, change: Change, proposal: Proposal) -> None:
        entries = parse_lkg(proposal.lkg) if proposal.lkg is not None else {}
        for name, digest in change.set.items():
            data = await self.blob(digest)
            if data is None:
                raise Refused(f"artefact {name}: {digest} is not held (missing or corrupt); "
                              "nothing restored")
            if name in entries:
                rc = self.smoke(entries[name]["smoke_test"], data)
                if rc != 0:
                    raise Refused(f"artefact {name}: smoke test {entries[name]['smoke_test']} "
                                  f"failed (rc {rc}); nothing restored")

    def _new_entry(self, change: Change, current: Any, prior_rev: int) -> dict[str, Any]:
        entry: dict[str, Any] = {"key": KEY, "op": change.op, "set": change.set,
                                 "revision": None}
        if change.schema is not None:
            entry["schema"] = change.schema
        if self.supervision.artefacts.keys() & change.set.keys():
            entry["health"] = "pending"  # settled after the write, before the answer
        return self._rebase(entry, current, prior_rev)

    def _rebase(self, entry: dict[str, Any], current: Any, prior_rev: int) -> dict[str, Any]:
        manifest = current if isinstance(current, dict) else {}
        return {**entry, "prior": {n: manifest.get(n) for n in entry["set"]},
                "prior_rev": prior_rev}

    async def _write(self, pid: str, entry: dict[str, Any], current: Any, prior_rev: int) -> int:
        """The one atomic swap: the whole manifest, only on top of `prior_rev`."""
        manifest = current if isinstance(current, dict) else {}
        return await self._publish(KEY, to_json({**manifest, **entry["set"]}), prior_rev, pid)

    def _result(self, entry: dict[str, Any]) -> ApplyResult:
        if entry.get("health") == "failed" and entry.get("error"):
            return failed(entry["error"])
        prior = entry["prior"]
        rollbackable = all(isinstance(d, str) for d in prior.values())
        schema = entry.get("schema")
        return ApplyResult(ok=True, applied_id=f"{KEY}@{entry['revision']}",
                           inverse={"restore": prior} if rollbackable else None,
                           rollbackable=rollbackable,
                           schema_class=schema.get("class") if isinstance(schema, dict) else None)

    # -- the health window ---------------------------------------------------------------------

    async def apply(self, order: ApplyOrder) -> ApplyResult:
        """As `KVService.apply`; then, when the change touches a running artefact, its health
        window, and a rollback if it fails (see the module doc)."""
        if not self.supervision.artefacts:
            return await super().apply(order)
        async with self._settling:
            result = await super().apply(order)
            if not result.ok:
                return result
            for _ in range(kv_service.ROUNDS):
                entry, rev = await read_json(self.ledger, order.proposal_id)
                if entry is None or entry.get("revision") is None:
                    return result
                try:
                    return await self._settle(order.proposal_id, entry, rev, result)
                except Conflict:  # a twin instance settled it meanwhile: read its verdict
                    continue
        raise RuntimeError(f"the ledger entry of {order.proposal_id[:8]} kept changing")

    async def _settle(self, pid: str, entry: dict[str, Any], rev: int,
                      result: ApplyResult) -> ApplyResult:
        """The answer for an applied entry, taking its health verdict first if it has none."""
        if entry.get("health") == "pending":
            unhealthy = await self.supervision.health_of(entry)
            if unhealthy is None:
                await self._ledger_write(pid, {**entry, "health": "ok"}, rev)
                return result
            name, why = unhealthy
            entry = {**entry, "health": "failed", "failed": {"artefact": name, "why": why},
                     "error": None, "rollback_revision": None}
            rev = await self._ledger_write(pid, entry, rev)  # before the manifest moves back
        if entry.get("health") == "failed" and not entry.get("error"):
            return await self._roll_back(pid, entry, rev)
        return self._result(entry)

    async def _roll_back(self, pid: str, entry: dict[str, Any], rev: int) -> ApplyResult:
        """Put the manifest back to the entry's prior digests, run them, record the answer."""
        written = await self._write_back(pid, entry)
        name, why = entry["failed"]["artefact"], entry["failed"]["why"]
        head = f"artefact {name} unhealthy after the {entry['op']}: {why}"
        if written is None:
            error = f"{head}; not rolled back: the manifest has changed since"
        else:
            back = ", ".join(f"{n} is back at {d}" for n, d in entry["prior"].items())
            error = f"{head}; rolled back, {back}"
        manifest = await self.manifest()
        for n in entry["set"].keys() & self.supervision.artefacts.keys():
            await self.supervision.run_current(n, manifest)
        self.log.warning("unhealthy after apply", service=self.service, proposal_id=pid,
                         error=error, rollback_revision=written)
        entry = {**entry, "error": error, "rollback_revision": written}
        await self._ledger_write(pid, entry, rev)
        return self._result(entry)

    async def _write_back(self, pid: str, entry: dict[str, Any]) -> int | None:
        """The revision of the write putting `entry`'s prior digests back (made now, or found
        made before a crash), or None when the manifest no longer holds `entry`'s digests."""
        for _ in range(kv_service.ROUNDS):
            current, cur_rev = await self._current(KEY)  # read before the search, as in apply
            found = await self._own_write(pid, KEY, entry["revision"])
            if found is not None:
                return found
            manifest = current if isinstance(current, dict) else {}
            if any(manifest.get(n) != d for n, d in entry["set"].items()):
                return None
            try:
                return await self._publish(KEY, to_json({**manifest, **entry["prior"]}),
                                           cur_rev, pid)
            except Conflict:
                continue
        raise Conflict(KEY)


async def run(url: str, service: str) -> int:
    return await kv_service.run(ArtefactStore, url, service)


def _seeds(given: list[str]) -> dict[str, tuple[str, str]]:
    """--seed NAME=FILE, each: name → (file, its UTF-8 text); ValueError in one line."""
    return kv_service.seed_texts("--seed", given, f"NAME=FILE, NAME matching {NAME_RE.pattern}",
                                 NAME_RE.match)


def _commands(flag: str, given: list[str]) -> dict[str, str]:
    """--run / --health NAME=COMMAND, each: name → command; ValueError in one line."""
    commands: dict[str, str] = {}
    for item in given:
        name, sep, command = item.partition("=")
        if not sep or not NAME_RE.match(name) or not command.strip():
            raise ValueError(f"{flag} {item!r}: expected NAME=COMMAND, NAME matching "
                             f"{NAME_RE.pattern}")
        if name in commands:
            raise ValueError(f"{flag} {name}: given twice")
        commands[name] = command
    return commands


def _window(text: str) -> float:
    try:
        window = float(text)
    except ValueError:
        raise ValueError(f"--health-window {text!r}: expected seconds, e.g. 3 or 0.5") from None
    if not 0 < window <= 3600:  # also refuses nan
        raise ValueError(f"--health-window {text}: must be more than 0 and at most 3600 seconds")
    return window


def main(argv: list[str] | None = None) -> int:
    module = "improved_reference.artefact_store"
    description = ("Reference L4 mesh service: swaps artefacts (blobs in a NATS Object Store) "
                   "atomically, after smoke tests and against a last-known-good, exactly once "
                   "per proposal. It always verifies an order's acceptance on the audit chain.")
    p = kv_service.parser(module, description)
    p.add_argument("--seed", action="append", default=[], metavar="NAME=FILE",
                   help="before serving, install FILE's content (UTF-8 text) as artefact NAME's "
                        "first last-known-good, unless NAME has one already; repeat for each "
                        "artefact (a swap needs a last-known-good of every artefact it touches)")
    p.add_argument("--run", action="append", default=[], metavar="NAME=COMMAND",
                   help="keep COMMAND running on artefact NAME's current content, written to a "
                        "file whose path is in $ARTEFACT_PATH and replaces {path} in COMMAND "
                        "(shlex-split, no shell); a swap or restore of NAME then restarts it and "
                        "succeeds only after the health window, else it is rolled back to the "
                        "last-known-good. Repeat for each artefact")
    p.add_argument("--health", action="append", default=[], metavar="NAME=COMMAND",
                   help="also require COMMAND (same environment and {path}) to exit 0 at the end "
                        "of NAME's health window")
    p.add_argument("--health-window", default=str(HEALTH_WINDOW_S), metavar="S",
                   help=f"seconds a restarted artefact must stay up (default {HEALTH_WINDOW_S:g})")
    p.add_argument("--workdir", metavar="DIR",
                   help="where the artefacts' files are written (default: a temporary "
                        "directory, removed when the store stops)")

    def setup(args: argparse.Namespace) -> kv_service.Setup | None:
        seeds = _seeds(args.seed)
        run, health = _commands("--run", args.run), _commands("--health", args.health)
        window = _window(args.health_window)
        runners(run, health)  # refused here, in one line, before connecting
        if not seeds and not run:
            return None

        async def install(store: kv_service.KVService[Any]) -> list[str]:
            assert isinstance(store, ArtefactStore)
            store.configure(run, health, window, args.workdir)
            done = await store.seed_missing({name: text for name, (_, text) in seeds.items()})
            lines = [f"{name}: last-known-good {digest} seeded from {seeds[name][0]}" if new else
                     f"{name}: has a last-known-good already ({digest}); --seed left it"
                     for name, (digest, new) in done.items()]
            return lines + [f"{name}: runs {runner.command!r}"
                            + (f", checked by {runner.health!r}" if runner.health else "")
                            + f"; a swap needs {window:g}s healthy"
                            for name, runner in store.supervision.runners.items()]

        return install

    return kv_service.main(ArtefactStore, argv, module, description, p, setup)


if __name__ == "__main__":
    sys.exit(main())
