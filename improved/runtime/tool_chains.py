"""The tool runtimes' audit chains (`IMPROVE_TOOLS_AUDIT`), read once and verified as they
stream by, for `improved audit verify`.

A runtime's chain lives outside the daemon's log (see `improved_reference.tool_runtime` for
why): no daemon reads it and no checkpoint covers it, so this is the one place it is checked.
Each chain is verified on its own — hash, link, lifecycle, and, when `[trust.runtimes]` names
the runtime whose chain it is, that every trailer is signed by that runtime's key and the
signed act under it (a grant, an upgrade) verifies. A chain whose runtime has no key there is
*unverified*: its hashes and links are checked, who wrote it is not. The I/O is here; every
decision is `core.audit.verify_next`, `core.tools.runtime_writers` and `core.evidence`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.client import Client

from improved.core import audit, evidence
from improved.core.signing import TrustStore
from improved.core.tools import claimed_runtime, runtime_writers
from improved.protocol import subjects as S
from improved.runtime.store import Store


@dataclass
class _Chain:
    run: audit.ChainRun
    trust: evidence.ChainTrust | None  # None: no key for its runtime
    runtime: str | None  # trusted, or as its first trailer names it
    trailers: int = 0
    broken: audit.Break | str | None = None


@dataclass
class ToolChains:
    """What the read found: `exists` False when there is no such stream (no runtime recorded a
    call here yet); `lines` the BROKEN and UNVERIFIED lines, one per chain at most."""

    exists: bool
    trailers: int = 0
    chains: int = 0
    verified: int = 0
    unverified: int = 0
    broken: int = 0
    lines: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.unverified or self.broken or any(
            line.startswith("BROKEN") for line in self.lines))

    def summary(self) -> str:
        return (f"tool runtimes ({S.STREAM_TOOLS_AUDIT}): {self.verified}/{self.chains} chains "
                f"verified, {self.trailers} trailers"
                + (f", {self.unverified} unverified" if self.unverified else "")
                + (f", {self.broken} broken" if self.broken else ""))


async def verify_tool_chains(nc: Client, runtimes: TrustStore,
                             history: evidence.History) -> ToolChains:
    """Every chain of `IMPROVE_TOOLS_AUDIT`, each against the key `runtimes` gives the runtime
    whose chain it is; signed acts against every operator key `history` ever trusted (the
    stream's sequences are not the trust chain's)."""
    store = Store(nc, audit_stream=S.STREAM_TOOLS_AUDIT)
    view = await store.audit_view()
    if view.created is None:
        return ToolChains(exists=False)
    writers = runtime_writers(runtimes)
    acts = evidence.History(fallback=evidence.ever(history))
    found = ToolChains(exists=True)
    chains: dict[str, _Chain] = {}
    read = 0
    async for _, subject, body, _ in store.follow(S.TOOLS_AUDIT_FILTER, 1, view.last_seq):
        read += 1
        cid = S.token(subject, 3) or ""
        chain = chains.get(cid)
        if chain is None:
            writer = writers.get(cid)
            trust = evidence.ChainTrust(frozenset({writer[1]}), acts, writer="runtime") \
                if writer else None
            named = writer[0] if writer else (
                claimed_runtime(body, cid) if isinstance(body, dict) else None)
            chain = chains[cid] = _Chain(audit.ChainRun.start(cid, trust), trust, named)
        chain.trailers += 1
        if chain.broken is not None:
            continue
        if body is None:
            chain.broken = f"{cid} trailer {chain.run.position}: not a JSON trailer"
            continue
        chain.broken = audit.verify_next(chain.run, body, chain.trust, 0)
    found.trailers, found.chains = read, len(chains)
    for cid, chain in sorted(chains.items(), key=lambda kv: kv[1].runtime or kv[0]):
        who = f"tool runtime {chain.runtime}" if chain.runtime else "a tool runtime"
        if chain.broken is not None:
            found.broken += 1
            found.lines.append(f"BROKEN {chain.broken} ({who}, {S.STREAM_TOOLS_AUDIT})")
        elif chain.trust is None:
            found.unverified += 1
            name = chain.runtime or "?"
            found.lines.append(
                f"UNVERIFIED {cid}: {chain.trailers} trailers of {who} hash and link, but "
                f"[trust.runtimes] has no key for {name}, so who wrote them is not checked "
                f"(add {name} = \"<base64 public key>\" to verify them)"
                if chain.runtime else
                f"UNVERIFIED {cid}: {chain.trailers} trailers hash and link, but they name no "
                "runtime whose chain this is and [trust.runtimes] has no key for it, so who "
                "wrote them is not checked")
        else:
            found.verified += 1
    expected = view.last_seq - view.first_seq + 1 if view.last_seq else 0
    if view.first_seq > 1 or read < expected:
        found.lines.append(
            f"BROKEN {S.STREAM_TOOLS_AUDIT} holds {read} readable trailers at sequences "
            f"{view.first_seq}..{view.last_seq}: trailers were removed, lost or are unreadable")
    return found
