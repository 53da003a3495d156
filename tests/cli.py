"""The `improved` command run as an operator runs it: a subprocess of this interpreter with no
config file from the environment, its output captured."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

IMPROVED = [sys.executable, "-m", "improved.cli"]
# no configuration file and no server from the environment: each test says what it uses
ENV = {**{k: v for k, v in os.environ.items() if k != "IMPROVED_NATS_URL"},
       "IMPROVED_CONFIG": ""}


def improved(*args: str, **kw) -> subprocess.CompletedProcess:
    """Run in a directory of its own unless told otherwise, removed afterwards: the default
    data directory (`.improved`, where a daemon keeps its last checkpoint) must not be the
    work tree's."""
    if "cwd" in kw:
        return subprocess.run([*IMPROVED, *args], capture_output=True, text=True, timeout=60,
                              env=ENV, **kw)
    with tempfile.TemporaryDirectory(prefix="improved-cli-") as cwd:
        return subprocess.run([*IMPROVED, *args], capture_output=True, text=True, timeout=60,
                              env=ENV, cwd=cwd, **kw)
