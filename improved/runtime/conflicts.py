"""Writes that hold only if nothing was written since the writer looked — a chain append at its
expected sequence, a KV create or update at its revision — and what losing that race looks
like: one set of JetStream answers, one exception per kind of write, and one pause before the
retry, so racing writers do not meet again.
"""

from __future__ import annotations

import asyncio
import random

from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

# The answers JetStream gives a publish whose expected last sequence (of the stream or of the
# subject: a chain append, a KV create or update) no longer holds: someone wrote first. A single
# server answers 10071 ("wrong last sequence: N"); a clustered stream also answers 10164 ("wrong
# last sequence", no number) to a write that finds another write to the same subject still in
# flight (nats-server's jetstream_batching.go checkMsgHeadersPreClusteredProposal). Both are a
# conflict: re-read and decide again. Every conflict check of the store uses this one set.
CONFLICT_CODES = frozenset({
    10071,  # JSStreamWrongLastSequenceErrF
    10164,  # JSStreamWrongLastSequenceConstantErr
})


def is_conflict(exc: BaseException) -> bool:
    """A JetStream answer that someone wrote first (CONFLICT_CODES), as nats-py raises it."""
    return isinstance(exc, KeyWrongLastSequenceError) or (
        isinstance(exc, APIError) and exc.err_code in CONFLICT_CODES)


async def kv_create(kv: KeyValue, key: str, value: bytes) -> int:
    """`kv.create`, with a conflict always raised as KeyWrongLastSequenceError. nats-py's
    create, answered a conflict, reads the key to tell a deleted key (which it then updates)
    from a live one; on a cluster that read can miss the write that won (still in flight, or
    served by a replica behind the leader) and raise KeyNotFoundError instead."""
    try:
        return await kv.create(key, value)
    except KeyNotFoundError as exc:
        raise KeyWrongLastSequenceError(description="wrong last sequence") from exc


class ChainConflict(Exception):
    """Someone appended to this chain since we read it."""


class ChainKeptMoving(RuntimeError):
    """Every attempt to extend a mesh chain lost the race to another writer."""


class StateConflict(Exception):
    """Someone updated the cached record since we read it."""


MAX_APPEND_ATTEMPTS = 8

# A clustered stream refuses a compare-and-set at once ("wrong last sequence") while another
# write to the same subject is still being replicated, before the winner is readable anywhere.
# Read again at once and every attempt may fall inside that window; so the n-th retry waits
# between half and all of CONFLICT_PAUSE_S * 2**n (at most CONFLICT_PAUSE_MAX_S): about 0.25 s
# over all attempts at the most, and the random half keeps racing writers from meeting again.
CONFLICT_PAUSE_S = 0.002
CONFLICT_PAUSE_MAX_S = 0.128


async def pause_after_conflict(attempt: int) -> None:
    """Wait before the retry that follows lost attempt number `attempt` (0 for the first)."""
    ceiling = min(CONFLICT_PAUSE_MAX_S, CONFLICT_PAUSE_S * 2 ** attempt)
    await asyncio.sleep(random.uniform(ceiling / 2, ceiling))
