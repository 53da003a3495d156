"""The `improved` command run as an operator runs it: a subprocess of this interpreter with no
config file from the environment, its output captured."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

IMPROVED = [sys.executable, "-m", "improved.cli"]
ENV = {**os.environ, "IMPROVED_CONFIG": ""}


def improved(*args: str, **kw) -> subprocess.CompletedProcess:
    """Run in a directory of its own unless told otherwise: the default data directory
    (`.improved`, where a daemon keeps its last checkpoint) must not be the work tree's."""
    kw.setdefault("cwd", tempfile.mkdtemp(prefix="improved-cli-"))
    return subprocess.run([*IMPROVED, *args], capture_output=True, text=True, timeout=60,
                          env=ENV, **kw)
