"""Supervised artefacts (SPEC 08 §6, SPEC 09 §7): an artefact given a runner is written to a file
of its own under the work directory and its command kept running on it, restarted with backoff
if it exits; a swap touching it counts only once the new content came through the health window
(the rules in `artefact_store`'s docstring).

Apart from the artefact store because it is about processes, not the manifest: starting,
watching, checking and ending them, with the store deciding what content each runs.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from improved_reference.artefact_blobs import NAME_RE, ArtefactBlobs

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



class SupervisedArtefacts:
    """The runners of one store's artefacts, their files under `workdir`, their processes.
    Configured before the store starts; `manifest` is the store's read of what each artefact
    is now, `blobs` the content by digest."""

    def __init__(self, blobs: ArtefactBlobs, manifest: Callable[[], Awaitable[dict[str, str]]],
                 service: str, log: Any):
        self.blobs, self.manifest, self.service, self.log = blobs, manifest, service, log
        self.runners: dict[str, Runner] = {}
        self.health_window = HEALTH_WINDOW_S
        self.workdir: Path | None = None
        self.artefacts: dict[str, Supervised] = {}  # the running artefacts, once started
        self._workdir_given: Path | None = None

    def configure(self, run: Mapping[str, str] | None, health: Mapping[str, str] | None = None,
                  health_window: float = HEALTH_WINDOW_S,
                  workdir: str | Path | None = None) -> None:
        """Before `start`: run artefact NAME as `run[NAME]` (and check it with `health[NAME]`),
        its file under `workdir` (default: a temporary directory, removed on `stop`); a swap
        touching it succeeds only after `health_window` seconds healthy. ValueError in one
        line when a command or the window is not usable."""
        if self.artefacts:
            raise RuntimeError("configure the runners before the store starts")
        if not 0 < health_window <= 3600:
            raise ValueError(f"--health-window {health_window:g}: must be more than 0 and at "
                             "most 3600 seconds")
        self.runners = runners(run, health)
        self.health_window = health_window
        self._workdir_given = Path(workdir) if workdir is not None else None

    async def start(self) -> None:
        """Start every runner on its artefact's current content."""
        if not self.runners:
            return
        if self._workdir_given is not None:
            self._workdir_given.mkdir(parents=True, exist_ok=True)
            self.workdir = self._workdir_given
        else:
            token = self.service.replace("-", "_")
            self.workdir = Path(tempfile.mkdtemp(prefix=f"artefacts-{token}-"))
        self.artefacts = {name: Supervised(name, runner, self.workdir / name.replace("/", "%2F"),
                                            self.log.bind(service=self.service))
                           for name, runner in self.runners.items()}
        manifest = await self.manifest()
        for name in self.artefacts:
            await self.run_current(name, manifest)

    async def run_current(self, name: str, manifest: dict[str, str]) -> None:
        """(Re)start artefact `name` on the content `manifest` names, if the store holds it."""
        digest = manifest.get(name)
        data = None if digest is None else await self.blobs.get(digest)
        if digest is None or data is None:
            self.log.warning("artefact not started: no content yet" if digest is None else
                             "artefact not started: its content is missing or corrupt",
                             service=self.service, artefact=name, digest=digest)
            await self.artefacts[name].stop()
            return
        await self.artefacts[name].start(data, digest)

    async def stop(self) -> None:
        """No process left, and a temporary work directory removed."""
        supervised, self.artefacts = self.artefacts, {}
        for one in supervised.values():
            await one.stop()
        if self.workdir is not None and self._workdir_given is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir = None

    async def health_of(self, entry: dict[str, Any]) -> tuple[str, str] | None:
        """Restart the artefacts of `entry` that run on their new content and wait out the
        health window: None if all came through, else (the first that did not, what failed)."""
        watched = {n: d for n, d in entry["set"].items() if n in self.artefacts}
        if not watched:
            return None
        manifest = await self.manifest()
        if any(manifest.get(n) != d for n, d in entry["set"].items()):
            self.log.warning("the manifest moved on before the health window; not checked",
                             service=self.service, revision=entry["revision"])
            return None
        for name, digest in watched.items():
            data = await self.blobs.get(digest)
            if data is None:
                return name, f"its content {digest} is missing or corrupt"
            await self.artefacts[name].start(data, digest)
        verdicts = await asyncio.gather(*(self.artefacts[n].healthy(self.health_window)
                                          for n in watched))
        return next(((n, why) for n, why in zip(watched, verdicts, strict=True) if why), None)
