"""The last checkpoint the daemon keeps in its data directory, outside the audit stream, read.

A checkpoint on the audit stream proves nothing once the stream itself is gone or re-created:
the daemon also writes its last checkpoint (with the stream's creation time) and any crisis it
opened to `<data_dir>/last-checkpoint.json` (`runtime.anchor`), and compares the stream with it
at start and at every checkpoint (improved.core.checkpoint.prefix_problem); `audit verify`
compares it so too.
"""

from __future__ import annotations

import json
from pathlib import Path

from improved.core.checkpoint import Anchor, anchor_from

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
