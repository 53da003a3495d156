"""Extending an audit chain: the commit point of every transition.

An append carries `Nats-Expected-Last-Subject-Sequence`, so a trailer joins the chain only if
nothing joined since the writer last looked: a redelivery, a restart or a second replica gets a
conflict instead of a duplicate trailer, re-reads the chain, and finds its transition already
made. The daemon's store appends so to the daemon's log; a tool runtime to its own chain on
the tool runtimes' audit stream (S.STREAM_TOOLS_AUDIT), with its own key.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.aio.client import Client
from nats.js.errors import APIError

from improved.client.acks import Acks
from improved.client.deployment import Deployment
from improved.client.streams import is_conflict
from improved.core import audit, evidence
from improved.core.audit import Draft
from improved.core.record import ChainHead
from improved.protocol import subjects as S
from improved.protocol.model import ChangeClass, Scope, Trailer, TrailerCommit, to_json


class ChainConflict(Exception):
    """Someone appended to this chain since we read it."""


class ChainKeptMoving(RuntimeError):
    """Every attempt to extend a mesh chain lost the race to another writer."""


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

# What to add to a mesh chain, decided from the chain as read: (sealed trailers so far, now) →
# the next draft, or None when there is nothing to add.
NextDraft = Callable[[list[tuple[int, dict[str, Any]]], int], Draft | None]


trailer_decoder = msgspec.json.Decoder(Trailer)
_commit_decoder = msgspec.json.Decoder(TrailerCommit)


def decode_trailer(body: dict[str, Any]) -> Trailer:
    """A trailer read as a raw JSON body (as the chain readers return them), typed."""
    return trailer_decoder.decode(to_json(body))


def trailers_of(data: bytes) -> list[Trailer]:
    """The trailers one message of an audit chain carries, typed, in order: a watcher's read
    of what was appended (msgspec.DecodeError for a message that is neither a trailer nor a
    commit). Nothing here is verified: a reader that decides verifies the chain."""
    if data.startswith(b'{"trailers":'):  # how a commit is written (`append_commit`)
        commit = _commit_decoder.decode(data)
        if len(commit.trailers) >= 2:
            return commit.trailers
    return [trailer_decoder.decode(data)]


class ChainWriter(Deployment):
    """Appends to the chains of one audit stream (`audit_stream`), each trailer signed with
    `signer` when there is one (a reader trusts a trailer no other key signed); reads them,
    and brings streams to their configuration, as a `Deployment` does."""

    def __init__(self, nc: Client, *, audit_stream: str = S.STREAM_AUDIT,
                 signer: Ed25519PrivateKey | None = None):
        # the stream the chains this writer appends to and reads live in: the daemon's log, or
        # the tool runtimes' (S.STREAM_TOOLS_AUDIT)
        super().__init__(nc, audit_stream=audit_stream)
        self.signer = signer
        self.acks = Acks(nc)  # the appends' acknowledgements, through one subscription
        self.written: set[str] = set()  # hashes appended (signed) since the last checkpoint

    async def append_to(self, subject: str, trailer: Trailer, expected_seq: int) -> int:
        """Append to the chain on `subject` only if its last trailer is at `expected_seq`,
        signed with the daemon's key (a reader trusts a trailer no other key signed)."""
        return await self.append_commit(subject, [trailer], expected_seq)

    async def append_commit(self, subject: str, trailers: list[Trailer],
                            expected_seq: int) -> int:
        """Append `trailers` (consecutive trailers of the chain on `subject`) in one message,
        only if the chain's last message is at `expected_seq`: one trailer as itself, several
        as a `TrailerCommit`. The last is signed with this writer's key, which vouches for the
        others through the hash links (`audit.covering`). The message's stream sequence,
        which every trailer of it shares."""
        if self.signer is not None:
            trailers = [*trailers[:-1], evidence.sign(trailers[-1], self.signer)]
        body = to_json(trailers[0] if len(trailers) == 1 else TrailerCommit(trailers=trailers))
        headers = {"Nats-Expected-Last-Subject-Sequence": str(expected_seq)}
        try:
            seq = await self.acks.publish(subject, body, headers=headers,
                                          stream=self.audit_stream)
        except APIError as exc:
            if is_conflict(exc):
                raise ChainConflict(subject) from exc
            raise
        if self.signer is not None:
            self.written.update(t.hash for t in trailers)
        return seq

    async def append_sealed(self, subject: str, chain_id: str, gate_class: ChangeClass,
                            scope: Scope,
                            next_draft: NextDraft, *, whole: bool = False,
                            clock: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
                            ) -> Trailer | None:
        """Extend a mesh chain (autonomy, checkpoints, grants) by one trailer: read its end (or,
        with `whole`, all of it), let `next_draft` decide, seal and append with the expected
        sequence; on a conflict read and decide again. The appended trailer, or None when
        `next_draft` had nothing to add; ChainKeptMoving when every attempt lost the race."""
        for attempt in range(MAX_APPEND_ATTEMPTS):
            if attempt:
                await pause_after_conflict(attempt - 1)
            if whole:
                chain = await self.read_chain_at(subject)
            else:
                seq, body = await self.chain_head(subject)
                chain = [(seq, body)] if body is not None else []
            now = clock()
            draft = next_draft(chain, now)
            if draft is None:
                return None
            last_seq, last = chain[-1] if chain else (0, None)
            head = ChainHead(length=last["seq"] + 1 if last else 0,
                             last_hash=last["hash"] if last else "", stream_seq=last_seq)
            trailer = audit.seal_next(draft, chain_id, head, gate_class, scope, now)
            try:
                await self.append_to(subject, trailer, last_seq)
            except ChainConflict:
                continue
            return trailer
        raise ChainKeptMoving(f"{subject}: still conflicting after {MAX_APPEND_ATTEMPTS} "
                              "attempts")
