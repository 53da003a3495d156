"""Signed operator acts (DESIGN §5.2): DSSE envelopes with Ed25519 and the trust store.

DSSE signs PAE(payloadType, payload) — the exact bytes, no JSON canonicalisation to trust.
`keyid` = `ed25519:` + hex SHA-256 of the raw 32-byte public key. A key in the trust store is
bound to one principal: a review may only speak for the principal its key belongs to.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from improved.protocol.model import DsseSignature, Envelope

PAYLOAD_TYPES = {
    "review": "application/vnd.improved.review+json",
    "grant": "application/vnd.improved.grant+json",
    "vote": "application/vnd.improved.vote+json",
    "crisis": "application/vnd.improved.crisis+json",
    "tool_grant": "application/vnd.improved.tool-grant+json",  # one call of a gated tool
    "tool_upgrade": "application/vnd.improved.tool-upgrade+json",  # one session's tools
    "tool_revoke": "application/vnd.improved.tool-revoke+json",  # an upgrade's early end
    "signal": "application/vnd.improved.signal+json",  # learn-back evidence from a verified emitter
    "proposal": "application/vnd.improved.proposal+json",  # a proposal from a verified proposer
    "reply": "application/vnd.improved.reply+json",  # a service's answer to one request
    "apply_report": "application/vnd.improved.apply-report+json",  # an asynchronous apply result
}


class ActRefused(Exception):
    """A signed act that does not verify; `code` says why (docs/protocol.md)."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE pre-authentication encoding."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def keyid_of(public: bytes) -> str:
    return "ed25519:" + hashlib.sha256(public).hexdigest()


def sign(payload_type: str, payload: bytes, key: Ed25519PrivateKey) -> Envelope:
    sig = key.sign(pae(payload_type, payload))
    return Envelope(payloadType=payload_type, payload=base64.b64encode(payload).decode(),
                    signatures=[DsseSignature(keyid=keyid_of(raw_public(key.public_key())),
                                              sig=base64.b64encode(sig).decode())])


def envelope_digest(env: Envelope) -> str:
    """Identity of one signed act, for replay detection: the signed bytes and the signatures."""
    h = hashlib.sha256(pae(env.payloadType, _b64(env.payload, "payload")))
    for s in sorted((s.keyid, s.sig) for s in env.signatures):
        h.update(b"\0" + s[0].encode() + b"\0" + s[1].encode())
    return h.hexdigest()


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ActRefused("malformed", f"{what} is not base64") from exc


@dataclass(frozen=True)
class TrustedKey:
    keyid: str
    principal: str
    public: Ed25519PublicKey


@dataclass(frozen=True)
class Verified:
    payload: bytes
    keyid: str
    principal: str
    digest: str
    envelope: Envelope  # kept on the trailer the act leads to, so the chain proves it


class TrustStore:
    """The keys whose signatures count, each bound to its principal."""

    def __init__(self, keys: dict[str, TrustedKey] | None = None):
        self.keys = dict(keys or {})

    @classmethod
    def from_config(cls, principals: dict[str, str]) -> TrustStore:
        """`{"operator:alice": "<base64 of the raw 32-byte public key>"}`."""
        keys = {}
        for principal, b64 in principals.items():
            raw = base64.b64decode(b64, validate=True)
            if len(raw) != 32:
                raise ValueError(f"trust store: the key of {principal} is not 32 bytes")
            kid = keyid_of(raw)
            keys[kid] = TrustedKey(kid, principal, Ed25519PublicKey.from_public_bytes(raw))
        return cls(keys)

    def verify(self, env: Envelope, payload_type: str) -> Verified:
        """The payload of an envelope signed by a trusted key, or ActRefused naming why."""
        if env.payloadType != payload_type:
            raise ActRefused("wrong_type", f"payloadType {env.payloadType!r}, expected "
                             f"{payload_type!r}")
        payload = _b64(env.payload, "payload")
        if not env.signatures:
            raise ActRefused("unsigned", "the envelope carries no signature")
        message = pae(env.payloadType, payload)
        unknown = []
        for s in env.signatures:
            key = self.keys.get(s.keyid)
            if key is None:
                unknown.append(s.keyid)
                continue
            try:
                key.public.verify(_b64(s.sig, "signature"), message)
            except InvalidSignature:
                raise ActRefused("bad_signature", f"the signature of {s.keyid} does not match "
                                 "the payload") from None
            return Verified(payload, key.keyid, key.principal, envelope_digest(env), env)
        raise ActRefused("unknown_key", f"no trusted key among {', '.join(unknown)}")
