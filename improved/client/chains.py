"""Reading audit chains as a party that must decide on them: the owning service checking that
an order was accepted, a skills store serving a skill under a grant, the daemon's own gate.

Reads go to the stream leader (a direct get may answer from a lagging replica and miss a
revocation) and every chain is verified before it is believed. The retained Grant record on
`improve.grants.<name>.<sha256>` is an output for watchers: anyone who can publish there can
write one, so no decision reads it (`current_grant` reads the grant chain instead)."""

from __future__ import annotations

from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from improved.core.audit import Authenticity, verify_chain
from improved.core.authority import grant_covers, grant_state
from improved.protocol import subjects as S
from improved.protocol.model import Grant, Trailer


async def read_chain(js: JetStreamContext, subject: str) -> list[Any]:
    """Every trailer body on `subject` of the audit stream, in order; [] when there is none.
    A body that is not JSON is kept as None, so verify_chain names it."""
    return [body for _, body in await read_sequenced(js, subject)]


async def read_sequenced(js: JetStreamContext, subject: str) -> list[tuple[int, Any]]:
    """`read_chain` with each trailer's stream sequence."""
    bodies: list[tuple[int, Any]] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(S.STREAM_AUDIT, seq=seq, subject=subject, next=True)
        except NotFoundError:  # past the chain's end, or no audit stream at all
            return bodies
        seq = msg.seq or seq
        try:
            bodies.append((seq, msgspec.json.decode(msg.data or b"")))
        except msgspec.DecodeError:
            bodies.append((seq, None))
        seq += 1


async def current_grant(js: JetStreamContext, identity: str | None,
                        trust: Authenticity | None = None) -> Grant | None:
    """The grant of exactly `<name>:<sha256>` as its chain says (its last grant or revoke
    act); None without a chain, for a chain that does not verify, or for a bad identity.
    With `trust` (the daemon's), every trailer must be a trusted daemon's and every act
    signed by an operator key trusted when it was recorded."""
    if not identity or ":" not in identity:
        return None
    sha = identity.split(":", 1)[1]
    chain = await read_sequenced(js, S.grant_audit(sha))
    bodies = [body for _, body in chain]
    if not bodies or verify_chain(sha, bodies, trust, [seq for seq, _ in chain]) is not None:
        return None
    try:
        trailers = [msgspec.convert(body, type=Trailer) for body in bodies]
    except msgspec.ValidationError:
        return None
    grant = grant_state(trailers)
    return grant if grant is not None and grant.skill == identity else None


async def grant_active(js: JetStreamContext, identity: str | None, now_ms: int,
                       trust: Authenticity | None = None) -> bool:
    """An active, unexpired grant for exactly `identity`, on its verified chain."""
    grant = await current_grant(js, identity, trust)
    return grant is not None and identity is not None and grant_covers(grant, identity, now_ms)
