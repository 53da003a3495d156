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

from improved.client.deployment import Deployment
from improved.core import breaker, evidence
from improved.core.checkpoint import CHECKPOINT_ID, Anchor, anchor_from
from improved.core.policy import POLICY_ID
from improved.protocol import subjects as S

FILENAME = "last-checkpoint.json"


# the chains a daemon signs at every start and checkpoint: who signed their heads wrote the log
DAEMON_CHAINS = (S.checkpoint_audit(CHECKPOINT_ID), S.autonomy_audit(breaker.AUTONOMY_ID),
                 S.policy_audit(POLICY_ID), S.trust_audit(evidence.TRUST_ID))


async def log_signers(store: Deployment) -> set[str]:
    """The daemon keys (ids) that signed the heads of the log's daemon chains, with a valid
    signature, trusted or not: whose log it is (`checkpoint.kept_elsewhere`). Four direct
    gets."""
    found = set()
    for subject in DAEMON_CHAINS:
        _, body = await store.chain_head(subject)
        keyid = evidence.signed_by(body) if body is not None else None
        if keyid is not None:
            found.add(keyid)
    return found


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
