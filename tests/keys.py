"""Signing identities shared by the tests, generated once per run.

- ``ALICE``: an operator (name, private key) that every test daemon trusts.
- ``MALLORY``: an operator whose key no test daemon trusts.
- ``CHECK``, ``EVALUATOR``: identities (a CI check, an agent of another service) whose signed
  signals every test daemon verifies (`[trust.signers]`);
- ``SIGNED``, ``AGENT_A``, ``AGENT_B``: a service whose two agents sign their proposals and
  signals; every test daemon trusts both keys (`[trust.signers]`). Tests that use the service
  isolate themselves by target, not by service name;
- ``ATTESTED``, ``SERVICE``: a service whose answers to the daemon's requests are signed with
  its own key (`service:attested`), which every test daemon trusts (`[trust.signers]`), so its
  answers are attributable (core.boundary); tests that use it isolate themselves by target;
- ``VOTERS``: quorum voters' keys by name; ``quorum_daemon`` trusts them as voters, and
  ``TRUST`` is the same trust store for the pure quorum tests.
"""

from __future__ import annotations

import base64

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.core import signing
from improved.core.signing import TrustStore

ALICE = ("operator:alice", Ed25519PrivateKey.generate())
MALLORY = ("operator:mallory", Ed25519PrivateKey.generate())
CHECK = ("check:ci", Ed25519PrivateKey.generate())
EVALUATOR = ("agent:evaluators:e7", Ed25519PrivateKey.generate())
SIGNED = "signed"
AGENT_A = (f"agent:{SIGNED}:a", Ed25519PrivateKey.generate())
AGENT_B = (f"agent:{SIGNED}:b", Ed25519PrivateKey.generate())
ATTESTED = "attested"
SERVICE = (f"service:{ATTESTED}", Ed25519PrivateKey.generate())
VOTERS = {name: Ed25519PrivateKey.generate() for name in ("agent-a", "agent-b", "agent-c",
                                                          "agent-d")}
TRUST = TrustStore.from_config({
    name: base64.b64encode(signing.raw_public(k.public_key())).decode()
    for name, k in VOTERS.items()})
