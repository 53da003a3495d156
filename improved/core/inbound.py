"""What an inbound message says, decoded and validated before anything is kept or decided:
a bare or signed (DSSE) proposal, signal or review, and a signed act on a mesh subject. A
signature is not checked here, only found: the engine checks it against the trust in force.

Pure: bytes in, typed values (or a WireError naming what is wrong) out.
"""

from __future__ import annotations

import base64
import re

import msgspec

from improved.core import propose
from improved.protocol import subjects as S
from improved.protocol import wire
from improved.protocol.model import Envelope, Proposal, Signal

GRANT_SKILL_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}:[0-9a-f]{64}\Z")


def signed_act(data: bytes, limit: int) -> tuple[Envelope, dict[str, object]]:
    """A DSSE envelope and its (not yet verified) payload, to route it."""
    env = wire.decode(data, Envelope, limit)
    try:
        payload = msgspec.json.decode(base64.b64decode(env.payload, validate=True))
    except (ValueError, msgspec.MsgspecError):
        raise wire.WireError(wire.INVALID_VALUE, "the envelope's payload is not base64 JSON",
                             "payload") from None
    if not isinstance(payload, dict):
        raise wire.WireError(wire.INVALID_TYPE, "the signed payload is not an object", "payload")
    return env, payload


class _Probe(msgspec.Struct):
    payloadType: str | None = None  # noqa: N815 - DSSE field name


def unwrapped(data: bytes, limit: int) -> tuple[bytes, Envelope | None]:
    """A bare message's bytes, or a signed one's (a DSSE envelope): its payload's bytes and
    the envelope, whose signature the engine checks."""
    try:
        signed = msgspec.json.decode(data, type=_Probe).payloadType is not None
    except (msgspec.MsgspecError, RecursionError):
        signed = False  # the caller's decode names what is wrong with it
    if not signed:
        return data, None
    env = wire.decode(data, Envelope, limit)
    try:
        payload = base64.b64decode(env.payload, validate=True)
    except ValueError:
        raise wire.WireError(wire.INVALID_VALUE, "the envelope's payload is not base64",
                             "payload") from None
    return payload, env


def signal_of(data: bytes, limit: int) -> tuple[Signal, Envelope | None]:
    """A bare Signal, or a signed one (a DSSE envelope): its Signal and the envelope."""
    payload, env = unwrapped(data, limit)
    return wire.decode(payload, Signal, limit), env


def proposal_of(data: bytes, svc: str, limit: int) -> tuple[Proposal, Envelope | None]:
    """A bare Proposal, or a signed one (a DSSE envelope): the Proposal, validated against the
    subject's service `svc`, and the envelope."""
    payload, env = unwrapped(data, limit)
    return propose.validate(payload, svc, limit), env


def review_target(data: bytes, limit: int) -> tuple[Envelope | None, str]:
    """(envelope or None when unsigned, the proposal id the review names)."""
    try:
        env, payload = signed_act(data, limit)
        pid = payload.get("proposal_id")
    except wire.WireError as err:
        try:  # a bare, unsigned review still names its proposal: refuse it on that chain
            bare = msgspec.json.decode(data)
        except msgspec.MsgspecError:
            raise err from None
        if not (isinstance(bare, dict) and isinstance(bare.get("proposal_id"), str)):
            raise err from None
        env, pid = None, bare["proposal_id"]
    if not isinstance(pid, str) or not S.ID_RE.match(pid):
        raise wire.WireError(wire.INVALID_VALUE, "a review names a 64-hex proposal_id",
                             "proposal_id")
    return env, pid
