"""systemd service notifications (sd_notify), without a dependency.

Under `Type=notify` systemd waits for READY=1 before it calls the daemon started (so units
ordered after it start only once the loop consumes), shows STATUS= in `systemctl status`, and
with `WatchdogSec=` restarts the daemon when WATCHDOG=1 stops arriving, so a wedged daemon
(a stuck event loop, a dead consumer) is restarted instead of silently doing nothing.

Everything here is a no-op returning False when the process is not run by systemd
(`$NOTIFY_SOCKET` unset), so the same code runs on a laptop.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

import structlog

log = structlog.get_logger("improved.notify")


def _address(raw: str) -> str | None:
    """The socket address in `$NOTIFY_SOCKET`: a path, or an abstract name when it starts
    with `@` (the kernel spells those with a leading NUL). Other kinds (vsock:) are unused."""
    if raw.startswith("@"):
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None


def notify(state: str) -> bool:
    """Send one notification (`READY=1`, `STATUS=…`, newline-separated assignments) to the
    service manager; False when not under systemd or when the datagram could not be sent.

    Never raises: a notification is advice to the supervisor, never a reason to fail."""
    raw = os.environ.get("NOTIFY_SOCKET")
    if not raw:
        return False
    address = _address(raw)
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
        return True
    except OSError as exc:
        log.warning("systemd notification failed", socket=raw, error=str(exc))
        return False


def ready() -> bool:
    """The daemon consumes and serves: systemd may start what is ordered after it."""
    return notify("READY=1")


def stopping() -> bool:
    """Draining on SIGTERM: tells systemd the stop is underway (and not a hang)."""
    return notify("STOPPING=1")


def status(text: str) -> bool:
    """A one-line status for `systemctl status` (newlines would start a new assignment)."""
    return notify("STATUS=" + " ".join(text.splitlines()))


def watchdog() -> bool:
    """Proof of life; with WatchdogSec= systemd restarts the daemon when these stop."""
    return notify("WATCHDOG=1")


def watchdog_interval() -> float | None:
    """Seconds between pings: half of `$WATCHDOG_USEC` (sd_watchdog_enabled's advice, so one
    late ping is not fatal), or None when no watchdog is set for this process
    (`$WATCHDOG_PID`, when present, names the process it is meant for)."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        value = int(usec)
    except ValueError:
        return None
    if value <= 0:
        return None
    return value / 2 / 1_000_000


async def watchdog_loop(healthy: Callable[[], bool]) -> None:
    """Ping the watchdog every interval while `healthy()` says so; returns at once when no
    watchdog is configured. Cancel it to stop.

    Pings come from the event loop, so a blocked loop stops them by itself; `healthy()` adds
    what the loop cannot see (e.g. the consumer task died). An unhealthy tick skips its ping
    and says why in STATUS; if health does not return within WatchdogSec, systemd restarts
    the daemon. A `healthy()` that raises counts as unhealthy."""
    interval = watchdog_interval()
    if interval is None:
        return
    was_healthy = True
    while True:
        try:
            ok = bool(healthy())
        except Exception as exc:
            log.warning("health check raised; withholding the watchdog ping", error=str(exc))
            ok = False
        if ok:
            watchdog()
            if not was_healthy:
                status("healthy again")
        elif was_healthy:
            log.warning("unhealthy: withholding the watchdog ping", interval_s=interval)
            status("unhealthy: withholding the watchdog ping")
        was_healthy = ok
        await asyncio.sleep(interval)
