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
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    DigestMismatchError,
    NotFoundError,
)

from improved.protocol import subjects as S
from improved.protocol.model import ApplyOrder, ApplyResult, Proposal, to_json
from improved_reference import kv_service
from improved_reference.kv_service import Conflict, KVService, Refused, read_json

SmokeTest = Callable[[bytes], int]
KEY = "manifest"
DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,127}$")
RC_UNKNOWN = 127  # no such smoke test, or no last-known-good
RC_CORRUPT = 126  # the LKG blob is missing or does not hash to its digest
BLOB_TIMEOUT_S = 10.0
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
                                             "utf8": _utf8}


def bucket_names(service: str) -> tuple[str, str, str]:
    """(object store, manifest KV, ledger KV) of a service, `-` made `_`."""
    token = service.replace("-", "_")
    return f"artefacts_{token}", f"artefacts_heads_{token}", f"artefacts_applies_{token}"


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Change:
    op: str  # "swap" | "restore"
    set: dict[str, str]  # name → the digest the manifest will hold
    blobs: dict[str, bytes] = field(default_factory=dict, compare=False)  # swap: new content
    key: str = KEY


def parse_lkg(lkg: Any) -> dict[str, dict[str, str]]:
    """`lkg` entries by artefact name, or Refused (ValueError for the LKG check)."""
    if not isinstance(lkg, list) or not lkg:
        raise Refused("lkg must be a non-empty list of {artefact, digest, smoke_test}")
    out: dict[str, dict[str, str]] = {}
    for entry in lkg:
        if not isinstance(entry, dict):
            raise Refused("every lkg entry must be an object {artefact, digest, smoke_test}")
        name, digest, smoke = entry.get("artefact"), entry.get("digest"), entry.get("smoke_test")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise Refused(f"lkg artefact {name!r} must match {NAME_RE.pattern}")
        if digest is not None and (not isinstance(digest, str) or not DIGEST_RE.match(digest)):
            raise Refused(f"lkg digest of {name} must be sha256:<64 lowercase hex>")
        if not isinstance(smoke, str) or not smoke:
            raise Refused(f"lkg entry {name} needs a smoke_test id")
        if name in out:
            raise Refused(f"artefact {name} is listed twice in lkg")
        out[name] = {"digest": digest, "smoke_test": smoke}
    return out


class ArtefactStore(KVService):
    """Blobs in Object Store `artefacts_<svc>`, the LKG manifest in KV `artefacts_heads_<svc>`,
    the per-proposal apply ledger in KV `artefacts_applies_<svc>`."""

    KIND = "artefact store"
    VALUES = "manifest"

    def __init__(self, nc: Client, service: str,
                 smoke_tests: Mapping[str, SmokeTest] | None = None,
                 verify_acceptance: bool = True):
        """An L4 store always verifies acceptance; the flag exists for `kv_service.run`."""
        self.objects_bucket, heads, ledger = bucket_names(service)
        super().__init__(nc, service, heads, ledger, verify_acceptance=True)
        self.smoke_tests: dict[str, SmokeTest] = {**DEFAULT_SMOKE_TESTS, **(smoke_tests or {})}
        self.objects = None

    async def open(self) -> None:
        """The blobs' Object Store and the manifest and ledger buckets, created if absent."""
        self.objects = await self._object_store()
        await super().open()

    async def start(self) -> None:
        await super().start()
        self._subs.append(await self.nc.subscribe(S.lkg_request(self.service),
                                                  queue=self.service, cb=self._on_lkg))

    async def _object_store(self):
        try:
            return await self.js.object_store(self.objects_bucket)
        except BucketNotFoundError:
            pass
        try:
            return await self.js.create_object_store(
                bucket=self.objects_bucket,
                description=f"{self.KIND} blobs, named by the SHA-256 of their content")
        except APIError:  # created meanwhile by a twin instance
            return await self.js.object_store(self.objects_bucket)

    def capabilities(self) -> dict[str, Any]:
        return {
            "service": self.service,
            "improve": True,
            "conformance": "L4",
            "apply": S.apply_request(self.service),
            "lkg": S.lkg_request(self.service),
            "schemes": list(SCHEMES),
            "proposal_data": ['{"artefacts": {name: "<UTF-8 content>"}}',
                              '{"restore": {name: "sha256:<hex>"}}'],
            **self.acceptance_claim(),
            "smoke_tests": sorted(self.smoke_tests),
            "buckets": {"objects": self.objects_bucket, "manifest": self.bucket,
                        "ledger": self.ledger_bucket},
        }

    # -- reading -------------------------------------------------------------------------------

    async def manifest(self) -> dict[str, str]:
        """The current (last-known-good) digest of every artefact."""
        value = (await self._current(KEY))[0]
        return value if isinstance(value, dict) else {}

    async def blob(self, digest: str) -> bytes | None:
        """The content stored under `sha256:<hex>`, or None when missing or corrupt."""
        m = DIGEST_RE.match(digest or "")
        if m is None:
            return None
        try:
            got = await asyncio.wait_for(self.objects.get(m.group(1)), BLOB_TIMEOUT_S)
        except (NotFoundError, DigestMismatchError):
            return None
        data = got.data or b""
        return data if digest_of(data) == digest else None

    async def content(self, name: str) -> bytes | None:
        """The current content of artefact `name`, or None when it has none (or it is corrupt)."""
        digest = (await self.manifest()).get(name)
        return None if digest is None else await self.blob(digest)

    async def _has_blob(self, digest: str) -> bool:
        try:
            await self.objects.get_info(DIGEST_RE.match(digest).group(1))
        except NotFoundError:
            return False
        return True

    async def _put_blob(self, data: bytes) -> str:
        """Upload `data` under its address unless it is there already; its digest."""
        digest = digest_of(data)
        if not await self._has_blob(digest):
            await self.objects.put(digest.removeprefix("sha256:"), data)
        return digest

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
        digests = {name: await self._put_blob(text.encode()) for name, text in artefacts.items()}
        for _ in range(kv_service.ROUNDS):
            current, rev = await self._current(KEY)
            base = current if isinstance(current, dict) else {}
            try:
                await self._publish(KEY, to_json({**base, **digests}), rev)
                return digests
            except Conflict:
                continue
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

    # -- the pre-apply LKG check ---------------------------------------------------------------

    async def check_lkg(self, request: Any) -> dict[str, Any]:
        """The reply to a `<svc>.improve.lkg` request (read-only)."""
        if not isinstance(request, dict) or not S.ID_RE.match(str(request.get("proposal_id"))):
            return _invalid("expected {\"proposal_id\": <64 hex>, \"lkg\": [...]}")
        try:
            entries = parse_lkg(request.get("lkg"))
        except Refused as exc:
            return _invalid(str(exc))
        manifest = await self.manifest()
        artefacts, errors = [], []
        for name, entry in entries.items():
            lkg_digest = manifest.get(name)
            if lkg_digest is None:
                rc = RC_UNKNOWN
                errors.append(f"no last-known-good for {name}")
            else:
                data = await self.blob(lkg_digest)
                if data is None:
                    rc = RC_CORRUPT
                    errors.append(f"{name}: LKG blob missing or corrupt")
                else:
                    rc = self.smoke(entry["smoke_test"], data)
                    if rc != 0:
                        errors.append(f"{name}: smoke test {entry['smoke_test']} failed on the "
                                      f"LKG (rc {rc})")
            artefacts.append({"artefact": name, "lkg_digest": lkg_digest,
                              "smoke_test": entry["smoke_test"], "rc": rc})
        reply: dict[str, Any] = {"ok": not errors, "artefacts": artefacts}
        if errors:
            reply["error"] = "; ".join(errors)
        return reply

    async def _on_lkg(self, msg: Msg) -> None:
        try:
            request = msgspec.json.decode(msg.data)
        except msgspec.DecodeError as exc:
            reply = _invalid(f"not JSON: {exc}")
        else:
            try:
                reply = await self.check_lkg(request)
            except Exception as exc:  # the store is briefly unreachable: say so, keep serving
                self.log.warning("lkg check failed", service=self.service, error=repr(exc))
                reply = {"error": {"code": "unavailable", "message": f"lkg check failed for "
                                   f"now: {type(exc).__name__}: {exc}"[:500]}}
        if msg.reply:
            try:
                await msg.respond(to_json(reply))
            except Exception as exc:
                self.log.warning("could not answer an lkg check", error=str(exc))

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
            if change.op == "swap" and not await self._has_blob(prior):
                raise Refused(f"artefact {name}: its last-known-good blob {prior} is missing; "
                              "nothing swapped")
        if change.op == "restore":
            await self._check_restore(change, order.proposal)
        for data in change.blobs.values():  # before the manifest write, idempotent by address
            await self._put_blob(data)
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
            return _restore(data["restore"], proposal.lkg)
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
        return self._rebase({"key": KEY, "op": change.op, "set": change.set, "revision": None},
                            current, prior_rev)

    def _rebase(self, entry: dict[str, Any], current: Any, prior_rev: int) -> dict[str, Any]:
        manifest = current if isinstance(current, dict) else {}
        return {**entry, "prior": {n: manifest.get(n) for n in entry["set"]},
                "prior_rev": prior_rev}

    async def _write(self, pid: str, entry: dict[str, Any], current: Any, prior_rev: int) -> int:
        """The one atomic swap: the whole manifest, only on top of `prior_rev`."""
        manifest = current if isinstance(current, dict) else {}
        return await self._publish(KEY, to_json({**manifest, **entry["set"]}), prior_rev, pid)

    def _result(self, entry: dict[str, Any]) -> ApplyResult:
        prior = entry["prior"]
        rollbackable = all(isinstance(d, str) for d in prior.values())
        return ApplyResult(ok=True, applied_id=f"{KEY}@{entry['revision']}",
                           inverse={"restore": prior} if rollbackable else None,
                           rollbackable=rollbackable)


def _restore(restore: Any, lkg: Any) -> Change:
    if not isinstance(restore, dict) or not restore:
        raise Refused('proposal_data.restore must be a non-empty {name: "sha256:<hex>"} object')
    for name, digest in restore.items():
        if not NAME_RE.match(name):
            raise Refused(f"artefact {name!r} must match {NAME_RE.pattern}")
        if not isinstance(digest, str) or not DIGEST_RE.match(digest):
            raise Refused(f"artefact {name}: restore digest must be sha256:<64 lowercase hex>")
    if lkg is not None:
        entries = parse_lkg(lkg)
        if set(entries) != set(restore) or any(entries[n]["digest"] not in (None, restore[n])
                                               for n in restore):
            raise Refused("lkg, when given for a restore, must name the restored artefacts "
                          "with the restored digests")
    return Change(op="restore", set=dict(restore))


def _invalid(message: str) -> dict[str, Any]:
    return {"error": {"code": "invalid_value", "message": message[:500]}}


async def run(url: str, service: str) -> int:
    return await kv_service.run(ArtefactStore, url, service)


def _seeds(given: list[str]) -> dict[str, tuple[str, str]]:
    """--seed NAME=FILE, each: name → (file, its UTF-8 text); ValueError in one line."""
    seeds: dict[str, tuple[str, str]] = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not NAME_RE.match(name) or not path:
            raise ValueError(f"--seed {item!r}: expected NAME=FILE, NAME matching "
                             f"{NAME_RE.pattern}")
        try:
            seeds[name] = (path, Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ValueError(f"--seed {name}: cannot read {path} as UTF-8 text: {why}") from None
    return seeds


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

    def setup(args) -> kv_service.Setup | None:
        seeds = _seeds(args.seed)
        if not seeds:
            return None

        async def install(store: kv_service.KVService) -> list[str]:
            assert isinstance(store, ArtefactStore)
            done = await store.seed_missing({name: text for name, (_, text) in seeds.items()})
            return [f"{name}: last-known-good {digest} seeded from {seeds[name][0]}" if new else
                    f"{name}: has a last-known-good already ({digest}); --seed left it"
                    for name, (digest, new) in done.items()]

        return install

    return kv_service.main(ArtefactStore, argv, module, description, p, setup)


if __name__ == "__main__":
    sys.exit(main())
