"""The `improved` command run as an operator runs it: a subprocess of this interpreter with no
config file from the environment, its output captured."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

IMPROVED = [sys.executable, "-m", "improved.cli"]
# no configuration file and no server from the environment: each test says what it uses
ENV = {**{k: v for k, v in os.environ.items() if k != "IMPROVED_NATS_URL"},
       "IMPROVED_CONFIG": ""}


def improved(*args: str, env: dict[str, str] | None = None,
             **kw) -> subprocess.CompletedProcess:
    """Run in a directory of its own unless told otherwise, removed afterwards, with `env`
    added to the suite's environment (tests/_hermetic.py: no data directory of the
    developer's is ever found)."""
    env = {**ENV, **(env or {})}
    if "cwd" in kw:
        return subprocess.run([*IMPROVED, *args], capture_output=True, text=True, timeout=60,
                              env=env, **kw)
    with tempfile.TemporaryDirectory(prefix="improved-cli-") as cwd:
        return subprocess.run([*IMPROVED, *args], capture_output=True, text=True, timeout=60,
                              env=env, cwd=cwd, **kw)


def decoy_data_dir(directory: Path) -> str:
    """A data directory of another deployment in `directory`: a daemon checkpoint key and
    the last checkpoint that daemon kept, of a stream created long ago. Its key id."""
    from improved.client import anchor, keys
    from improved.core import checkpoint, merkle, signing
    from improved.runtime import anchor as anchor_write

    key = keys.write_key(directory / "checkpoint.pem")
    keyid = signing.keyid_of(signing.raw_public(key.public_key()))
    anchor_write.write(anchor.path_in(directory), checkpoint.Anchor(
        "2020-01-01 00:00:00+00:00", 40, 40, merkle.root(()), keyid, 1_577_836_800_000))
    return keyid
