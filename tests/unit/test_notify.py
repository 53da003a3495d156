"""deploy/: the systemd notifications (READY, STATUS, STOPPING, the watchdog) to a datagram
socket standing in for systemd's."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import uuid
from contextlib import suppress

import pytest

from improved.runtime import notify


@pytest.fixture
def notify_socket(monkeypatch):
    """A datagram socket standing in for systemd's, its path in $NOTIFY_SOCKET. The directory
    is short on purpose: AF_UNIX paths are limited to 108 bytes."""
    directory = tempfile.mkdtemp(prefix="ntf")
    path = os.path.join(directory, "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2.0)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield sock
    sock.close()
    shutil.rmtree(directory, ignore_errors=True)


def drain(sock: socket.socket) -> list[bytes]:
    """Every datagram waiting on `sock`, without blocking."""
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096))
    except BlockingIOError:
        return out
    finally:
        sock.settimeout(2.0)


def test_notifications_arrive_as_datagrams(notify_socket):
    assert notify.ready() is True
    assert notify_socket.recv(4096) == b"READY=1"
    assert notify.status("draining 3 jobs\nthen stopping") is True
    assert notify_socket.recv(4096) == b"STATUS=draining 3 jobs then stopping"
    assert notify.watchdog() is True
    assert notify_socket.recv(4096) == b"WATCHDOG=1"
    assert notify.stopping() is True
    assert notify_socket.recv(4096) == b"STOPPING=1"
    assert notify.notify("READY=1\nSTATUS=up") is True
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=up"


def test_abstract_notify_socket(monkeypatch):
    name = f"improved-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2.0)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify.ready() is True
        assert sock.recv(4096) == b"READY=1"


def test_without_systemd_notifications_are_no_ops(monkeypatch, tmp_path):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.ready() is False
    assert notify.watchdog() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "relative/path")  # not an address systemd gives
    assert notify.ready() is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert notify.ready() is False  # an error is reported, never raised


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert notify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")  # WatchdogSec=30
    assert notify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert notify.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    for bad in ("0", "-5", "soon"):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        assert notify.watchdog_interval() is None


async def test_watchdog_loop_pings_only_while_healthy(notify_socket, monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "40000")  # an interval of 20 ms
    health = {"ok": True}

    def healthy() -> bool:
        if health["ok"] == "raise":
            raise RuntimeError("consumer task died")
        return health["ok"]

    task = asyncio.create_task(notify.watchdog_loop(healthy))
    try:
        await asyncio.sleep(0.15)
        first = drain(notify_socket)
        assert first.count(b"WATCHDOG=1") >= 3
        health["ok"] = False
        await asyncio.sleep(0.15)
        withheld = drain(notify_socket)
        # announced once in STATUS, and no ping after it (one may have left just before)
        said = withheld.index(b"STATUS=unhealthy: withholding the watchdog ping")
        assert b"WATCHDOG=1" not in withheld[said:]
        assert withheld.count(b"STATUS=unhealthy: withholding the watchdog ping") == 1
        health["ok"] = "raise"
        await asyncio.sleep(0.1)
        assert b"WATCHDOG=1" not in drain(notify_socket)
        health["ok"] = True
        await asyncio.sleep(0.15)
        back = drain(notify_socket)
        assert back.count(b"WATCHDOG=1") >= 3
        assert b"STATUS=healthy again" in back
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
    monkeypatch.delenv("WATCHDOG_USEC")
    await asyncio.wait_for(notify.watchdog_loop(lambda: True), 1.0)  # no watchdog: returns
