"""One pass at a time per proposal within this process: a pass, and a republish of the same
proposal, queue behind each other; the daemon's index checks wait for the passes in progress,
whose trailers' index writes come after them.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress


class ProposalLocks:
    """A lock per proposal id with a pass on it, gone when the last waiter leaves."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._waiters: dict[str, int] = {}

    def busy(self, pid: str) -> bool:
        """Whether a pass of this process is on `pid` now (it writes the indexes after)."""
        return pid in self._locks

    async def passes_done(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until every pass in progress now has ended, so that what
        their trailers moved is in the indexes too."""
        with suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(self._through(pid)
                                                    for pid in list(self._locks))), timeout_s)

    async def _through(self, pid: str) -> None:
        """Queue behind the passes on `pid` and let the next one go at once."""
        lock = self._locks.get(pid)
        if lock is None:
            return
        self._waiters[pid] += 1
        try:
            async with lock:
                pass
        finally:
            self._waiters[pid] -= 1
            if self._waiters[pid] == 0:
                del self._waiters[pid]
                del self._locks[pid]

    async def acquire(self, pid: str) -> asyncio.Lock:
        lock = self._locks.setdefault(pid, asyncio.Lock())
        self._waiters[pid] = self._waiters.get(pid, 0) + 1
        await lock.acquire()
        return lock

    def release(self, pid: str, lock: asyncio.Lock) -> None:
        lock.release()
        self._waiters[pid] -= 1
        if self._waiters[pid] == 0:
            del self._waiters[pid]
            del self._locks[pid]
