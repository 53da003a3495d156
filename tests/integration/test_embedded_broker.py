"""`improved run` with its embedded nats-server refuses to start rather than share: a port
someone listens on, a data directory another nats-server holds (even one a killed daemon left
running) and a busy metrics port are one line and exit 2, before anything says "ready"."""

from __future__ import annotations

import os
import signal as signals
import socket
import subprocess
import time

from improved.runtime import bus
from tests.cli import ENV, IMPROVED, improved


def started(data_dir, port: int, *args: str) -> subprocess.Popen:
    daemon = subprocess.Popen([*IMPROVED, "run", "--data-dir", str(data_dir), "--port",
                               str(port), *args], stderr=subprocess.PIPE, text=True, env=ENV)
    assert daemon.stderr is not None
    while "ready as improved:" not in (line := daemon.stderr.readline()):
        assert line, "the daemon exited before it was ready"
    return daemon


def one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_taken_port_and_a_data_directory_in_use_are_refused(tmp_path):
    port = bus.free_port()
    first = started(tmp_path / "a", port)
    server_pid = (tmp_path / "a" / bus.EmbeddedServer.LOCK).read_text().strip()
    try:
        taken = one_line(improved("run", "--data-dir", str(tmp_path / "b"), "--port", str(port)))
        assert taken == (f"improved: port {port} is in use on 127.0.0.1 (another nats-server or "
                         f"daemon?): give another --port (or `port` in the config), or --nats "
                         f"nats://127.0.0.1:{port} to use the server already there")
        assert not (tmp_path / "b" / "jetstream").exists()  # no store was opened
        shared = one_line(improved("run", "--data-dir", str(tmp_path / "a"), "--port",
                                   str(bus.free_port())))
        assert shared == (f"improved: data directory {tmp_path / 'a'} is in use by another "
                          f"nats-server (pid {server_pid}): stop that daemon, or give this one "
                          "another --data-dir (or --nats URL to join the server already "
                          "running)")
        assert improved("status", "--nats", f"nats://127.0.0.1:{port}").returncode == 0

        # a daemon killed outright leaves its server running, and the directory still held
        first.kill()
        first.wait(10)
        again = one_line(improved("run", "--data-dir", str(tmp_path / "a"), "--port",
                                  str(bus.free_port())))
        assert f"in use by another nats-server (pid {server_pid})" in again
    finally:
        if first.poll() is None:
            first.send_signal(signals.SIGTERM)
            first.wait(30)
        os.kill(int(server_pid), signals.SIGTERM)  # the server the killed daemon started
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{server_pid}"):
            time.sleep(0.05)


def test_a_busy_metrics_port_stops_the_start_before_ready(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        mport = busy.getsockname()[1]
        done = improved("run", "--data-dir", str(tmp_path / "d"), "--port",
                        str(bus.free_port()), "--metrics-port", str(mport))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "ready as" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"improved: metrics port {mport} on 127.0.0.1 cannot be served (Address already in "
        "use): give another --metrics-port (or metrics_port in the config), or leave it out")
