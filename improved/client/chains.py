"""Reading audit chains as a party that must decide on them: the owning service checking that
an order was accepted, a skills store serving a skill under a grant, the daemon's own gate.

A service reads a chain through a consumer filtered on that chain alone (`read_sequenced`):
the request that creates it names the chain's subject, so a deployment can let a service read
its own chains and the grant chains and no other (deploy/accounts.conf); a message get or a
direct get from a sequence names only the stream. The daemon, allowed the whole stream, reads
from the stream leader (`read_from_leader`). Every chain is verified before it is believed.
The retained Grant record on `improve.grants.<name>.<sha256>` is an output for watchers: anyone
who can publish there can write one, so no decision reads it (`current_grant` reads the grant
chain instead)."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from improved.core.audit import Authenticity, trailers_in, verify_chain
from improved.core.authority import GrantActs, grant_acts, grant_as_of, grant_covers
from improved.protocol import subjects as S
from improved.protocol.model import Grant, Trailer

Sequenced = list[tuple[int, Any]]
ChainReader = Callable[[JetStreamContext, str], Awaitable[Sequenced]]
READ_TIMEOUT_S = 5.0  # for each trailer of a chain being read
CONSUMER_IDLE_S = 5.0  # the server drops a chain's consumer this long after nobody listens


class ChainUnread(Exception):
    """A chain could not be read whole (a delivery went missing): nothing may be decided on
    the part that arrived, since a chain's prefix verifies too."""


def _bodies(data: bytes | None) -> list[Any]:
    """The trailers' JSON bodies one message carries (a commit's several, `trailers_in`), or
    [None] for a message that is not JSON (verify_chain names it)."""
    try:
        return trailers_in(msgspec.json.decode(data or b""))
    except msgspec.DecodeError:
        return [None]


async def read_chain(js: JetStreamContext, subject: str) -> list[Any]:
    """Every trailer body on `subject` of the audit stream, in order; [] when there is none.
    A body that is not JSON is kept as None, so verify_chain names it."""
    return [body for _, body in await read_sequenced(js, subject)]


async def read_sequenced(js: JetStreamContext, subject: str, *,
                         stream: str = S.STREAM_AUDIT) -> Sequenced:
    """`read_chain` with each trailer's stream sequence, through a consumer of the audit stream
    (or `stream`: a tool runtime's chain is on S.STREAM_TOOLS_AUDIT) filtered on `subject`,
    made with `$JS.API.CONSUMER.CREATE.IMPROVE_AUDIT.<name>.<subject>` (the server refuses a
    configuration that filters anything else), which subject permissions can scope. The server may place the consumer on any replica of the stream; a replica is
    told of each commit at once, so it follows the leader within a round trip."""
    nc = js._nc  # the JetStream context's own connection: replies come to its inboxes
    inbox = await nc.subscribe(nc.new_inbox())
    try:
        try:
            info = await js.add_consumer(stream, ConsumerConfig(
                name=uuid.uuid4().hex, filter_subject=subject, deliver_subject=inbox.subject,
                deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, num_replicas=1,
                mem_storage=True, inactive_threshold=CONSUMER_IDLE_S))
        except NotFoundError:  # no audit stream at all
            return []
        bodies: Sequenced = []
        left, delivered = info.num_pending or 0, 0
        while left:
            msg = await inbox.next_msg(READ_TIMEOUT_S)
            meta = msg.metadata
            if meta.sequence.consumer != delivered + 1:
                raise ChainUnread(f"{subject}: delivery {meta.sequence.consumer} arrived after "
                                  f"{delivered}")
            delivered += 1
            bodies.extend((meta.sequence.stream, body) for body in _bodies(msg.data))
            left = meta.num_pending
        return bodies
    finally:
        await inbox.unsubscribe()


async def read_from_leader(js: JetStreamContext, subject: str) -> Sequenced:
    """`read_sequenced` by message gets from the stream leader, each the next trailer on
    `subject` from a sequence: for the daemon, whose user may read the whole stream."""
    bodies: Sequenced = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(S.STREAM_AUDIT, seq=seq, subject=subject, next=True)
        except NotFoundError:  # past the chain's end, or no audit stream at all
            return bodies
        seq = msg.seq or seq
        bodies.extend((seq, body) for body in _bodies(msg.data))
        seq += 1


def grant_chain_subject(identity: str | None) -> str | None:
    """The grant chain's subject of exactly `<name>:<sha256>`; None for a bad identity (a
    wildcard here would read several chains as one)."""
    if not identity or ":" not in identity:
        return None
    sha = identity.split(":", 1)[1]
    return S.grant_audit(sha) if S.ID_RE.match(sha) else None


def verified_acts(identity: str, chain: Sequenced, trust: Authenticity | None = None
                  ) -> GrantActs | None:
    """The grant and revoke acts on `chain` (the grant chain of `identity` as read, or a
    prefix of it), each with its stream sequence, once every trailer verified; None when it
    does not verify, () when it is empty."""
    if not chain:
        return ()
    bodies = [body for _, body in chain]
    seqs = [seq for seq, _ in chain]
    if verify_chain(identity.split(":", 1)[1], bodies, trust, seqs) is not None:
        return None
    try:
        trailers = [msgspec.convert(body, type=Trailer) for body in bodies]
    except msgspec.ValidationError:
        return None
    return grant_acts(trailers, seqs)


async def current_grant(js: JetStreamContext, identity: str | None,
                        trust: Authenticity | None = None,
                        read: ChainReader = read_sequenced) -> Grant | None:
    """The grant of exactly `<name>:<sha256>` as its chain says (its last grant or revoke
    act); None without a chain, for a chain that does not verify, or for a bad identity.
    With `trust` (the daemon's), every trailer must be a trusted daemon's and every act
    signed by an operator key trusted when it was recorded."""
    subject = grant_chain_subject(identity)
    if subject is None or identity is None:
        return None
    acts = verified_acts(identity, await read(js, subject), trust)
    grant = grant_as_of(acts) if acts else None
    return grant if grant is not None and grant.skill == identity else None


async def grant_active(js: JetStreamContext, identity: str | None, now_ms: int,
                       trust: Authenticity | None = None,
                       read: ChainReader = read_sequenced) -> bool:
    """An active, unexpired grant for exactly `identity`, on its verified chain."""
    grant = await current_grant(js, identity, trust, read)
    return grant is not None and identity is not None and grant_covers(grant, identity, now_ms)
