"""improved: the self-improve daemon of a service mesh, and the client its services use.

Layers, each importing only the ones listed before it (tests/unit/test_architecture.py holds it):

- ``improved.protocol`` — the wire contract: messages, subjects, error replies, the canonical
  OMS encoding, CAL. No I/O.
- ``improved.core`` — every decision, pure: the stages (propose, triage, apply, learn-back),
  the guards and the L0–L4 gradient, the record replayed from its audit chain, signed
  authority, the quorum, the breaker, last-known-good, tool surfaces, checkpoints, and the
  planner that picks each proposal's next step. No I/O, no clock, no randomness.
- ``improved.client`` — what a mesh service needs: `MeshClient` (propose, refine, signal,
  serve its ApplyOrders), the check, on the audit chain, that an order was accepted, the
  connection to the bus as its own user, its key file, its streams brought to their
  configuration and the append to its own chain (which the daemon's store extends); and what
  an operator or an auditor reads a deployment with: its chains, records and indexes, the
  verifiers of checkpoints, epochs and tool chains, the configuration file.
- ``improved.runtime`` — the daemon's imperative shell: the store over JetStream (the
  appends and writes, on the client's reads), the engine that carries out the planner's
  steps, the daemon's consumers, sealing and archiving epochs, metrics, the embedded
  nats-server and its users.
- ``improved.cli`` — the `improved` command, on the client; only `run`, `provision` and
  `accounts`, the commands that are the daemon's shell, import the runtime.
- ``improved.testing`` — a real broker, a real daemon and valid proposals for tests.

Outside this package, each depending on it and never the other way round:

- ``improved_reference`` (``services/``) — the reference mesh services: like any mesh service
  they stand on ``improved.client`` (with the protocol and the core), never on
  ``improved.runtime``, ``improved.cli`` or ``improved.testing``, and import neither the
  bench nor the demo.
- ``improved_bench`` (``benchmarks/``) and ``improved_demo`` (``examples/``) — ``improved
  bench`` and ``improved demo``: they run a daemon next to the reference services, so they
  import both; nothing imports them (the commands find them through the
  ``improved.commands`` entry points).

This module re-exports what a mesh-service author writes against. The client's names are
loaded on first use (`__getattr__`), so importing a pure layer (`improved.core.planner`,
`improved.protocol`), which imports this package first, loads neither nats nor asyncio.
"""

import importlib as _importlib
import typing as _typing

from improved.protocol.model import (
    AnalyzerRef,
    ApplyOrder,
    ApplyOutcome,
    ApplyReport,
    ApplyResult,
    ClassifyReply,
    ClassifyRequest,
    LearnBack,
    MetricSnapshot,
    Origin,
    Proposal,
    ProposalEdit,
    ProposalState,
    ProposeReply,
    RefineReply,
    Signal,
    Summary,
    Trailer,
    TriageDecision,
)

if _typing.TYPE_CHECKING:
    from improved.client.sdk import (
        ImproveError,
        MeshClient,
        decode_order,
        failed,
        inbox_prefix,
        serve_spec,
    )

__version__ = "0.1.0"

__all__ = [
    "AnalyzerRef",
    "ApplyOrder",
    "ApplyOutcome",
    "ApplyReport",
    "ApplyResult",
    "ClassifyReply",
    "ClassifyRequest",
    "ImproveError",
    "LearnBack",
    "MeshClient",
    "MetricSnapshot",
    "Origin",
    "Proposal",
    "ProposalEdit",
    "ProposalState",
    "ProposeReply",
    "RefineReply",
    "Signal",
    "Summary",
    "Trailer",
    "TriageDecision",
    "__version__",
    "decode_order",
    "failed",
    "inbox_prefix",
    "serve_spec",
]

_LAZY = {name: "improved.client.sdk" for name in (
    "ImproveError", "MeshClient", "decode_order", "failed", "inbox_prefix", "serve_spec")}


def __getattr__(name: str) -> object:
    """A client name, imported (with nats) the first time it is asked for, then kept."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
