"""The evidence boundary: what an answer, a retained record or a bucket entry may decide.

On a bus without accounts anyone may answer one of the daemon's requests first, write or
tombstone a retained record or a bucket entry, and change a stream's limits (DESIGN §9,
"Evidence, not answers"). A value from there moves a decision only when it is attributable to
the party the decision needs, and this module is the one place where that is judged:

- `Attested[T]`: a value attributable to `by` — a reply signed by a key `[trust.signers]` binds
  to `service:<svc>`, signed for this very request (its subject and its reply inbox, so an old
  signed answer cannot be replayed), or a reply to a request only `<svc>` could receive (its
  subjects bound to it under the deployment's accounts, `[trust] subjects_bound`);
- `Unattested[T]`: anything else, with why it is not attributable. It is recorded and shown,
  and moves nothing a stage reserves for attested evidence: no rollback, no refusal, no
  breaker count;
- `Conflict[T]`: attested answers that disagree. Recorded, and it moves nothing: never "the
  first one wins".

`Attested` is made here and nowhere else (tests/unit/test_architecture.py holds it), and the
planner and the stages say in their signatures which of these they take, so the type checker
keeps an unattested value out of a decision that needs an attested one. What the chain proves
(daemon-signed trailers, signed acts) is verified in `core.evidence`; indexes and buckets are
hints whose every entry the chain confirms (`core.indexes`). Pure.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Generic, Literal, TypeVar, cast

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.core.signing import PAYLOAD_TYPES, ActRefused, TrustStore, sign
from improved.protocol.model import Envelope

T = TypeVar("T")
U = TypeVar("U")

Anchor = Literal["signature", "bound_subject"]
REPLY_TYPE: Final = PAYLOAD_TYPES["reply"]


@dataclass(frozen=True)
class Attested(Generic[T]):
    """`value`, attributable to `by` (`service:<svc>`), through `anchor`."""

    value: T
    by: str
    anchor: Anchor
    keyid: str = ""

    def map(self, f: Callable[[T], U]) -> Attested[U]:
        """The same attribution for what `f` makes of the value (a decode, say)."""
        return Attested(f(self.value), self.by, self.anchor, self.keyid)

    @property
    def attribution(self) -> str:
        return f"{self.by} ({'signed' if self.anchor == 'signature' else 'bound subject'})"


@dataclass(frozen=True)
class Unattested(Generic[T]):
    """`value`, attributable to nobody the decision needs; `why` says why."""

    value: T
    why: str

    def map(self, f: Callable[[T], U]) -> Unattested[U]:
        return Unattested(f(self.value), self.why)

    @property
    def attribution(self) -> str:
        return f"unattested ({self.why})"


@dataclass(frozen=True)
class Conflict(Generic[T]):
    """Attested answers that say different things; none of them counts."""

    answers: tuple[Attested[T], ...]

    @property
    def attribution(self) -> str:
        return f"conflicting answers of {', '.join(sorted({a.by for a in self.answers}))}"


Evidence = Attested[T] | Unattested[T]
Answer = Attested[T] | Unattested[T] | Conflict[T]


class _SignedReply(msgspec.Struct, forbid_unknown_fields=True):
    """The payload of a signed reply: the reply's own JSON, and the request it answers."""

    subject: str
    reply_to: str
    body: msgspec.Raw


def sign_reply(body: bytes, subject: str, reply_to: str, key: Ed25519PrivateKey) -> bytes:
    """A reply `body` (JSON) signed for the request it answers, as a DSSE envelope
    (payloadType `application/vnd.improved.reply+json`): what a service with a key sends."""
    payload = msgspec.json.encode({"subject": subject, "reply_to": reply_to,
                                   "body": msgspec.Raw(body)})
    return msgspec.json.encode(sign(REPLY_TYPE, payload, key))


class _Probe(msgspec.Struct):
    payloadType: str | None = None  # noqa: N815 - DSSE field name


_envelope = msgspec.json.Decoder(Envelope)
_signed_reply = msgspec.json.Decoder(_SignedReply)


def identity(service: str) -> str:
    """Whom a reply of `service` must be attributable to."""
    return f"service:{service}"


def can_attest(service: str, signers: TrustStore, bound: bool) -> bool:
    """Whether any answer of `service` could be attested: its subjects are bound, or a key is
    trusted for it. If not, no answer it gives can move a decision reserved for attested
    evidence, and none is worth waiting for."""
    who = identity(service)
    return bound or any(k.principal == who for k in signers.keys.values())


def attest_reply(data: bytes, *, service: str, subject: str, reply_to: str,
                 signers: TrustStore, bound: bool) -> Evidence[bytes]:
    """A reply to the request sent on `subject` with the reply inbox `reply_to`, as evidence:
    its body (a signed reply's inner body) and to whom it is attributable."""

    def unwrap(payload: bytes) -> tuple[bytes, str | None]:
        inner = _signed_reply.decode(payload)
        if (inner.subject, inner.reply_to) != (subject, reply_to):
            return bytes(inner.body), "signed for another request (a replayed answer)"
        return bytes(inner.body), None

    return _attest(data, REPLY_TYPE, "reply", service, signers, bound, unwrap)


REPORT_TYPE: Final = PAYLOAD_TYPES["apply_report"]


def sign_report(report: bytes, key: Ed25519PrivateKey) -> bytes:
    """An ApplyReport (JSON) signed by the service that applied, as a DSSE envelope
    (payloadType `application/vnd.improved.apply-report+json`)."""
    return msgspec.json.encode(sign(REPORT_TYPE, report, key))


def attest_report(data: bytes, *, service: str, signers: TrustStore,
                  bound: bool) -> Evidence[bytes]:
    """An ApplyReport that came on `improve.applied.<service>`, bare or signed, as evidence:
    the report's bytes, and whether they are `service`'s own. A report names the proposal it
    settles and is taken once, while that proposal awaits its apply, so a signed one needs no
    binding to a request."""
    return _attest(data, REPORT_TYPE, "report", service, signers, bound,
                   lambda payload: (payload, None))


def _attest(data: bytes, payload_type: str, what: str, service: str, signers: TrustStore,
            bound: bool, unwrap: Callable[[bytes], tuple[bytes, str | None]]
            ) -> Evidence[bytes]:
    """A message from `service`, bare or a DSSE envelope of `payload_type`, as evidence:
    what it says (`unwrap` of a signed payload: the inner message, and why it does not
    belong here, if it does not), and whether it is `service`'s own — signed by the key bound
    to `service:<service>`, or on subjects bound to it."""
    try:
        signed = msgspec.json.decode(data, type=_Probe).payloadType == payload_type
    except (msgspec.MsgspecError, RecursionError):
        signed = False
    if not signed:
        if bound:
            return Attested(data, identity(service), "bound_subject")
        return Unattested(data, "unsigned, and the bus binds no service to its subjects")
    try:
        env = _envelope.decode(data)
        body, elsewhere = unwrap(base64.b64decode(env.payload, validate=True))
    except (msgspec.MsgspecError, binascii.Error, ValueError):
        return Unattested(data, f"a signed {what} that is not well formed")
    try:
        verified = signers.verify(env, payload_type)
    except ActRefused as refused:
        if bound:  # the subject vouches; the signature adds nothing it could take away
            return Attested(body, identity(service), "bound_subject")
        return Unattested(body, f"its signature does not count ({refused.code}: "
                                f"{refused.reason})")
    if verified.principal != identity(service):
        return Unattested(body, f"signed by {verified.principal}, not {identity(service)}")
    if elsewhere is not None:
        return Unattested(body, elsewhere)
    return Attested(body, verified.principal, "signature", verified.keyid)


def present(answers: Sequence[Evidence[T | None]]) -> list[Evidence[T]]:
    """The answers that said something (a decode that gave a value), attribution kept."""
    out: list[Evidence[T]] = []
    for a in answers:
        if a.value is not None:
            out.append(cast("Evidence[T]", a))
    return out


def settled(answers: Sequence[Evidence[T]]) -> bool:
    """Whether the answers heard so far include an attested one: a requester that can be
    answered attestably waits for that (or its timeout), not for the first answer."""
    return any(isinstance(a, Attested) for a in answers)


def counting(answers: Sequence[Evidence[T]], attestable: bool) -> Evidence[T] | None:
    """The answer an apply or a last-known-good check takes: the first attested one; when
    nothing the service says could be attested (`can_attest`), the first one heard, which the
    chain then records as unattested. None: nothing that counts was heard."""
    for answer in answers:
        if isinstance(answer, Attested):
            return answer
    return None if attestable or not answers else answers[0]


def choose(answers: Sequence[Evidence[T]]) -> Answer[T] | None:
    """The answer that counts among those heard: the attested ones when there are any —
    one, or several saying the same; a Conflict when they disagree — else the first
    unattested one (recorded, moving nothing); None when nothing was heard."""
    attested = [a for a in answers if isinstance(a, Attested)]
    if attested:
        values = {msgspec.json.encode(a.value) for a in attested}
        if len(values) > 1:
            return Conflict(tuple(attested))
        return attested[0]
    return answers[0] if answers else None
