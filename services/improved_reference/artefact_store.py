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
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    DigestMismatchError,
    NotFoundError,
)
from nats.js.object_store import ObjectStore

from improved.client.sdk import answer_bytes, failed
from improved.protocol import subjects as S
from improved.protocol.model import ApplyOrder, ApplyResult, ClassifyRequest, Proposal, to_json
from improved_reference import kv_service, schema_gate
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
                                             "utf8": _utf8,
                                             schema_gate.SMOKE_TEST: schema_gate.smoke}


def bucket_names(service: str) -> tuple[str, str, str]:
    """(object store, manifest KV, ledger KV) of a service, `-` made `_`."""
    token = service.replace("-", "_")
    return f"artefacts_{token}", f"artefacts_heads_{token}", f"artefacts_applies_{token}"


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# -- supervised artefacts ------------------------------------------------------------------------

HEALTH_WINDOW_S = 3.0  # how long a (re)started artefact must stay up before a swap is a success
HEALTH_COMMAND_S = 10.0  # a health command still running after this has failed
STOP_GRACE_S = 5.0  # SIGTERM to the process group, then SIGKILL after this
GROUP_GONE_POLLS = 100  # every 20 ms: how long a killed group may take to disappear
RESTART_MIN_S, RESTART_MAX_S = 1.0, 30.0  # backoff of restarts after an unexpected exit


@dataclass(frozen=True)
class Runner:
    """How an artefact runs: `command` and `health` are shlex-split, `{path}` in an argument
    is replaced by the artefact's file, which is also in $ARTEFACT_PATH."""
    command: str
    health: str | None = None


def runners(run: Mapping[str, str] | None, health: Mapping[str, str] | None) -> dict[str, Runner]:
    """The runners `run` and `health` (name → command each) describe; ValueError in one line."""
    run, health = dict(run or {}), dict(health or {})
    for name in health.keys() - run.keys():
        raise ValueError(f"--health {name}: artefact {name} has no --run command to check")
    out: dict[str, Runner] = {}
    for name, command in run.items():
        if not NAME_RE.match(name):
            raise ValueError(f"--run {name!r}: NAME must match {NAME_RE.pattern}")
        for flag, text in (("--run", command), ("--health", health.get(name))):
            if text is None:
                continue
            try:
                argv = shlex.split(text)
            except ValueError as exc:
                raise ValueError(f"{flag} {name}: cannot split {text!r}: {exc}") from None
            if not argv:
                raise ValueError(f"{flag} {name}: the command is empty")
        out[name] = Runner(command, health.get(name))
    return out


def _exit(rc: int) -> str:
    if rc >= 0:
        return f"code {rc}"
    try:
        return f"signal {signal.Signals(-rc).name}"
    except ValueError:
        return f"signal {-rc}"


def _killpg(pgid: int, sig: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _end(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM to the process's group, SIGKILL after the grace period; then SIGKILL to whatever
    is left of the group (a child the artefact started), the process reaped, and a moment given
    for the rest of the group to be gone."""
    if proc.returncode is None:
        _killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        except TimeoutError:
            pass
    _killpg(proc.pid, signal.SIGKILL)
    await proc.wait()
    for _ in range(GROUP_GONE_POLLS):
        if not _group_alive(proc.pid):
            return
        await asyncio.sleep(0.02)


def _group_alive(pgid: int) -> bool:
    """A process of group `pgid` still runs (a zombie, dead and waiting for its reaper, does
    not count); where there is no /proc, any member counts."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != "Z" and fields[2] == str(pgid):
            return True
    return False


class Supervised:
    """One artefact's file and process: started on given content, kept running, checked."""

    def __init__(self, name: str, runner: Runner, path: Path, log: Any):
        self.name, self.runner, self.path, self.log = name, runner, path, log
        self.proc: asyncio.subprocess.Process | None = None
        self.digest: str | None = None  # the content now running
        self.spawn_error: str | None = None
        self.started_at = 0.0
        self._watch: asyncio.Task[None] | None = None
        self._probing = False  # a health window is open: an exit is its verdict, no restart

    def _env(self) -> dict[str, str]:
        return {**os.environ, "ARTEFACT_PATH": str(self.path), "ARTEFACT_NAME": self.name,
                "ARTEFACT_DIGEST": self.digest or ""}

    def _argv(self, command: str) -> list[str]:
        return [arg.replace("{path}", str(self.path)) for arg in shlex.split(command)]

    async def start(self, data: bytes, digest: str) -> None:
        """Stop what runs, write `data` as the artefact's file, start the command on it."""
        await self.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_bytes(data)
        os.replace(partial, self.path)
        self.digest = digest
        await self._spawn()
        self._watch = asyncio.create_task(self._keep_running())

    async def _spawn(self) -> None:
        self.started_at = asyncio.get_running_loop().time()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self._argv(self.runner.command), env=self._env(), cwd=self.path.parent,
                stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            self.proc, self.spawn_error = None, exc.strerror or str(exc)
            self.log.warning("artefact did not start", artefact=self.name,
                             error=self.spawn_error)
        else:
            self.spawn_error = None
            self.log.info("artefact started", artefact=self.name, digest=self.digest,
                          pid=self.proc.pid)

    async def _keep_running(self) -> None:
        delay = RESTART_MIN_S
        while True:
            if self.proc is not None:
                rc = await self.proc.wait()
                _killpg(self.proc.pid, signal.SIGKILL)  # what it left behind
                if self._probing:
                    return  # the health check reports it; the store decides what runs next
                up = asyncio.get_running_loop().time() - self.started_at
                delay = RESTART_MIN_S if up >= RESTART_MAX_S else delay
                self.log.warning("artefact exited; restarting", artefact=self.name,
                                 exit=_exit(rc), after_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESTART_MAX_S)
            await self._spawn()

    async def healthy(self, window: float) -> str | None:
        """None when the process stays up `window` seconds from its start and the health
        command, if any, exits 0 at the end of them; else what failed, in a few words."""
        if self.proc is None:
            return f"could not be started: {self.spawn_error}"
        proc, self._probing = self.proc, True
        try:
            remaining = self.started_at + window - asyncio.get_running_loop().time()
            try:
                rc = await asyncio.wait_for(proc.wait(), max(remaining, 0.001))
            except TimeoutError:
                pass
            else:
                return f"exited with {_exit(rc)} within the {window:g}s health window"
            failed = await self._health_command() if self.runner.health else None
            if proc.returncode is not None:
                return f"exited with {_exit(proc.returncode)} at the end of the health window"
            return failed
        finally:
            self._probing = False

    async def _health_command(self) -> str | None:
        assert self.runner.health is not None
        try:
            check = await asyncio.create_subprocess_exec(
                *self._argv(self.runner.health), env=self._env(), cwd=self.path.parent,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            return f"health command could not be started: {exc.strerror or exc}"
        try:
            out, _ = await asyncio.wait_for(check.communicate(), HEALTH_COMMAND_S)
        except TimeoutError:
            await _end(check)
            return f"health command did not exit within {HEALTH_COMMAND_S:g}s"
        finally:
            _killpg(check.pid, signal.SIGKILL)
        rc = check.returncode if check.returncode is not None else 1
        if rc != 0:
            self.log.info("health command failed", artefact=self.name, exit=_exit(rc),
                          output=out.decode(errors="replace")[-500:])
            return f"health command exited with {_exit(rc)}"
        return None

    async def stop(self) -> None:
        """No process left: the watch ended, the group terminated, the process reaped."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            with suppress(asyncio.CancelledError):
                await watch
        proc, self.proc = self.proc, None
        if proc is not None:
            await _end(proc)


@dataclass(frozen=True)
class Change:
    op: str  # "swap" | "restore"
    set: dict[str, str]  # name → the digest the manifest will hold
    blobs: dict[str, bytes] = field(default_factory=dict, compare=False)  # swap: new content
    key: str = KEY
    schema: dict[str, Any] | None = field(default=None, compare=False)  # a schema: change's class


class LkgEntry(TypedDict):
    """One entry of a proposal's `lkg`: the digest to check (None: the current one) and the
    smoke test to run on it."""

    digest: str | None
    smoke_test: str


def parse_lkg(lkg: Any) -> dict[str, LkgEntry]:
    """`lkg` entries by artefact name, or Refused (ValueError for the LKG check)."""
    if not isinstance(lkg, list) or not lkg:
        raise Refused("lkg must be a non-empty list of {artefact, digest, smoke_test}")
    out: dict[str, LkgEntry] = {}
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


class ArtefactStore(KVService[Change]):
    """Blobs in Object Store `artefacts_<svc>`, the LKG manifest in KV `artefacts_heads_<svc>`,
    the per-proposal apply ledger in KV `artefacts_applies_<svc>`."""

    KIND = "artefact store"
    VALUES = "manifest"
    objects: ObjectStore  # the blobs, once `open`

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
        self.runners: dict[str, Runner] = {}
        self.health_window = HEALTH_WINDOW_S
        self.workdir: Path | None = None
        self.supervised: dict[str, Supervised] = {}  # the running artefacts, once started
        self._workdir_given: Path | None = None
        self._settling = asyncio.Lock()  # one swap and its health window at a time
        self.configure(run, health, health_window, workdir)

    def configure(self, run: Mapping[str, str] | None, health: Mapping[str, str] | None = None,
                  health_window: float = HEALTH_WINDOW_S,
                  workdir: str | Path | None = None) -> None:
        """Before `start`: run artefact NAME as `run[NAME]` (and check it with `health[NAME]`),
        its file under `workdir` (default: a temporary directory, removed on `stop`); a swap
        touching it succeeds only after `health_window` seconds healthy. ValueError in one
        line when a command or the window is not usable."""
        if self.supervised:
            raise RuntimeError("configure the runners before the store starts")
        if not 0 < health_window <= 3600:
            raise ValueError(f"--health-window {health_window:g}: must be more than 0 and at "
                             "most 3600 seconds")
        self.runners = runners(run, health)
        self.health_window = health_window
        self._workdir_given = Path(workdir) if workdir is not None else None

    async def open(self) -> None:
        """The blobs' Object Store and the manifest and ledger buckets, created if absent."""
        self.objects = await self._object_store()
        await super().open()

    async def start(self) -> None:
        """Open, start every runner on its artefact's current content, then take orders."""
        await self.open()
        try:
            await self._start_runners()
            await self._serve()
            self._subs.append(await self.nc.subscribe(S.lkg_request(self.service),
                                                      queue=self.service, cb=self._on_lkg))
            self._subs.append(await self.nc.subscribe(S.classify_request(self.service),
                                                      queue=self.service,
                                                      cb=self._on_classify))
        except BaseException:
            await self._stop_runners()
            raise

    async def stop(self) -> None:
        """Stop taking orders (finishing the one in hand, its health window included), then
        every artefact's process."""
        await super().stop()
        async with self._settling:
            await self._stop_runners()

    # -- supervised artefacts ------------------------------------------------------------------

    async def _start_runners(self) -> None:
        if not self.runners:
            return
        if self._workdir_given is not None:
            self._workdir_given.mkdir(parents=True, exist_ok=True)
            self.workdir = self._workdir_given
        else:
            token = self.service.replace("-", "_")
            self.workdir = Path(tempfile.mkdtemp(prefix=f"artefacts-{token}-"))
        self.supervised = {name: Supervised(name, runner, self.workdir / name.replace("/", "%2F"),
                                            self.log.bind(service=self.service))
                           for name, runner in self.runners.items()}
        manifest = await self.manifest()
        for name in self.supervised:
            await self._run_current(name, manifest)

    async def _run_current(self, name: str, manifest: dict[str, str]) -> None:
        """(Re)start artefact `name` on the content `manifest` names, if the store holds it."""
        digest = manifest.get(name)
        data = None if digest is None else await self.blob(digest)
        if digest is None or data is None:
            self.log.warning("artefact not started: no content yet" if digest is None else
                             "artefact not started: its content is missing or corrupt",
                             service=self.service, artefact=name, digest=digest)
            await self.supervised[name].stop()
            return
        await self.supervised[name].start(data, digest)

    async def _stop_runners(self) -> None:
        supervised, self.supervised = self.supervised, {}
        for one in supervised.values():
            await one.stop()
        if self.workdir is not None and self._workdir_given is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir = None

    async def _object_store(self) -> ObjectStore:
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
        m = DIGEST_RE.match(digest)
        if m is None:  # names no blob
            return False
        try:
            await self.objects.get_info(m.group(1))
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
            except Conflict:
                continue
            for name in digests.keys() & self.supervised.keys():  # seeded while running
                await self.supervised[name].start(artefacts[name].encode(), digests[name])
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
        async def check(data: bytes) -> Any:
            try:
                request = msgspec.json.decode(data)
            except msgspec.DecodeError as exc:
                raise Refused(f"not JSON: {exc}") from None
            return await self.check_lkg(request)

        await self._answer(msg, "lkg check", check)

    # -- classifying a pending schema change ---------------------------------------------------

    async def _on_classify(self, msg: Msg) -> None:
        """`<svc>.improve.classify`: `{"proposal"}` → `{"class", "reason"}` (schema_gate), or
        an error reply in one line. Read only."""
        async def classify(data: bytes) -> Any:
            try:
                request = msgspec.json.decode(data, type=ClassifyRequest)
            except msgspec.MsgspecError as exc:
                raise Refused(f'expected {{"proposal": <a schema: proposal>}}: {exc}') from None
            return await schema_gate.classify(self, request.proposal)

        await self._answer(msg, "classify", classify)

    async def _answer(self, msg: Msg, what: str, work: Callable[[bytes], Awaitable[Any]]
                      ) -> None:
        """Answer a read-only request with `work`'s reply: a bad request (Refused) in one
        line; a store briefly unreachable says so and the subscription keeps serving."""
        reply: Any
        try:
            reply = await work(msg.data)
        except Refused as exc:
            reply = _invalid(str(exc))
        except Exception as exc:
            self.log.warning(f"{what} failed", service=self.service, error=repr(exc))
            reply = {"error": {"code": "unavailable", "message": f"{what} failed for "
                               f"now: {type(exc).__name__}: {exc}"[:500]}}
        if msg.reply:
            try:
                await msg.respond(answer_bytes(msg, to_json(reply), self.key))
            except Exception as exc:
                self.log.warning(f"could not answer a {what} request", error=str(exc))

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
        classes = await schema_gate.check(self, order, change, manifest)
        if classes is not None:
            change = dataclasses.replace(change, schema=classes)
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
        entry: dict[str, Any] = {"key": KEY, "op": change.op, "set": change.set,
                                 "revision": None}
        if change.schema is not None:
            entry["schema"] = change.schema
        if self.supervised.keys() & change.set.keys():
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
        if not self.supervised:
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
            unhealthy = await self._health_of(entry)
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

    async def _health_of(self, entry: dict[str, Any]) -> tuple[str, str] | None:
        """Restart the artefacts of `entry` that run on their new content and wait out the
        health window: None if all came through, else (the first that did not, what failed)."""
        watched = {n: d for n, d in entry["set"].items() if n in self.supervised}
        if not watched:
            return None
        manifest = await self.manifest()
        if any(manifest.get(n) != d for n, d in entry["set"].items()):
            self.log.warning("the manifest moved on before the health window; not checked",
                             service=self.service, revision=entry["revision"])
            return None
        for name, digest in watched.items():
            data = await self.blob(digest)
            if data is None:
                return name, f"its content {digest} is missing or corrupt"
            await self.supervised[name].start(data, digest)
        verdicts = await asyncio.gather(*(self.supervised[n].healthy(self.health_window)
                                          for n in watched))
        return next(((n, why) for n, why in zip(watched, verdicts, strict=True) if why), None)

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
        for n in entry["set"].keys() & self.supervised.keys():
            await self._run_current(n, manifest)
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
                            for name, runner in store.runners.items()]

        return install

    return kv_service.main(ArtefactStore, argv, module, description, p, setup)


if __name__ == "__main__":
    sys.exit(main())
