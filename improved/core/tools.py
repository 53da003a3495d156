"""Tool-surface authority for agent runtimes (SPEC 09 §3.1): the L0–L4 gradient, per call.

An agent must be able to *see* every tool it could be given, and *use* only what its runtime's
authority allows; a tool it cannot use is gated, never hidden, so the agent can ask an operator
for it instead of concluding it does not exist. Hence two registers:

- the catalog lists every provider, with a stable `grant_token` naming exactly this tool at
  this class and version;
- the mount set is what the runtime invokes on its own: providers at or under its ceiling.

Classes per call are L0, L2 and L4 (L1/L3 are skill-lifecycle states). An interactive runtime
(operator in the loop) ceilings at L4, an autonomous one at L2 and no higher: nobody is there
to stand behind an L4 call, so each one needs its own signed `ToolGrant`. The grant binds the
tool, its token (so a reclassified or re-versioned tool needs a new grant), the digest of the
exact arguments, and a time window; it runs once. In an autonomous runtime an L2 provider's
first call also needs a grant (operator acceptance); after one accepted call, it runs freely.

Pure: no NATS, no clock of its own (`now_ms` is passed in), no logging. A refusal changes
nothing: the tool is not called and the grant is not spent. Replay memory and acceptances live
in this process: replicas of one runtime, or a restart, do not share them (a grant's short TTL
bounds what that allows).
"""

from __future__ import annotations

import hashlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from msgspec import Meta

from improved.core.signing import PAYLOAD_TYPES, ActRefused, TrustStore, sign
from improved.protocol import subjects as S
from improved.protocol.model import Actor, Envelope, Millis, ServiceName, ShortText, _In, to_json

Authority = Literal["L0", "L2", "L4"]
Mode = Literal["interactive", "autonomous"]

AUTHORITIES: tuple[str, ...] = ("L0", "L2", "L4")
DEFAULT_CEILINGS: dict[str, str] = {"interactive": "L4", "autonomous": "L2"}
MAX_CEILING: dict[str, str] = {"interactive": "L4", "autonomous": "L2"}
NAME_RE = re.compile(r"^[a-z][a-z0-9_.-]{0,127}\Z")
CLOCK_SKEW_MS = 5 * 60 * 1000  # how far a grant's `at` may lie ahead; its default lifetime too
ERROR_LIMIT = 500  # characters of a failed tool's error text

ToolName = Annotated[str, Meta(pattern=NAME_RE.pattern)]
GrantToken = Annotated[str, Meta(pattern=r"^gt:[0-9a-f]{64}\Z")]
Sha256Hex = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}\Z")]


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
    """One tool: its name, its change class, and the callable that runs it."""

    name: str
    authority: str
    description: str
    run: Callable[[dict[str, Any]], Any]  # sync, or returning an awaitable
    version: str | None = None

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


class ToolGrant(_In):
    """An operator's signed permission for one call of one tool with exactly these arguments."""

    tool: ToolName
    grant_token: GrantToken
    args_digest: Sha256Hex
    principal: Actor
    reason: ShortText
    at: Millis
    nonce: Annotated[str, Meta(min_length=8, max_length=128)]
    expires_at: Millis | None = None
    runtime: ServiceName | None = None  # when set, only that runtime may use the grant


def sign_grant(key: Ed25519PrivateKey, principal: str, provider_or_token: Provider | str,
               tool: str, args: dict[str, Any], reason: str, now_ms: int,
               ttl_ms: int = CLOCK_SKEW_MS, *, nonce: str,
               runtime: str | None = None) -> Envelope:
    """A DSSE envelope granting one call of `tool(args)`, valid for `ttl_ms` from `now_ms`;
    `nonce` (random, e.g. secrets.token_hex(16)) makes two grants for the same call differ."""
    token = (grant_token(provider_or_token) if isinstance(provider_or_token, Provider)
             else provider_or_token)
    grant = ToolGrant(tool=tool, grant_token=token, args_digest=args_digest(args),
                      principal=principal, reason=reason, at=now_ms,
                      expires_at=now_ms + ttl_ms, nonce=nonce,
                      runtime=runtime)
    return sign(PAYLOAD_TYPES["tool_grant"], to_json(grant), key)


def refused(reason: str, required: str, detail: str | None = None) -> dict[str, Any]:
    body = {"reason": reason, "required": required}
    if detail:
        body["detail"] = detail
    return {"refused": body}


def not_found(name: str) -> dict[str, Any]:
    return {"error": {"code": "not_found", "message": f"no tool named {name!r}", "field": "tool"}}


class Runtime:
    """An agent runtime's catalog and mount set, and the gate every call goes through."""

    def __init__(self, name: str, ceiling: str | None = None, trust: TrustStore | None = None,
                 mode: Mode = "autonomous"):
        if not isinstance(name, str) or not S.SERVICE_RE.match(name):
            raise ValueError(f"runtime name {name!r} must match {S.SERVICE_RE.pattern}")
        if mode not in DEFAULT_CEILINGS:
            raise ValueError(f"mode {mode!r} is not 'interactive' or 'autonomous'")
        ceiling = DEFAULT_CEILINGS[mode] if ceiling is None else ceiling
        _check_authority(ceiling, "ceiling")
        if _rank(ceiling) > _rank(MAX_CEILING[mode]):
            raise ValueError(f"an {mode} runtime's ceiling is at most {MAX_CEILING[mode]}: "
                             "with no operator in the loop, L4 calls run under per-call grants")
        self.name, self.ceiling, self.mode = name, ceiling, mode
        self.trust = trust or TrustStore()
        self._providers: dict[str, Provider] = {}
        self._accepted: set[str] = set()  # grant tokens of L2 providers accepted by an operator
        self._used: dict[str, int] = {}  # digest of a spent grant → when it lapses (ms)

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
        """A mounted L2 provider of an autonomous runtime whose first call was not accepted."""
        return (self.mode == "autonomous" and provider.authority == "L2"
                and self.mounted(provider) and grant_token(provider) not in self._accepted)

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
            out.append(entry)
        return out

    async def invoke(self, name: str, args: dict[str, Any] | None,
                     grant: Envelope | None, now_ms: int) -> dict[str, Any]:
        """`{"ok": true, "result"}`, `{"ok": false, "error"}` (the tool raised), `{"refused"}`
        (nothing ran), or the not_found error reply for a name not in the catalog.

        A grant is looked at only when the call needs one; otherwise it is ignored, unspent."""
        provider = self._providers.get(name)
        if provider is None:
            return not_found(name)
        args = {} if args is None else args
        if not isinstance(args, dict):
            raise TypeError(f"args must be a dict, not {type(args).__name__}")
        now = now_ms
        gated, unaccepted = not self.mounted(provider), self.needs_acceptance(provider)
        reply: dict[str, Any] = {}
        if gated or unaccepted:
            if grant is None:
                if gated:
                    return refused("authority_gated", provider.authority, "the tool is above "
                                   f"this runtime's ceiling {self.ceiling}; present a grant "
                                   f"signed for {grant_token(provider)}")
                return refused("acceptance_required", provider.authority, "the first call of "
                               "this tool needs an operator's signed grant")
            try:
                act = self._check_grant(provider, args, grant, now)
            except ActRefused as exc:
                return refused(exc.code, provider.authority, exc.reason)
            if unaccepted:
                self._accepted.add(grant_token(provider))
            reply["granted_by"] = act.principal
        try:
            result = provider.run(args)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:ERROR_LIMIT], **reply}
        return {"ok": True, "result": result, **reply}

    def _check_grant(self, provider: Provider, args: dict[str, Any], env: Envelope,
                     now: int) -> ToolGrant:
        """Verify a grant for this very call and spend it; ActRefused (nothing spent) if not."""
        verified = self.trust.verify(env, PAYLOAD_TYPES["tool_grant"])
        try:
            act = msgspec.json.decode(verified.payload, type=ToolGrant)
        except msgspec.MsgspecError as exc:
            raise ActRefused("malformed", f"the signed payload is not a ToolGrant: {exc}") from None
        if act.principal != verified.principal:
            raise ActRefused("principal_mismatch", f"signed by the key of {verified.principal}, "
                             f"but speaks for {act.principal}")
        # The payload carries a nonce: its digest names the act however the envelope is dressed
        # (an extra signature, say), the envelope digest names this very message.
        digests = (verified.digest, hashlib.sha256(verified.payload).hexdigest())
        self._used = {d: lapse for d, lapse in self._used.items() if lapse > now}
        if any(d in self._used for d in digests):
            raise ActRefused("replayed", "this grant was already used; a grant runs one call")
        lapse = act.expires_at if act.expires_at is not None else act.at + CLOCK_SKEW_MS
        if act.at > now + CLOCK_SKEW_MS:
            raise ActRefused("expired", f"signed at {act.at}, in the future (now {now})")
        if now >= lapse:
            raise ActRefused("expired", f"the grant lapsed at {lapse} (now {now})")
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
        for d in digests:  # kept past the lapse by the skew, so a clock step back cannot revive it
            self._used[d] = lapse + CLOCK_SKEW_MS
        return act
