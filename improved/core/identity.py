"""Who an emitter verifiably is, and whether it is the proposer (SPEC 09 §5).

Independence rests only on a verified identity, never on a string a sender writes itself: an
actor or session string is recorded but proves nothing. An identity is one of

- `service:<svc>` — the service whose subject carried the message, when the deployment's NATS
  permissions bind each service to its own subjects (`[trust] subjects_bound`), or the
  principal of a key bound to that service;
- `agent:<svc>:<name>` — an agent of service `<svc>`, by the key bound to it;
- `check:<name>` — an out-of-band check (CI, a probe), by its key;
- `operator:<name>` — an operator, by their key;

compared exactly in this form. An unsigned proposal is the whole proposing service's: every
identity of that service (its subject, its agents) is the proposer, and so is every identity
of the service its origin declares (a declared string may only ever make evidence *less*
independent). A signed proposal (a DSSE envelope by `agent:<svc>:<name>` or `service:<svc>`,
`proposer_problem`) is its signer's and the service's: another verified agent of the same
service is then independent evidence (SPEC 09 §5: "a different agent"), except for `world`
signals, which must come from another service. Pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

IDENTITY_RE: Final = re.compile(
    r"^(service:[a-z][a-z0-9_-]{0,62}|agent:[a-z][a-z0-9_-]{0,62}:[a-z0-9][a-z0-9._-]{0,62}"
    r"|check:[a-z0-9][a-z0-9._-]{0,62}|operator:[A-Za-z0-9._@+-]{1,128})\Z")
UNVERIFIED: Final = ""  # no identity could be verified: recorded, never independent


def of_subject(svc: str) -> str:
    """The identity a subject `<svc>` proves when services are bound to their subjects."""
    return f"service:{svc}"


def service_of(identity: str) -> str | None:
    """The service an identity belongs to (`service:` and `agent:`), else None."""
    kind, _, rest = identity.partition(":")
    if kind in ("service", "agent"):
        return rest.split(":", 1)[0]
    return None


@dataclass(frozen=True)
class Proposer:
    """Who made a proposal, as far as it can be told: the service whose subject carried it,
    the service its origin declares, and the principal whose key signed it (None: unsigned)."""

    service: str
    declared: str = ""
    principal: str | None = None

    @property
    def services(self) -> frozenset[str]:
        return frozenset(s for s in (self.service, self.declared) if s)


def proposer_problem(identity: str, svc: str) -> str | None:
    """Why `identity` may not sign a proposal of service `svc`, or None: only the service
    itself (`service:<svc>`) and its agents (`agent:<svc>:<name>`) propose for it."""
    if identity.partition(":")[0] not in ("service", "agent"):
        return (f"{identity} is not an agent or a service: a proposal is signed by "
                f"agent:{svc}:<name> or service:{svc}")
    if service_of(identity) != svc:
        return (f"{identity} belongs to another service than {svc!r}: a proposal of {svc} is "
                f"signed by agent:{svc}:<name> or service:{svc}")
    return None


def same_party(emitter: str, proposer: Proposer) -> bool:
    """Whether `emitter` may be the proposer: the proposing service itself and the very
    principal that signed always. Unsigned, or signed by `service:<svc>` (the service as a
    whole), every identity of the proposing services. Signed by one agent, the other agents
    of its service are other parties; those of a service the origin declares besides stay the
    proposer's (a declared string only ever makes evidence less independent)."""
    if emitter in {of_subject(s) for s in proposer.services} or emitter == proposer.principal:
        return True
    home = service_of(emitter)
    if proposer.principal is None or proposer.principal.startswith("service:"):
        return home in proposer.services
    return home in proposer.services - {proposer.service}


def independent(kind: str, emitter: str, proposer: Proposer, at: int, applied_at: int | None,
                effect_window_ms: int) -> bool:
    """Independent evidence: a verified emitter that is not the proposer; a `world` signal
    must also come from another service and fall inside the effect window after apply."""
    if emitter == UNVERIFIED or same_party(emitter, proposer):
        return False
    if kind == "world":
        home = service_of(emitter)
        if home is None or home in proposer.services or applied_at is None:
            return False
        return applied_at <= at <= applied_at + effect_window_ms
    return True


def measures(emitter: str, owner: str) -> bool:
    """Whose metric readings may act (roll back, count toward the breaker): the owning service
    itself, by its subject or key, or a signed out-of-band check. Others are evidence only."""
    return emitter == of_subject(owner) or emitter.startswith("check:")
