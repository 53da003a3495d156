"""`improved console` run as an operator runs it: a subprocess on a free port of 127.0.0.1,
reading the test broker, trusting the test daemons' key (so a chain can be `verified`), and —
given a key — signing as ALICE. Requests go through urllib, off the event loop (the session
daemon runs on it and must answer while a POST waits for its verdict)."""

from __future__ import annotations

import re
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from tests.cli import ENV, IMPROVED
from tests.keys import ALICE


def alice_pem(directory: Path) -> Path:
    path = directory / "alice.pem"
    path.write_bytes(ALICE[1].private_bytes(serialization.Encoding.PEM,
                                            serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
    return path


@contextmanager
def running(nats_url: str, directory: Path, checkpoint_key: Path | None,
            *extra: str) -> Iterator[str]:
    """The console's base URL (`http://127.0.0.1:PORT/`) while it runs; stopped (SIGTERM)
    after, and it must exit 0. Its log goes to `directory/console.log`."""
    config = directory / "console.toml"
    config.write_text(f'data_dir = "{directory / "data"}"\n'
                      + (f'checkpoint_key = "{checkpoint_key}"\n' if checkpoint_key else ""))
    log = (directory / "console.log").open("w")
    proc = subprocess.Popen([*IMPROVED, "console", "--nats", nats_url, "--config", str(config),
                             "--port", "0", *extra], stdout=subprocess.PIPE, stderr=log,
                            text=True, env=ENV, cwd=directory)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        found = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert found, f"no console URL in {line!r}: {(directory / 'console.log').read_text()}"
        yield found.group(0)
    finally:
        proc.terminate()
        code = proc.wait(15)
        log.close()
    assert code == 0, (directory / "console.log").read_text()


def fetch(url: str, form: dict[str, str] | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, str]:
    """GET (or POST `form`) and the status and body, an error status included."""
    data = urllib.parse.urlencode(form).encode() if form is not None else None
    request = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def csrf_of(html: str) -> str:
    found = re.search(r'name=csrf value="([^"]+)"', html)
    assert found, "no CSRF token in the page"
    return found.group(1)


def verdict_of(html: str, which: str) -> str:
    """The verdict word the audit page shows for `which` (`since` or `full`)."""
    found = re.search(rf'<p id={which} class="verdict [a-z]+">([A-Z ]+)</p>', html)
    assert found, f"no {which} verdict in the page"
    return found.group(1)
