"""The daemon's KV writes that hold only if nothing was written since the writer looked (a
create, an update at its revision), and what losing that race looks like. A chain append's
race and the pause before its retry are the client's (`improved.client.chain_writer`), as is
the set of JetStream answers that mean a lost race (`improved.client.streams.is_conflict`).
"""

from __future__ import annotations

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue


async def kv_create(kv: KeyValue, key: str, value: bytes) -> int:
    """`kv.create`, with a conflict always raised as KeyWrongLastSequenceError. nats-py's
    create, answered a conflict, reads the key to tell a deleted key (which it then updates)
    from a live one; on a cluster that read can miss the write that won (still in flight, or
    served by a replica behind the leader) and raise KeyNotFoundError instead."""
    try:
        return await kv.create(key, value)
    except KeyNotFoundError as exc:
        raise KeyWrongLastSequenceError(description="wrong last sequence") from exc


class StateConflict(Exception):
    """A compare-and-set on a bucket lost every attempt: the key kept changing under it."""
