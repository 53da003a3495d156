"""The wall clock every trailer, act and record of the shell is stamped with: epoch
milliseconds, read in one place so that the pure core is always handed `now`."""

from __future__ import annotations

import time


def now_ms() -> int:
    return time.time_ns() // 1_000_000
