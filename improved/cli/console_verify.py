"""The console's full verify of the log: run only when an operator asks for it (it reads every
trailer, hours at a large history), in a thread of its own so that the pages keep answering,
one at a time, its progress (trailers read so far) and then its verdict kept for the audit
page to show."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from improved.cli.console_reads import Verified, anchored, hidden, private_paths, verdict_of
from improved.client.config import Config
from improved.client.connection import Target


@dataclass(frozen=True)
class Job:
    """The last full verify: not started, running (since when, trailers read so far) or done
    (its verdict, and how long it took)."""

    started: float | None = None  # wall clock, seconds
    read: int = 0
    finished: float | None = None
    result: Verified | None = None

    @property
    def running(self) -> bool:
        return self.started is not None and self.finished is None


# say(line) and watch(trailers read so far) → the verify's exit code
Run = Callable[[Callable[[str], None], Callable[[int], None]], int]


class FullVerify:
    """One full verify at a time; `start` while one runs starts nothing."""

    def __init__(self, run: Run, anchored: bool, paths: list[tuple[str, str]]):
        self._run, self._anchored, self._paths = run, anchored, paths
        self._lock = threading.Lock()
        self._job = Job()

    def state(self) -> Job:
        with self._lock:
            return self._job

    def start(self) -> bool:
        """Start a full verify unless one runs; whether this call started it."""
        with self._lock:
            if self._job.running:
                return False
            self._job = Job(started=time.time())
        threading.Thread(target=self._verify, name="improved-console-verify",
                         daemon=True).start()
        return True

    def _verify(self) -> None:
        lines: list[str] = []

        def say(line: str) -> None:
            lines.append(hidden(line, self._paths))

        def watch(read: int) -> None:
            with self._lock:
                self._job = replace(self._job, read=read)

        try:
            code = self._run(say, watch)
        except Exception as exc:  # the page says what stopped it; the console goes on
            code = 2
            say(f"could not run: {type(exc).__name__}: {exc}")
        with self._lock:
            self._job = replace(self._job, finished=time.time(),
                                result=Verified(verdict_of(code, self._anchored), code, lines))


def full_verify(url: Target, config: Config) -> FullVerify:
    """`improved audit verify` of the whole log (`audit.verify_log`), as the command runs it
    without arguments, watched as it reads (`checkpointing.watching`)."""

    def run(say: Callable[[str], None], watch: Callable[[int], None]) -> int:
        from improved.cli.audit import verify_log
        from improved.client.checkpointing import watching

        watching.set(watch)  # this thread's context, which asyncio.run's task copies
        return asyncio.run(verify_log(url, config, say, say))

    return FullVerify(run, anchored(config), private_paths(config))
