"""The tool runtimes' audit chains (`IMPROVE_TOOLS_AUDIT`), read once and verified as they
stream by, for `improved audit verify`.

A runtime's chain lives outside the daemon's log (see `improved_reference.tool_runtime` for
why): no daemon reads it and no checkpoint covers it, so this is the one place it is checked.
Each chain is verified on its own — hash, link, lifecycle, and, when `[trust.runtimes]` names
the runtime whose chain it is, that every trailer is signed by that runtime's key and the
signed act under it (a grant, an upgrade) verifies. A chain whose runtime has no key there is
*unverified*: its hashes and links are checked, who wrote it is not. `audit verify --since`
reads only the trailers stored since a checkpoint, and `audit verify <chain id>` one chain.
The I/O is here; every decision is `core.audit.verify_next`, `core.tools.runtime_writers`
and `core.evidence`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.client import Client

from improved.core import audit, evidence
from improved.core.signing import TrustStore
from improved.core.tools import claimed_runtime, runtime_writers
from improved.protocol import subjects as S
from improved.runtime import checkpointing
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


async def verify_tool_chains(nc: Client, runtimes: TrustStore, history: evidence.History, *,
                             since_ms: int | None = None, chain: str | None = None,
                             ) -> ToolChains:
    """Every chain of `IMPROVE_TOOLS_AUDIT`, each against the key `runtimes` gives the runtime
    whose chain it is; signed acts against every operator key `history` ever trusted (the
    stream's sequences are not the trust chain's).

    `since_ms`: only the trailers the server stored from that time on (`audit verify
    --since`), each chain met there continued from the trailer before it. `chain`: only that
    chain, read from its first trailer (`audit verify <chain id>`)."""
    store = Store(nc, audit_stream=S.STREAM_TOOLS_AUDIT)
    view = await store.audit_view()
    if view.created is None:
        return ToolChains(exists=False)
    writers = runtime_writers(runtimes)
    acts = evidence.History(fallback=evidence.ever(history))
    found = ToolChains(exists=True)
    chains: dict[str, _Chain] = {}
    read = first = 0
    filter_ = S.TOOLS_AUDIT_FILTER if chain is None else S.tools_audit(chain)
    async for seq, subject, body, headers in store.follow(filter_, 1, view.last_seq,
                                                          start_ms=since_ms):
        read += 1
        first = first or seq
        cid = S.token(subject, 3) or ""
        ch = chains.get(cid)
        if ch is None:
            writer = writers.get(cid)
            trust = evidence.ChainTrust(frozenset({writer[1]}), acts, writer="runtime") \
                if writer else None
            named = writer[0] if writer else (
                claimed_runtime(body, cid) if isinstance(body, dict) else None)
            ch = chains[cid] = _Chain(audit.ChainRun.start(cid, trust), trust, named)
            if since_ms is not None and isinstance(body, dict) and body.get("seq") != 0:
                run = await checkpointing.continue_run(store, subject, body, headers, seq,
                                                       trust)
                if isinstance(run, str):
                    ch.broken = run
                else:
                    ch.run = run
        ch.trailers += 1
        if ch.broken is not None:
            continue
        if body is None:
            ch.broken = f"{cid} trailer {ch.run.position}: not a JSON trailer"
            continue
        ch.broken = audit.verify_next(ch.run, body, ch.trust, 0)
    found.trailers, found.chains = read, len(chains)
    for cid, ch in sorted(chains.items(), key=lambda kv: kv[1].runtime or kv[0]):
        who = f"tool runtime {ch.runtime}" if ch.runtime else "a tool runtime"
        if ch.broken is not None:
            found.broken += 1
            found.lines.append(f"BROKEN {ch.broken} ({who}, {S.STREAM_TOOLS_AUDIT})")
        elif ch.trust is None:
            found.unverified += 1
            name = ch.runtime or "?"
            found.lines.append(
                f"UNVERIFIED {cid}: {ch.trailers} trailers of {who} hash and link, but "
                f"[trust.runtimes] has no key for {name}, so who wrote them is not checked "
                f"(add {name} = \"<base64 public key>\" to verify them)"
                if ch.runtime else
                f"UNVERIFIED {cid}: {ch.trailers} trailers hash and link, but they name no "
                "runtime whose chain this is and [trust.runtimes] has no key for it, so who "
                "wrote them is not checked")
        else:
            found.verified += 1
    if chain is not None:
        return found  # a chain's own links name what is missing inside it
    start = view.first_seq if since_ms is None else (first or view.last_seq + 1)
    expected = view.last_seq - start + 1 if view.last_seq else 0
    if (since_ms is None and view.first_seq > 1) or read < expected:
        found.lines.append(
            f"BROKEN {S.STREAM_TOOLS_AUDIT} holds {read} readable trailers at sequences "
            f"{start}..{view.last_seq}: trailers were removed, lost or are unreadable")
    return found
