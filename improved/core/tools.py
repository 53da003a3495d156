"""Tool-surface authority for agent runtimes (SPEC 09 §3.1): the L0–L4 gradient, per call.

An agent must be able to *see* every tool it could be given, and *use* only what its runtime's
authority allows; a tool it cannot use is gated, never hidden, so the agent can ask an operator
for it instead of concluding it does not exist. Hence two registers:

- the catalog lists every provider, with a stable `grant_token` naming exactly this tool at
  this class and version;
- the mount set is what the runtime invokes on its own: providers at or under its ceiling.

Classes per call are L0, L2 and L4 (L1/L3 are skill-lifecycle states). An interactive runtime
(operator in the loop) ceilings at L4, an autonomous one at L2 and no higher: nobody is there
to stand behind an L4 call, so each one needs its own signed `ToolGrant` or a signed
`SessionUpgrade`. The grant binds the tool, its token (so a reclassified or re-versioned tool
needs a new grant), the digest of the exact arguments, and a time window; it runs once. The
upgrade lets one session of one runtime call the tools (or classes) it names, without a grant
per call, until it lapses or an operator's signed `UpgradeRevocation` revokes it. The upgrade
names the session's public key (`session_key`), and each call under it carries a
`SessionProof`: that key's signature over the runtime, the tool, the digest of the exact
arguments, the upgrade's act id and the call's own time and nonce, used once. The upgrade is
on the runtime's public chain after its first use; without the session's private key it
calls nothing. An upgrade signed without a `session_key` is refused (`upgrade_unbound`). In an
autonomous runtime an L2 provider's first call also needs a grant naming the runtime
(operator acceptance); after one accepted call, it runs freely.

Orthogonal to the class, every call's arguments are checked against the capability scopes
(`improved.core.scopes`): the tool's own, the runtime policy's, the upgrade's.

What must outlive one process — spent grants, acceptances, revocations — is kept in a
ledger, which the shell reads and writes (`improved_reference.tool_gate`: `ProcessLedger` for
one process; JetStream marks and a bucket shared by every replica of a runtime in
`improved_reference.tool_runtime`). A ledger is never believed on its own: an acceptance read
from it counts only when the signed grant it holds verifies for this runtime and tool, and
anything written as a spent or revoked mark counts as spent or revoked (a spent mark is kept
until its act's own time check refuses it on every replica, `spent_until`; then it may go, so
the spent marks follow the calls of the acts' windows, not the history).
A ledger that cannot vouch that it forgot nothing (a limit set on its streams and set back,
a stream made again: `improved.core.retention`) raises `LedgerUntrusted` instead of answering,
and the call is refused `ledger_untrusted`: a spend or a revocation it may have lost is never
taken for absent.

Sans-IO: `Runtime.gate` decides one call from values, and where it needs the ledger it answers
a step (`ReadAcceptance`, `ReadRevoked`, `Spend`, `RecordAcceptance`) whose `then` takes the
ledger's answer, until a `Decision`; the shell carries the steps out and runs the tool
(`ran`, `raised` shape its answer). Each call's decision is drafted as a trailer of the
runtime's `_tools` chain (`call_draft`), as is the ledger a runtime trusts when it starts
(`ledger_draft`).

Pure: no NATS, no clock of its own (`now_ms` is passed in), no logging, no awaiting. A refusal
changes nothing: the tool is not called and the grant is not spent.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from msgspec import Meta

from improved.core import retention
from improved.core.audit import Draft, draft_of
from improved.core.scopes import (
    CapabilityScope,
    ScopeKind,
    check_scope,
    check_scoped_args,
    scope_problem,
    to_wire,
)
from improved.core.signing import (
    PAYLOAD_TYPES,
    ActRefused,
    TrustStore,
    Verified,
    keyid_of,
    raw_public,
    sign,
)
from improved.core.trailers import LedgerTrusted, ToolCall, ToolRefused
from improved.protocol import subjects as S
from improved.protocol.model import (
    Actor,
    ChangeClass,
    Envelope,
    Millis,
    ServiceName,
    ShortText,
    _In,
    to_json,
)

Authority = Literal["L0", "L2", "L4"]
Mode = Literal["interactive", "autonomous"]

AUTHORITIES: tuple[str, ...] = ("L0", "L2", "L4")
DEFAULT_CEILINGS: dict[str, str] = {"interactive": "L4", "autonomous": "L2"}
MAX_CEILING: dict[str, str] = {"interactive": "L4", "autonomous": "L2"}
NAME_RE = re.compile(r"^[a-z][a-z0-9_.-]{0,127}\Z")
CLOCK_SKEW_MS = 5 * 60 * 1000  # how far a grant's `at` may lie ahead; its default lifetime too
MAX_UPGRADE_MS = 24 * 3600 * 1000  # the longest window a session upgrade may span
MAX_GRANT_MS = MAX_UPGRADE_MS
"""The longest a per-call grant may live, `at` to `expires_at`: the upgrades' cap. A grant's
spent mark is kept until its lapse plus SPENT_MARGIN_MS, so with the cap (and `at` at most
CLOCK_SKEW_MS ahead) every mark leaves within a day and ten minutes of its spending."""
PROOF_SKEW_MS = 60 * 1000  # how far a session proof's `at` may lie from the runtime's clock
PROOF_DOMAIN = b"improved session proof v1\n"  # what a session key's signature is about
SPENT_MARGIN_MS = 5 * 60 * 1000
"""How long a spent mark is kept past the lapse of the act it spends (`spent_until`): the
clock skew allowed between the replicas of a runtime. The replica that spends an act sets the
key's time to live by its own clock; another replica whose clock runs behind still accepts the
act until the lapse by *its* clock, up to this much later, and must still find the key then. A
key gone after that belongs to an act every replica refuses by its own time check. Five
minutes, as far as a signed act's `at` may lie ahead (CLOCK_SKEW_MS)."""
ERROR_LIMIT = 500  # characters of a failed tool's error text

ToolName = Annotated[str, Meta(pattern=NAME_RE.pattern)]
GrantToken = Annotated[str, Meta(pattern=r"^gt:[0-9a-f]{64}\Z")]
Sha256Hex = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}\Z")]
SessionId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}\Z")]
Nonce = Annotated[str, Meta(min_length=8, max_length=128)]
PublicKeyB64 = Annotated[str, Meta(pattern=r"^[A-Za-z0-9+/]{43}=\Z",
                                   description="base64 of a raw 32-byte Ed25519 public key")]
SignatureB64 = Annotated[str, Meta(pattern=r"^[A-Za-z0-9+/]{86}==\Z",
                                   description="base64 of a 64-byte Ed25519 signature")]


def _rank(authority: str) -> int:
    return int(authority[1])


def _check_authority(authority: object, what: str) -> None:
    if authority in ("L1", "L3"):
        raise ValueError(f"{what} {authority}: L1/L3 are skill-lifecycle states, not classes of "
                         "a call; classify the tool L0, L2 or L4")
    if authority not in AUTHORITIES:
        raise ValueError(f"{what} {authority!r} is not one of {', '.join(AUTHORITIES)}")


@dataclass(frozen=True)
class Provider:
    """One tool: its name, its change class, the callable that runs it, and what it may touch:
    `scope`, and which arguments address a path, a set or an origin (`scoped_args`)."""

    name: str
    authority: ChangeClass
    description: str
    run: Callable[[dict[str, Any]], Any]  # sync, or returning an awaitable (the shell's)
    version: str | None = None
    scope: CapabilityScope | None = None
    scoped_args: Mapping[str, ScopeKind] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise ValueError(f"tool name {self.name!r} must match {NAME_RE.pattern}")
        _check_authority(self.authority, f"tool {self.name}: authority")
        if not isinstance(self.description, str):
            raise ValueError(f"tool {self.name}: description must be a string")
        if not callable(self.run):
            raise ValueError(f"tool {self.name}: run is not callable")
        if self.version is not None and not isinstance(self.version, str):
            raise ValueError(f"tool {self.name}: version must be a string")
        if self.scope is not None and not isinstance(self.scope, CapabilityScope):
            raise ValueError(f"tool {self.name}: scope must be a CapabilityScope")
        check_scoped_args(self.scoped_args, self.scope, f"tool {self.name}")


def canonical_json(obj: Any) -> bytes:
    """JSON with every map's keys sorted: the same value gives the same bytes everywhere."""
    return msgspec.json.encode(obj, order="sorted")


def grant_token(provider: Provider) -> str:
    """`gt:<sha256>` of the provider's name, class and version: what a grant is for."""
    identity = {"name": provider.name, "authority": provider.authority,
                "version": provider.version}
    return "gt:" + hashlib.sha256(canonical_json(identity)).hexdigest()


def args_digest(args: dict[str, Any]) -> str:
    """The digest of one call's arguments, as a grant binds them."""
    return hashlib.sha256(canonical_json(args)).hexdigest()


def act_id(verified: Verified) -> str:
    """The identity of a signed act however its envelope is dressed (an extra signature, say):
    SHA-256 of its payload, which carries a nonce. What a ledger spends and revokes."""
    return hashlib.sha256(verified.payload).hexdigest()


def chain_id(runtime: str) -> str:
    """The id of a runtime's `_tools` audit chain."""
    return hashlib.sha256(f"improved tools {runtime}".encode()).hexdigest()


def runtime_writers(runtimes: TrustStore) -> dict[str, tuple[str, str]]:
    """Chain id → (runtime, key id): whose key may write which runtime's `_tools` chain, from
    the `[trust.runtimes]` keys (each bound to its runtime's name). A runtime's key writes its
    own chain and no other, and is never a daemon's."""
    return {chain_id(k.principal): (k.principal, kid) for kid, k in runtimes.keys.items()}


def claimed_runtime(body: Mapping[str, Any], chain: str) -> str | None:
    """The runtime a `_tools` trailer names (`runtime:` ref) when its chain is that runtime's,
    else None: what a verifier can say of a chain whose writer it has no key for."""
    refs = body.get("refs")
    for r in refs if isinstance(refs, list) else ():
        if isinstance(r, str) and r.startswith("runtime:"):
            name = r.removeprefix("runtime:")
            return name if chain_id(name) == chain else None
    return None


class ToolGrant(_In):
    """An operator's signed permission for one call of one tool with exactly these arguments."""

    tool: ToolName
    grant_token: GrantToken
    args_digest: Sha256Hex
    principal: Actor
    reason: ShortText
    at: Millis
    nonce: Nonce
    expires_at: Millis | None = None
    runtime: ServiceName | None = None  # when set, only that runtime may use the grant


class SessionUpgrade(_In):
    """An operator's signed policy upgrade: session `session` of runtime `runtime` may call the
    tools named in `tools`, or of a class in `classes`, without a per-call grant, within
    `scope` when given, from `at` until `expires_at` (at most MAX_UPGRADE_MS) or revocation;
    each call proven by the holder of `session_key` (a `SessionProof`). Optional only so that
    an upgrade signed before the field existed decodes, to be refused `upgrade_unbound`."""

    runtime: ServiceName
    session: SessionId
    principal: Actor
    reason: ShortText
    at: Millis
    expires_at: Millis
    nonce: Nonce
    tools: list[ToolName] | None = None
    classes: list[Literal["L2", "L4"]] | None = None
    scope: CapabilityScope | None = None
    session_key: PublicKeyB64 | None = None


class SessionProof(_In):
    """A call's proof that its caller holds the upgrade's `session_key`: `sig` is that key's
    Ed25519 signature over `proof_message` (this runtime, this tool, the digest of these
    exact arguments, the upgrade's act id, `at` and `nonce`). `at` (ms) must lie within
    PROOF_SKEW_MS of the runtime's clock; a proof runs one call."""

    at: Millis
    nonce: Nonce
    sig: SignatureB64


class UpgradeRevocation(_In):
    """An operator's signed end of a session upgrade (`upgrade`: its act id) before it lapses."""

    runtime: ServiceName
    upgrade: Sha256Hex
    principal: Actor
    reason: ShortText
    at: Millis


def sign_grant(key: Ed25519PrivateKey, principal: str, provider_or_token: Provider | str,
               tool: str, args: dict[str, Any], reason: str, now_ms: int,
               ttl_ms: int = CLOCK_SKEW_MS, *, nonce: str,
               runtime: str | None = None) -> Envelope:
    """A DSSE envelope granting one call of `tool(args)`, valid for `ttl_ms` from `now_ms`;
    `nonce` (random, e.g. secrets.token_hex(16)) makes two grants for the same call differ.
    ValueError for a `ttl_ms` over MAX_GRANT_MS: every runtime would refuse the grant."""
    if ttl_ms > MAX_GRANT_MS:
        raise ValueError(f"a grant lives at most {MAX_GRANT_MS // 1000} s "
                         f"({MAX_GRANT_MS // 3_600_000} h); {ttl_ms / 1000:g} s asked")
    token = (grant_token(provider_or_token) if isinstance(provider_or_token, Provider)
             else provider_or_token)
    grant = ToolGrant(tool=tool, grant_token=token, args_digest=args_digest(args),
                      principal=principal, reason=reason, at=now_ms,
                      expires_at=now_ms + ttl_ms, nonce=nonce,
                      runtime=runtime)
    return sign(PAYLOAD_TYPES["tool_grant"], to_json(grant), key)


def sign_upgrade(key: Ed25519PrivateKey, principal: str, runtime: str, session: str,
                 reason: str, now_ms: int, ttl_ms: int, *, nonce: str,
                 session_key: str | None, tools: list[str] | None = None,
                 classes: list[str] | None = None,
                 scope: CapabilityScope | None = None) -> Envelope:
    """A DSSE envelope upgrading one session of one runtime for `ttl_ms` from `now_ms`, for
    calls proven by `session_key` (base64 raw Ed25519 public key, `public_key_b64`); None
    signs an unbound upgrade, which a runtime refuses (kept for tests of that refusal)."""
    if session_key is not None:
        parse_public_key(session_key)
    act = msgspec.convert({"runtime": runtime, "session": session, "principal": principal,
                           "reason": reason, "at": now_ms, "expires_at": now_ms + ttl_ms,
                           "nonce": nonce, "tools": tools, "classes": classes,
                           "scope": to_wire(scope), "session_key": session_key},
                          SessionUpgrade)
    return sign(PAYLOAD_TYPES["tool_upgrade"], to_json(act), key)


def sign_revocation(key: Ed25519PrivateKey, principal: str, runtime: str, upgrade: str,
                    reason: str, now_ms: int) -> Envelope:
    """A DSSE envelope revoking the upgrade whose act id is `upgrade` (`upgrade_id`)."""
    act = msgspec.convert({"runtime": runtime, "upgrade": upgrade, "principal": principal,
                           "reason": reason, "at": now_ms}, UpgradeRevocation)
    return sign(PAYLOAD_TYPES["tool_revoke"], to_json(act), key)


def upgrade_id(env: Envelope) -> str:
    """The act id of an upgrade envelope, as a revocation names it (no signature checked)."""
    return hashlib.sha256(base64.b64decode(env.payload)).hexdigest()


# -- the session's proof of key -------------------------------------------------------------------


def public_key_b64(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """base64 of the raw 32-byte public key: what `session_key` (and a trust store) holds."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return base64.b64encode(raw_public(public)).decode()


def parse_public_key(text: str) -> Ed25519PublicKey:
    """An Ed25519 public key from base64 of its raw 32 bytes; ValueError saying why not."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a session key is base64 of a raw 32-byte Ed25519 public key; "
                         "this is not base64") from None
    if len(raw) != 32:
        raise ValueError(f"a session key is base64 of a raw 32-byte Ed25519 public key; "
                         f"this is {len(raw)} bytes")
    return Ed25519PublicKey.from_public_bytes(raw)


def proof_message(runtime: str, tool: str, digest: str, upgrade: str, at: int,
                  nonce: str) -> bytes:
    """The bytes a session key signs for one call: a domain tag (so the signature means
    nothing elsewhere, a DSSE envelope included), then sorted-key JSON of the runtime, the
    tool, the SHA-256 of the arguments (`args_digest`), the upgrade's act id, `at`, `nonce`."""
    return PROOF_DOMAIN + canonical_json({"runtime": runtime, "tool": tool,
                                          "args_digest": digest, "upgrade": upgrade,
                                          "at": at, "nonce": nonce})


def proof_digest(message: bytes) -> str:
    """The identity of one proof: SHA-256 of the message signed. What the ledger spends (a
    mark `improve.tools.spent.<digest>`) and the call's trailer names (`proof:`)."""
    return hashlib.sha256(message).hexdigest()


def sign_proof(key: Ed25519PrivateKey, runtime: str, tool: str, args: dict[str, Any],
               upgrade: str, now_ms: int, *, nonce: str) -> SessionProof:
    """The proof for one call of `tool(args)` on `runtime` under the upgrade whose act id is
    `upgrade`; `nonce` random (secrets.token_hex(16)), a new one for each call."""
    message = proof_message(runtime, tool, args_digest(args), upgrade, now_ms, nonce)
    return msgspec.convert({"at": now_ms, "nonce": nonce,
                            "sig": base64.b64encode(key.sign(message)).decode()}, SessionProof)


def check_proof(act: SessionUpgrade, upgrade: str, runtime: str, tool: str,
                args: dict[str, Any], proof: SessionProof | None, now: int) -> str:
    """The digest of a call's proof under a verified upgrade (act id `upgrade`), or ActRefused:
    `upgrade_unbound` (no session_key: re-issue it), `session_proof_missing`,
    `session_proof_stale` (`at` beyond PROOF_SKEW_MS of `now`), `session_proof_invalid` (not
    the session key's signature for this runtime, tool, arguments, upgrade, at and nonce).
    Whether it was used before is the ledger's to say (`spend` of the digest)."""
    if act.session_key is None:
        raise ActRefused("upgrade_unbound", "the upgrade names no session_key, so whoever "
                         "holds the envelope could use it; have an operator re-issue it with "
                         "the session's key (`improved tools upgrade --session-key`)")
    if proof is None:
        raise ActRefused("session_proof_missing", "a call under a session upgrade carries a "
                         "proof signed by the upgrade's session key")
    if abs(now - proof.at) > PROOF_SKEW_MS:
        raise ActRefused("session_proof_stale", f"the proof was made at {proof.at}, more than "
                         f"{PROOF_SKEW_MS} ms from the runtime's clock ({now}); sign a new one")
    try:
        digest = args_digest(args)
    except (TypeError, msgspec.EncodeError) as exc:
        raise ActRefused("malformed", f"cannot check the proof: {exc}") from None
    return verify_proof(act.session_key, runtime, tool, digest, upgrade, proof)


def verify_proof(session_key: str, runtime: str, tool: str, digest: str, upgrade: str,
                 proof: SessionProof) -> str:
    """The digest of `proof` when it is the signature of `session_key` (base64 raw Ed25519)
    over `proof_message` of this runtime, tool, arguments' digest, upgrade id, `at` and
    `nonce`; else ActRefused `malformed` (not a key) or `session_proof_invalid`. What the
    runtime checks at the call and an auditor re-checks from the call's trailer."""
    try:
        key = parse_public_key(session_key)
    except ValueError as exc:
        raise ActRefused("malformed", f"cannot check the proof: {exc}") from None
    message = proof_message(runtime, tool, digest, upgrade, proof.at, proof.nonce)
    try:
        key.verify(base64.b64decode(proof.sig, validate=True), message)
    except (InvalidSignature, binascii.Error, ValueError):
        raise ActRefused("session_proof_invalid", "the proof is not the upgrade's session "
                         f"key's signature for {tool} on {runtime} with these arguments, "
                         "this upgrade, at and nonce") from None
    return proof_digest(message)


PROOF_REFS: tuple[str, ...] = ("proof_at", "proof_nonce", "proof_sig")
"""The refs of an upgraded call's trailer that carry its session proof (`at`, `nonce`,
`sig`), beside `proof:` (its digest): enough to re-check the proof from the chain alone."""


def proof_recorded(call: ToolCall) -> bool:
    """The call's trailer records (some of) its session proof (PROOF_REFS)."""
    return any(v is not None for v in (call.proof_at, call.proof_nonce, call.proof_sig))


def recorded_proof_problem(act: SessionUpgrade, upgrade: str, call: ToolCall) -> str | None:
    """Why the session proof an upgraded call's trailer records does not hold, or None: it
    must be the signature of the upgrade's `session_key` over this runtime, tool, arguments'
    digest and upgrade (act id `upgrade`), as `verify_proof` checks it at the call, and hash
    to the `proof:` digest. A trailer with none of PROOF_REFS was written before they were
    recorded: None (its digest and key id are all it says)."""
    parts = {"proof_at": call.proof_at, "proof_nonce": call.proof_nonce,
             "proof_sig": call.proof_sig}
    if not proof_recorded(call) or act.session_key is None:
        return None
    missing = ", ".join(name for name, value in parts.items() if value is None)
    if missing:
        return f"the session proof is recorded without {missing}"
    try:
        proof = msgspec.convert({"at": int(call.proof_at or ""), "nonce": call.proof_nonce,
                                 "sig": call.proof_sig}, SessionProof)
        digest = verify_proof(act.session_key, call.runtime, call.tool, call.args, upgrade,
                              proof)
    except (ValueError, msgspec.ValidationError) as exc:
        return f"the recorded session proof is not a proof: {exc}"
    except ActRefused as exc:
        return f"the recorded session proof does not verify ({exc.code}): {exc.reason}"
    if digest != call.proof:
        return (f"the recorded session proof has digest {digest}, the trailer names "
                f"{call.proof!r}")
    return None


# -- how long a spent mark is kept ---------------------------------------------------------------
#
# Only spent marks expire. An acceptance (`accepted.*`) lasts: it is the operator's acceptance
# of a tool on a runtime, one key per (runtime, tool), not per call. A revocation
# names its upgrade by act id alone, so the runtime cannot tell from it when that upgrade's
# window (which may begin after the revocation) ends; it is kept, and grows with operators'
# acts, not with calls.


def grant_lapse(act: ToolGrant) -> int:
    """The first instant (ms) a grant is refused by its own time check: `expires_at`, or `at`
    + CLOCK_SKEW_MS for a grant that names none."""
    return act.expires_at if act.expires_at is not None else act.at + CLOCK_SKEW_MS


def proof_lapse(proof: SessionProof) -> int:
    """The first instant (ms) a session proof is refused as stale: a proof is accepted while
    `now` lies within PROOF_SKEW_MS of its `at`, that last millisecond included."""
    return proof.at + PROOF_SKEW_MS + 1


def spent_until(lapse: int, margin_ms: int = SPENT_MARGIN_MS) -> int:
    """Until when (ms) the spent mark of an act whose lapse is `lapse` must be kept: the
    lapse, plus the replicas' clock skew (SPENT_MARGIN_MS)."""
    return lapse + margin_ms


def spent_ttl_s(until: int, now: int) -> int:
    """The key's time to live in whole seconds (what `Nats-TTL` takes), rounded up so the key
    lasts at least until `until`; one second at least (the shortest TTL a server keeps)."""
    return max(1, -(-(until - now) // 1000))


def refused(reason: str, required: str, detail: str | None = None) -> dict[str, Any]:
    body = {"reason": reason, "required": required}
    if detail:
        body["detail"] = detail
    return {"refused": body}


def not_found(name: str) -> dict[str, Any]:
    return {"error": {"code": "not_found", "message": f"no tool named {name!r}", "field": "tool"}}


# -- what outlives a process: the ledger, read and written by the shell -------------------------


class LedgerUntrusted(ActRefused):
    """The ledger cannot vouch that it kept every mark (`improved.core.retention.problem` says
    why): whatever it would answer, a spend or a revocation it lost would look absent, so the
    call that relies on it is refused `ledger_untrusted`. The shell's ledger raises it; the
    shell hands it to the step that asked (`ReadRevoked`, `Spend`) as that step's answer."""

    def __init__(self, reason: str):
        super().__init__("ledger_untrusted", reason)


# -- one call's decision --------------------------------------------------------------------------

Via = Literal["mounted", "accepted", "grant", "acceptance", "upgrade"]


@dataclass(frozen=True)
class Decision:
    """What the gate decided about one call, before the tool runs: `reply` is the refusal (or
    the not_found error) when nothing may run; `via` says what allowed it otherwise, `act` the
    signed act that did (a grant or an upgrade) and `principal` its signer."""

    tool: str
    args: dict[str, Any]
    provider: Provider | None = None
    reply: dict[str, Any] | None = None
    via: Via | None = None
    act: Verified | None = None
    principal: str | None = None
    session: str | None = None
    proof: str | None = None  # the digest of the session proof an upgraded call carried
    session_key: str | None = None  # the key id of the session key that made it
    signed_proof: SessionProof | None = None  # that proof itself, recorded with its digest

    @property
    def allowed(self) -> bool:
        return self.reply is None

    @property
    def refusal(self) -> dict[str, Any] | None:
        """The answer to a call that may not run (its refusal, or not_found), None for one
        that may: what the shell replies without calling the tool."""
        if self.reply is not None or self.provider is None:
            return self.reply or not_found(self.tool)
        return None


def ran(decision: Decision, result: Any) -> dict[str, Any]:
    """The answer to an allowed call whose tool returned `result`."""
    return {"ok": True, "result": result, **_allowed_by(decision)}


def raised(decision: Decision, exc: BaseException) -> dict[str, Any]:
    """The answer to an allowed call whose tool raised `exc`: its type and text, at most
    ERROR_LIMIT characters."""
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:ERROR_LIMIT],
            **_allowed_by(decision)}


def _allowed_by(decision: Decision) -> dict[str, Any]:
    """Who let the call run, on its answer: the grant's or upgrade's signer, the upgrade."""
    out: dict[str, Any] = {}
    if decision.principal is not None:
        out["granted_by"] = decision.principal
    if decision.via == "upgrade":
        out["upgrade"] = act_id(decision.act) if decision.act else None
    return out


# -- what a call's decision needs from the ledger: the steps the shell carries out ---------------
#
# Sans-IO, as the planner's Read steps: `Runtime.gate` answers the Decision when it needs nothing
# from the ledger, else one of the steps below. The shell does what the step names and hands the
# ledger's answer to the step's `then`, which gives the next step, until a Decision. A step
# carries its own continuation, so nothing is checked twice and each answer has its own type.


@dataclass(frozen=True)
class ReadAcceptance:
    """Read the acceptance the ledger holds for `runtime` and `token` (`acceptance`) and hand
    `then` what it holds, or None; only a grant in it that verifies counts."""

    runtime: str
    token: str
    then: Callable[[Envelope | None], Step] = field(compare=False, repr=False)


@dataclass(frozen=True)
class ReadRevoked:
    """Ask the ledger whether the upgrade whose act id is `upgrade` is revoked (`revoked`) and
    hand `then` the answer, or the LedgerUntrusted the ledger raised."""

    upgrade: str
    then: Callable[[bool | LedgerUntrusted], Step] = field(compare=False, repr=False)


@dataclass(frozen=True)
class Spend:
    """Spend `act` (a grant's act id or a session proof's digest) in the ledger, its mark kept
    until `until` (`spend`), and hand `then` whether this call spent it (False: it was spent
    before), or the LedgerUntrusted the ledger raised."""

    act: str
    until: int
    now: int
    then: Callable[[bool | LedgerUntrusted], Step] = field(compare=False, repr=False)


@dataclass(frozen=True)
class RecordAcceptance:
    """Record in the ledger the operator's acceptance of `token` on `runtime`, the grant
    `grant` (`accept`), then `then()`: the grant that accepted it is spent by now."""

    runtime: str
    token: str
    grant: Envelope
    then: Callable[[], Step] = field(compare=False, repr=False)


Step = Decision | ReadAcceptance | ReadRevoked | Spend | RecordAcceptance


@dataclass(frozen=True)
class RecordRevocation:
    """Record in the ledger an operator's verified revocation (`revocation`) of the upgrade
    whose act id is `upgrade` (`revoke`); `reply` answers it once recorded."""

    upgrade: str
    revocation: Envelope
    principal: str

    @property
    def reply(self) -> dict[str, Any]:
        return {"ok": True, "revoked": self.upgrade, "revoked_by": self.principal}


@dataclass(frozen=True)
class _Call:
    """One call past its scope check, as the steps of its decision carry it along."""

    provider: Provider
    args: dict[str, Any]
    grant: Envelope | None
    now: int
    session: str | None
    upgrade: Envelope | None
    proof: SessionProof | None
    layers: list[tuple[str, CapabilityScope | None]]
    gated: bool
    unaccepted: bool = False

    @property
    def base(self) -> Decision:
        return Decision(self.provider.name, self.args, self.provider, session=self.session)


# -- the ledger a runtime trusts, on its chain ----------------------------------------------------


@dataclass(frozen=True)
class Ledgered:
    """The ledger refs' values of a `_tools` trailer (`Known.ref`), or None: not trusted."""

    spent_stream: str | None = None
    revoked_stream: str | None = None
    audit_stream: str | None = None

LEDGER_STREAMS: dict[str, tuple[str, retention.Kind]] = {
    S.STREAM_TOOLS_SPENT: ("spent_stream", "expires"),
    S.STREAM_TOOLS_REVOKED: ("revoked_stream", "keeps"),
    S.STREAM_TOOLS_AUDIT: ("audit_stream", "keeps"),
}
"""The streams a runtime relies on having kept every message — its marks, and its chain, where
it reads at start the ledger it trusts — with the ref that names on each trailer the one it
trusts (`Known.ref`), and how each is checked (`improved.core.retention`)."""


def ledger_of(known: Mapping[str, retention.Known]) -> Ledgered:
    """The ledger refs that name, on a trailer, the streams the runtime trusts
    (LEDGER_STREAMS): as the fields of a `_tools` trailer's data."""
    return Ledgered(**{name: known[stream].ref() for stream, (name, _) in LEDGER_STREAMS.items()
                       if stream in known})


def recorded_ledger(trailer: Ledgered | ToolCall | ToolRefused | LedgerTrusted,
                    ) -> dict[str, retention.Known]:
    """The streams a `_tools` trailer says its runtime trusted, by stream name."""
    recorded = {"spent_stream": trailer.spent_stream, "revoked_stream": trailer.revoked_stream,
                "audit_stream": trailer.audit_stream}
    out = {}
    for stream, (name, kind) in LEDGER_STREAMS.items():
        known = retention.ref_value(stream, kind, recorded.get(name) or "")
        if known is not None:
            out[stream] = known
    return out


def ledger_draft(runtime: str, known: Mapping[str, retention.Known], why: str) -> Draft:
    """The trailer that records the streams a runtime trusts from now on (`ledger_of`), and
    `why`: seen for the first time, or accepted by an operator as they are now. Every later
    trailer names them too, so the chain's last trailer says what the runtime trusts."""
    ledger = ledger_of(known)
    return draft_of(LedgerTrusted(runtime=runtime, spent_stream=ledger.spent_stream,
                                  revoked_stream=ledger.revoked_stream,
                                  audit_stream=ledger.audit_stream),
                    "apply", runtime, "rec:system",
                    f"runtime {runtime} trusts its ledger: {why}")


def call_draft(runtime: str, decision: Decision,
               known: Mapping[str, retention.Known] | None = None) -> Draft | None:
    """The trailer of the runtime's `_tools` chain that records one decision (None for a tool
    not in the catalog): the tool, the digest of its arguments (never the arguments), its
    class, what allowed it (and the signed act that did) or why it was refused, and the
    streams the runtime trusts (`known`, `ledger_refs`). `tool_call` for a call that runs,
    `refused` for one that does not; stage `apply` → `apply`."""
    p = decision.provider
    if p is None:
        return None
    try:
        digest = args_digest(decision.args)
    except (TypeError, msgspec.EncodeError):
        digest = "unencodable"
    ledger = ledger_of(known or {})
    if decision.allowed:
        act, signed = decision.act, decision.signed_proof
        call = ToolCall(
            runtime=runtime, tool=p.name, class_=p.authority, token=grant_token(p), args=digest,
            spent_stream=ledger.spent_stream, revoked_stream=ledger.revoked_stream,
            audit_stream=ledger.audit_stream, session=decision.session,
            via=decision.via or "mounted", act=act.digest if act is not None else None,
            act_id=act_id(act) if act is not None else None, proof=decision.proof,
            proof_at=str(signed.at) if signed is not None else None,
            proof_nonce=signed.nonce if signed is not None else None,
            proof_sig=signed.sig if signed is not None else None,
            session_key=decision.session_key)
        return draft_of(call, "apply", decision.principal or runtime,
                        "human" if act is not None else "rec:agent",
                        f"{p.name} ({p.authority}) called on {runtime}, {decision.via}",
                        act.envelope if act is not None else None)
    assert decision.reply is not None
    body = decision.reply.get("refused", {})
    return draft_of(ToolRefused(
        runtime=runtime, tool=p.name, class_=p.authority, token=grant_token(p), args=digest,
        spent_stream=ledger.spent_stream, revoked_stream=ledger.revoked_stream,
        audit_stream=ledger.audit_stream, session=decision.session,
        refused=str(body.get("reason"))), "apply", runtime, "rec:agent",
        f"{p.name} ({p.authority}) refused on {runtime}: "
        f"{body.get('reason')}: {body.get('detail', '')}")


class Runtime:
    """An agent runtime's catalog and mount set, and the gate every call goes through: what a
    call needs from the ledger and whether it may run, decided from what the shell hands it."""

    def __init__(self, name: str, ceiling: str | None = None, trust: TrustStore | None = None,
                 mode: Mode = "autonomous", *,
                 scopes: Mapping[str, CapabilityScope] | None = None,
                 spent_margin_ms: int = SPENT_MARGIN_MS):
        if not isinstance(name, str) or not S.SERVICE_RE.match(name):
            raise ValueError(f"runtime name {name!r} must match {S.SERVICE_RE.pattern}")
        if mode not in DEFAULT_CEILINGS:
            raise ValueError(f"mode {mode!r} is not 'interactive' or 'autonomous'")
        ceiling = DEFAULT_CEILINGS[mode] if ceiling is None else ceiling
        _check_authority(ceiling, "ceiling")
        if _rank(ceiling) > _rank(MAX_CEILING[mode]):
            raise ValueError(f"an {mode} runtime's ceiling is at most {MAX_CEILING[mode]}: "
                             "with no operator in the loop, L4 calls run under per-call grants")
        for tool_name, scope in (scopes or {}).items():
            if not isinstance(scope, CapabilityScope):
                raise ValueError(f"policy scope of {tool_name}: not a CapabilityScope")
            check_scope(scope, f"policy scope of {tool_name}")
        if (not isinstance(spent_margin_ms, int) or isinstance(spent_margin_ms, bool)
                or spent_margin_ms < 0):
            raise ValueError(f"spent_margin_ms {spent_margin_ms!r} must be a whole number of "
                             "milliseconds, 0 or more")
        self.name, self.ceiling, self.mode = name, ceiling, mode
        self.spent_margin_ms = spent_margin_ms  # SPENT_MARGIN_MS; shorter only in tests
        self.trust = trust or TrustStore()
        self.scopes = dict(scopes or {})  # the runtime policy's narrowing, by tool name
        self._providers: dict[str, Provider] = {}
        self._accepted: set[str] = set()  # tokens of L2 providers whose acceptance verified

    def register(self, provider: Provider) -> str:
        """Add a provider to the catalog; its grant token. A name registers once."""
        if not isinstance(provider, Provider):
            raise TypeError(f"not a Provider: {provider!r}")
        _check_authority(provider.authority, f"tool {provider.name}: authority")
        if provider.name in self._providers:
            raise ValueError(f"tool {provider.name!r} is already registered")
        self._providers[provider.name] = provider
        return grant_token(provider)

    def mounted(self, provider: Provider) -> bool:
        return _rank(provider.authority) <= _rank(self.ceiling)

    def needs_acceptance(self, provider: Provider) -> bool:
        """A mounted L2 provider of an autonomous runtime whose first call was not accepted
        (as far as this process knows: `learn_acceptance` takes what the ledger holds)."""
        return (self.mode == "autonomous" and provider.authority == "L2"
                and self.mounted(provider) and grant_token(provider) not in self._accepted)

    def awaiting_acceptance(self) -> list[Provider]:
        """The providers whose acceptance, if the ledger holds one, the catalog should show:
        what the shell reads (`acceptance`) and hands to `learn_acceptance` before listing."""
        return [p for p in self._providers.values() if self.needs_acceptance(p)]

    def learn_acceptance(self, provider: Provider, env: Envelope | None) -> bool:
        """Whether `env`, what the ledger holds as this tool's acceptance, is one: a grant
        signed by a trusted operator for this very tool, token and runtime (then remembered).
        A ledger entry is anyone's to write; only the signature inside it counts."""
        token = grant_token(provider)
        if env is None:
            return False
        try:
            verified = self.trust.verify(env, PAYLOAD_TYPES["tool_grant"])
            act = _decode(verified, ToolGrant, "a ToolGrant")
        except ActRefused:
            return False
        if (act.tool, act.grant_token, act.runtime) != (provider.name, token, self.name):
            return False
        self._accepted.add(token)
        return True

    def catalog(self) -> list[dict[str, Any]]:
        """Every provider, mounted or not, by name."""
        out = []
        for name in sorted(self._providers):
            p = self._providers[name]
            entry: dict[str, Any] = {"name": p.name, "authority": p.authority,
                                     "description": p.description,
                                     "mountable": self.mounted(p), "grant_token": grant_token(p)}
            if not self.mounted(p):
                entry["gated_authority"] = p.authority
            elif self.needs_acceptance(p):
                entry["needs_acceptance"] = True
            if p.scoped_args:
                entry["scope"] = to_wire(p.scope)
                entry["scoped_args"] = dict(p.scoped_args)
                if name in self.scopes:
                    entry["policy_scope"] = to_wire(self.scopes[name])
            out.append(entry)
        return out

    # -- one call: its steps -------------------------------------------------------------------

    def bound(self, name: str, args: dict[str, Any] | None, skill: str,
              allowed: frozenset[str] | str, *, session: str | None = None) -> Decision | None:
        """A call made on behalf of `skill` whose definition allows the tools `allowed` (or
        cannot bind them: `allowed` says why, one line): the refusal when the tool is outside
        the bound, None when the call goes on to `gate`. OMS: `allowed_tools` is a bound, and
        a call outside it an error. Decided before `gate`, so a refused call spends no grant
        or proof and records no acceptance; a name not in the catalog is `gate`'s not_found."""
        provider = self._providers.get(name)
        if provider is None:
            return None
        base = Decision(name, {} if args is None else args, provider, session=session)
        if isinstance(allowed, str):
            return _refuse(base, "skill_unbound", f"the call is made for skill {skill}, whose "
                           f"allowed_tools cannot be read: {allowed}"[:ERROR_LIMIT])
        if name not in allowed:
            return _refuse(base, "outside_allowed_tools", f"skill {skill} allows the tools "
                           f"{sorted(allowed)}, not {name}"[:ERROR_LIMIT])
        return None

    def gate(self, name: str, args: dict[str, Any] | None, grant: Envelope | None,
             now_ms: int, *, session: str | None = None, upgrade: Envelope | None = None,
             proof: SessionProof | None = None) -> Step:
        """The first step of deciding whether this call may run: the Decision, or what the
        ledger must be asked first (a Step whose `then` takes the answer). What the steps
        spend or record (the grant, the session proof, the acceptance) is what lets the call
        run; for a refused call nothing is spent and no acceptance recorded. A grant or an
        upgrade is looked at only when the call needs one; otherwise it is ignored, unspent."""
        provider = self._providers.get(name)
        args = {} if args is None else args
        if not isinstance(args, dict):
            raise TypeError(f"args must be a dict, not {type(args).__name__}")
        if provider is None:
            return Decision(name, args, reply=not_found(name), session=session)
        layers = [("tool", provider.scope), ("runtime policy", self.scopes.get(name))]
        call = _Call(provider, args, grant, now_ms, session, upgrade, proof, layers,
                     gated=not self.mounted(provider))
        problem = scope_problem(provider.scoped_args, args, layers)
        if problem is not None:
            return _refuse(call.base, problem.code, problem.reason)
        if self.needs_acceptance(provider):
            return ReadAcceptance(self.name, grant_token(provider), lambda env: self._route(
                call, unaccepted=not self.learn_acceptance(provider, env)))
        return self._route(call, unaccepted=False)

    def _route(self, call: _Call, *, unaccepted: bool) -> Step:
        """A mounted, accepted tool runs; otherwise an upgrade, then a grant, may let it."""
        provider = call.provider
        if not (call.gated or unaccepted):
            via: Via = "accepted" if provider.authority == "L2" and self.mode == "autonomous" \
                else "mounted"
            return Decision(provider.name, call.args, provider, via=via, session=call.session)
        call = replace(call, unaccepted=unaccepted)
        if call.upgrade is None:
            return self._by_grant(call)
        try:
            act, verified = self._check_upgrade(provider, call.upgrade, call.session, call.now)
        except ActRefused as exc:
            return self._upgrade_refused(call, exc)
        return ReadRevoked(act_id(verified),
                           lambda revoked: self._by_upgrade(call, act, verified, revoked))

    def _upgrade_refused(self, call: _Call, exc: ActRefused) -> Step:
        """An upgrade that does not hold leaves the call to its grant; without one, the
        upgrade's refusal stands."""
        if call.grant is None:
            return _refuse(call.base, exc.code, exc.reason)
        return self._by_grant(call)

    def _by_upgrade(self, call: _Call, act: SessionUpgrade, verified: Verified,
                    revoked: bool | LedgerUntrusted) -> Step:
        """The upgrade verified for this call and the ledger said whether it is revoked:
        check the call's session proof and the upgrade's scope, then spend the proof."""
        try:
            if isinstance(revoked, LedgerUntrusted):
                raise revoked
            if revoked:
                raise ActRefused("revoked", "an operator revoked this upgrade")
            proved = check_proof(act, act_id(verified), self.name, call.provider.name,
                                 call.args, call.proof, call.now)
        except ActRefused as exc:
            return self._upgrade_refused(call, exc)
        layers = [*call.layers, ("session upgrade", act.scope)]
        problem = scope_problem(call.provider.scoped_args, call.args, layers)
        if problem is not None:
            return _refuse(call.base, problem.code, problem.reason)
        assert call.proof is not None and act.session_key is not None  # check_proof
        session_key = keyid_of(raw_public(parse_public_key(act.session_key)))
        allowed = Decision(call.provider.name, call.args, call.provider, via="upgrade",
                           act=verified, principal=act.principal, session=call.session,
                           proof=proved, signed_proof=call.proof, session_key=session_key)

        def spent(fresh: bool | LedgerUntrusted) -> Step:
            if isinstance(fresh, LedgerUntrusted):
                return _refuse(call.base, fresh.code, fresh.reason)
            if not fresh:
                return _refuse(call.base, "session_proof_replayed", "this proof was already "
                               "used; a proof runs one call, sign a new one (new at and "
                               "nonce) for each")
            return allowed

        until = spent_until(proof_lapse(call.proof), self.spent_margin_ms)
        return Spend(proved, until, call.now, spent)

    def _by_grant(self, call: _Call) -> Step:
        """Verify the call's grant for this very call, then spend it; for a tool the operator
        accepts with it, record the acceptance once it is spent."""
        provider = call.provider
        if call.grant is None:
            if call.gated:
                return _refuse(call.base, "authority_gated", "the tool is above this runtime's "
                               f"ceiling {self.ceiling}; present a grant signed for "
                               f"{grant_token(provider)} or a session upgrade")
            return _refuse(call.base, "acceptance_required", "the first call of this tool needs "
                           "an operator's signed grant naming this runtime")
        grant = call.grant
        try:
            granted, verified = self._check_grant(provider, call.args, grant, call.now,
                                                  for_acceptance=call.unaccepted)
        except ActRefused as exc:
            return _refuse(call.base, exc.code, exc.reason)
        token = grant_token(provider)
        allowed = Decision(provider.name, call.args, provider,
                           via="acceptance" if call.unaccepted else "grant", act=verified,
                           principal=granted.principal, session=call.session)

        def recorded() -> Step:
            self._accepted.add(token)
            return allowed

        def spent(fresh: bool | LedgerUntrusted) -> Step:
            if isinstance(fresh, LedgerUntrusted):
                return _refuse(call.base, fresh.code, fresh.reason)
            if not fresh:
                return _refuse(call.base, "replayed", "this grant was already used; a grant "
                               "runs one call")
            if call.unaccepted:  # mounted, so not gated: the operator accepts the tool here
                return RecordAcceptance(self.name, token, grant, recorded)
            return allowed

        until = spent_until(grant_lapse(granted), self.spent_margin_ms)
        return Spend(act_id(verified), until, call.now, spent)

    def revocation(self, env: Envelope) -> RecordRevocation | dict[str, Any]:
        """An operator's signed revocation of one of this runtime's upgrades, to record in the
        ledger (`RecordRevocation`), or the `{"refused"}` answer when it does not verify."""
        try:
            verified = self.trust.verify(env, PAYLOAD_TYPES["tool_revoke"])
            act = _decode(verified, UpgradeRevocation, "an UpgradeRevocation")
            if act.runtime != self.name:
                raise ActRefused("wrong_runtime", f"the revocation is for runtime "
                                 f"{act.runtime!r}, not {self.name!r}")
        except ActRefused as exc:
            return {"refused": {"reason": exc.code, "detail": exc.reason}}
        return RecordRevocation(act.upgrade, env, act.principal)

    # -- the signed acts --------------------------------------------------------------------------

    def _check_upgrade(self, provider: Provider, env: Envelope, session: str | None,
                       now: int) -> tuple[SessionUpgrade, Verified]:
        """Verify an upgrade for this call; ActRefused if it does not cover it. Whether it
        was revoked is the ledger's to say (`ReadRevoked`)."""
        verified = self.trust.verify(env, PAYLOAD_TYPES["tool_upgrade"])
        act = _decode(verified, SessionUpgrade, "a SessionUpgrade")
        _window(act.at, act.expires_at, now, "upgrade")
        if act.expires_at - act.at > MAX_UPGRADE_MS:
            raise ActRefused("window_too_long", f"the upgrade spans {act.expires_at - act.at} "
                             f"ms; a session upgrade spans at most {MAX_UPGRADE_MS} ms")
        if act.runtime != self.name:
            raise ActRefused("wrong_runtime", f"the upgrade is for runtime {act.runtime!r}, "
                             f"not {self.name!r}")
        if session is None or session != act.session:
            raise ActRefused("wrong_session", f"the upgrade is for session {act.session!r}, "
                             f"not {session!r}")
        if not (provider.name in (act.tools or ()) or provider.authority in (act.classes or ())):
            raise ActRefused("wrong_tool", f"the upgrade names tools {act.tools or []} and "
                             f"classes {act.classes or []}, not {provider.name} "
                             f"({provider.authority})")
        if act.scope is not None:
            try:
                check_scope(act.scope, "the upgrade's scope")
            except ValueError as exc:
                raise ActRefused("malformed", str(exc)) from None
        return act, verified

    def _check_grant(self, provider: Provider, args: dict[str, Any], env: Envelope,
                     now: int, *, for_acceptance: bool) -> tuple[ToolGrant, Verified]:
        """Verify a grant for this very call; ActRefused if it does not hold. Whether it was
        spent before is the ledger's to say (`Spend`)."""
        verified = self.trust.verify(env, PAYLOAD_TYPES["tool_grant"])
        act = _decode(verified, ToolGrant, "a ToolGrant")
        lapse = grant_lapse(act)
        _window(act.at, lapse, now, "grant")
        if lapse - act.at > MAX_GRANT_MS:
            raise ActRefused("window_too_long", f"the grant's expires_at lies {lapse - act.at}"
                             f" ms after its at; a grant lives at most {MAX_GRANT_MS // 3_600_000} h "
                             f"({MAX_GRANT_MS} ms)")
        if act.runtime is not None and act.runtime != self.name:
            raise ActRefused("wrong_runtime", f"the grant is for runtime {act.runtime!r}, "
                             f"not {self.name!r}")
        if act.tool != provider.name:
            raise ActRefused("wrong_tool", f"the grant is for tool {act.tool!r}, "
                             f"not {provider.name!r}")
        if act.grant_token != grant_token(provider):
            raise ActRefused("wrong_token", f"the grant is for {act.grant_token}; this tool is "
                             f"now {grant_token(provider)} (reclassified or re-versioned)")
        try:
            digest = args_digest(args)
        except (TypeError, msgspec.EncodeError) as exc:
            raise ActRefused("wrong_args", f"the arguments are not JSON: {exc}") from None
        if act.args_digest != digest:
            raise ActRefused("wrong_args", "the grant is for other arguments than this call's")
        if for_acceptance and act.runtime is None:
            raise ActRefused("wrong_runtime", "an L2 acceptance holds on every replica and "
                             "after a restart, so its grant must name the runtime")
        return act, verified


def _refuse(base: Decision, code: str, detail: str) -> Decision:
    assert base.provider is not None
    return Decision(base.tool, base.args, base.provider, session=base.session,
                    reply=refused(code, base.provider.authority, detail))


def _decode(verified: Verified, kind: type[Any], what: str) -> Any:
    try:
        act = msgspec.json.decode(verified.payload, type=kind)
    except msgspec.MsgspecError as exc:
        raise ActRefused("malformed", f"the signed payload is not {what}: {exc}") from None
    if act.principal != verified.principal:
        raise ActRefused("principal_mismatch", f"signed by the key of {verified.principal}, "
                         f"but speaks for {act.principal}")
    return act


def _window(at: int, lapse: int, now: int, what: str) -> None:
    if at > now + CLOCK_SKEW_MS:
        raise ActRefused("expired", f"signed at {at}, in the future (now {now})")
    if now >= lapse:
        raise ActRefused("expired", f"the {what} lapsed at {lapse} (now {now})")
