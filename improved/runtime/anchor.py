"""The last checkpoint kept in the daemon's data directory, outside the audit stream.

A checkpoint on the audit stream proves nothing once the stream itself is gone or re-created:
the daemon also writes its last checkpoint (with the stream's creation time) and any crisis it
opened to `<data_dir>/last-checkpoint.json`, and compares the stream with it at start and at
every checkpoint (improved.core.checkpoint.prefix_problem). Written atomically: a temporary
file, fsync, rename, fsync of the directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from improved.core.checkpoint import Anchor, anchor_dict, anchor_from

FILENAME = "last-checkpoint.json"


def path_in(data_dir: Path) -> Path:
    return Path(data_dir) / FILENAME


def read(path: Path) -> Anchor | None:
    """The anchor kept at `path`; None when there is none; ValueError when it cannot be read."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from exc
    try:
        return anchor_from(json.loads(text))
    except ValueError as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path}: {exc}") from exc


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
