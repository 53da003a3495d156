"""The last checkpoint kept in the daemon's data directory, outside the audit stream, written.

Written atomically: a temporary file, fsync, rename, fsync of the directory. Where it lives and
how it is read are the client's (`improved.client.anchor`): the daemon and `audit verify`
read it the same way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from improved.core.checkpoint import Anchor, anchor_dict


def write(path: Path, anchor: Anchor) -> None:
    """Replace the anchor at `path` atomically (never a half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = json.dumps(anchor_dict(anchor), indent=2, sort_keys=True).encode() + b"\n"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
