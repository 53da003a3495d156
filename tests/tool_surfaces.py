"""Builders for the tool-surface tests (SPEC 09 §3.1): a runtime holding a read (L0), a write
(L2) and a deploy (L4) tool whose bodies count their calls, its gate over a ledger, and grants
signed by ALICE. The same helpers serve the library tests and the tests over a real
nats-server."""

from __future__ import annotations

import base64
import secrets

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.core import signing
from improved.core.scopes import CapabilityScope
from improved.core.tools import (
    Provider,
    Runtime,
    SessionProof,
    public_key_b64,
    sign_grant,
    sign_proof,
    sign_upgrade,
    upgrade_id,
)
from improved.protocol.model import Envelope
from improved_reference.tool_gate import Ledger, ToolGate
from tests.keys import ALICE

NOW = 1768471200000
ARGS = {"path": "/srv/data", "force": True}
SESSION = Ed25519PrivateKey.generate()  # the key an upgraded session holds


def trust() -> signing.TrustStore:
    public = base64.b64encode(signing.raw_public(ALICE[1].public_key())).decode()
    return signing.TrustStore.from_config({ALICE[0]: public})


class Counter:
    """A tool body that records each call's arguments."""

    def __init__(self, result="done"):
        self.calls: list[dict] = []
        self.result = result

    def __call__(self, args):
        self.calls.append(args)
        return self.result


def tool(name: str, authority: str, version: str | None = "1") -> tuple[Provider, Counter]:
    body = Counter(result=f"{name} ran")
    return Provider(name, authority, f"the {name} tool", body, version), body


SCOPE = CapabilityScope(paths=["/srv/data/**", "/tmp/*.log"], sets=["blue", "green"],
                        origins=["https://api.example.com", "http://localhost:8080"])
SCOPED_ARGS = {"path": "path", "paths": "path", "set": "set", "url": "origin"}


def scoped(name: str = "files", authority: str = "L0", scope: CapabilityScope = SCOPE,
           ) -> tuple[Provider, Counter]:
    """A tool that touches paths, sets and origins, within SCOPE."""
    body = Counter(result=f"{name} ran")
    return Provider(name, authority, f"the {name} tool", body, "1", scope, SCOPED_ARGS), body


def runtime(mode: str = "autonomous", name: str = "agent", ceiling: str | None = None,
            **kw) -> tuple[Runtime, dict[str, tuple[Provider, Counter]]]:
    rt = Runtime(name, ceiling, trust(), mode, **kw)
    tools = {n: tool(n, a) for n, a in (("read", "L0"), ("write", "L2"), ("deploy", "L4"))}
    for provider, _ in tools.values():
        rt.register(provider)
    return rt, tools


def gate(mode: str = "autonomous", name: str = "agent", ceiling: str | None = None, *,
         ledger: Ledger | None = None, **kw) -> tuple[ToolGate, dict[str, tuple[Provider, Counter]]]:
    """`runtime(...)`'s gate over `ledger` (a ProcessLedger of its own unless given)."""
    rt, tools = runtime(mode, name, ceiling, **kw)
    return ToolGate(rt, ledger), tools


def grant(provider: Provider, args=ARGS, *, key=ALICE, now: int = NOW, **kw) -> Envelope:
    kw.setdefault("nonce", secrets.token_hex(16))
    return sign_grant(key[1], key[0], provider, provider.name, args, "ticket 42", now, **kw)


def by_name(catalog: list[dict]) -> dict[str, dict]:
    return {entry["name"]: entry for entry in catalog}



def upgrade(runtime_name: str = "agent", session: str = "s-1", *, key=ALICE, now: int = NOW,
            ttl_ms: int = 600_000, session_key: Ed25519PrivateKey | None = SESSION,
            **kw) -> Envelope:
    """ALICE's upgrade of one session, bound to `session_key` (SESSION; None: unbound): by
    default every L4 tool, for ten minutes."""
    if "tools" not in kw:
        kw.setdefault("classes", ["L4"])
    kw.setdefault("nonce", secrets.token_hex(16))
    bound = public_key_b64(session_key) if session_key is not None else None
    return sign_upgrade(key[1], key[0], runtime_name, session, "incident 7", now, ttl_ms,
                        session_key=bound, **kw)


def proof(env: Envelope, tool_name: str, args=None, *, runtime_name: str = "agent",
          key: Ed25519PrivateKey = SESSION, now: int = NOW, nonce: str | None = None,
          ) -> SessionProof:
    """The session's proof for one call of `tool_name(args)` under the upgrade `env`."""
    return sign_proof(key, runtime_name, tool_name, {} if args is None else args,
                      upgrade_id(env), now, nonce=nonce or secrets.token_hex(16))
