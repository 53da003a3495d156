"""The tool runtimes' audit chains (`IMPROVE_TOOLS_AUDIT`), read once and verified as they
stream by, for `improved audit verify`.

A runtime's chain lives outside the daemon's log (see `improved_reference.tool_runtime` for
why): no daemon checks it and no checkpoint covers it, so this is the one place it is checked
(a checkpoint only witnesses each chain's head, `runtime_heads`, which it is checked against).
Each chain is verified on its own — hash, link, lifecycle, and, when `[trust.runtimes]` names
the runtime whose chain it is, that every trailer is signed by that runtime's key and the
signed act under it (a grant, an upgrade) verifies. A chain whose runtime has no key there is
*unverified*: its hashes and links are checked, who wrote it is not. `audit verify --since`
reads only the trailers stored since a checkpoint, and `audit verify <chain id>` one chain.
The I/O is here; every decision is `core.audit.verify_next`, `core.tools.runtime_writers`
and `core.evidence`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client

from improved.client import checkpointing
from improved.client.deployment import Deployment
from improved.core import audit, checkpoint, evidence
from improved.core.signing import TrustStore
from improved.core.tools import claimed_runtime, runtime_writers
from improved.protocol import subjects as S

HEADS_AT_ONCE = 64  # chain heads a checkpoint asks for at once


@dataclass
class _Chain:
    run: audit.ChainRun
    trust: evidence.ChainTrust | None  # None: no key for its runtime
    runtime: str | None  # trusted, or as its first trailer names it
    trailers: int = 0
    broken: audit.Break | str | None = None
    hash_at: str | None = None  # the hash of its trailer at the witnessed head, when read


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


@dataclass
class Witnesses:
    """The heads of the runtime chains the daemon's checkpoints witnessed, folded in as a
    reader meets each checkpoint (`fold`): the longest of each chain (`seen`), and a BROKEN
    line for each chain that no longer holds one of them — a head a longer one replaced is
    looked up at its stream sequence then, one direct get, so memory stays one head per
    chain however many checkpoints there are."""

    nc: Client
    seen: checkpoint.Witness = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    named: set[str] = field(default_factory=set)

    async def fold(self, body: dict[str, Any]) -> None:
        at = body.get("at")
        superseded, problems = checkpoint.witness(self.seen, checkpoint.runtime_heads(body),
                                                  at if isinstance(at, int) else 0)
        store = Deployment(self.nc, audit_stream=S.STREAM_TOOLS_AUDIT)
        for cid, head in superseded:
            if cid in self.named:
                continue
            found = await store.trailer_at(head[2])
            problem = checkpoint.witnessed_trailer_problem(
                cid, S.tools_audit(cid), head, found[:2] if found else None)
            if problem is not None:
                problems.append((cid, problem))
        for cid, problem in problems:
            if cid not in self.named:
                self.named.add(cid)
                self.lines.append(f"BROKEN {problem} ({S.STREAM_TOOLS_AUDIT})")


async def runtime_heads(nc: Client) -> tuple[checkpoint.RuntimeHead, ...]:
    """Each tool runtime's chain head on `IMPROVE_TOOLS_AUDIT` — (chain id, length, last
    hash) — for a checkpoint to witness: one stream-info listing its subjects, then the last
    message of each, so the cost follows the number of runtimes, not their history. Raises
    when the stream cannot be read (it may not exist, or this user may not read it)."""
    store = Deployment(nc, audit_stream=S.STREAM_TOOLS_AUDIT)
    info = await store.js.stream_info(S.STREAM_TOOLS_AUDIT,
                                      subjects_filter=S.TOOLS_AUDIT_FILTER)
    subjects = sorted(info.state.subjects or {})
    heads = []
    for at in range(0, len(subjects), HEADS_AT_ONCE):
        batch = subjects[at:at + HEADS_AT_ONCE]
        for subject, (seq, body) in zip(batch, await asyncio.gather(
                *(store.chain_head(subject) for subject in batch)), strict=True):
            if isinstance(body, dict) and isinstance(body.get("seq"), int) \
                    and isinstance(body.get("hash"), str):
                heads.append((S.token(subject, 3) or "", body["seq"] + 1, body["hash"], seq))
    return tuple(heads)


async def verify_tool_chains(nc: Client, runtimes: TrustStore, history: evidence.History, *,
                             since_ms: int | None = None, chain: str | None = None,
                             witnessed: checkpoint.Witness | None = None) -> ToolChains:
    """Every chain of `IMPROVE_TOOLS_AUDIT`, each against the key `runtimes` gives the runtime
    whose chain it is; signed acts against every operator key `history` ever trusted (the
    stream's sequences are not the trust chain's).

    `since_ms`: only the trailers the server stored from that time on (`audit verify
    --since`), each chain met there continued from the trailer before it. `chain`: only that
    chain, read from its first trailer (`audit verify <chain id>`). `witnessed`: the heads
    the daemon's checkpoints witnessed; a chain missing, shorter or not the same at its
    witnessed head is BROKEN (`core.checkpoint.runtime_chain_problem`)."""
    store = Deployment(nc, audit_stream=S.STREAM_TOOLS_AUDIT)
    view = await store.audit_view()
    writers = runtime_writers(runtimes)
    heads = {cid: w for cid, w in (witnessed or {}).items() if chain in (None, cid)}
    if view.created is None:
        return ToolChains(exists=False, lines=[
            f"BROKEN {checkpoint.runtime_chain_problem(cid, head, None, None)} "
            f"({S.STREAM_TOOLS_AUDIT} does not exist)" for cid, head in sorted(heads.items())])
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
                    if run.position == heads.get(cid, (0,))[0]:
                        ch.hash_at = run.prev
        ch.trailers += 1
        if isinstance(body, dict) and body.get("seq") == heads.get(cid, (0,))[0] - 1:
            ch.hash_at = body.get("hash") if isinstance(body.get("hash"), str) else ""
        if ch.broken is not None:
            continue
        if body is None:
            ch.broken = f"{cid} trailer {ch.run.position}: not a JSON trailer"
            continue
        ch.broken = audit.verify_next(ch.run, body, ch.trust, 0)
    found.trailers, found.chains = read, len(chains)
    _report(found, chains)
    for cid, head in sorted(heads.items()):
        problem = await _witnessed_problem(store, cid, head, chains.get(cid))
        if problem is not None:
            runtime = writers[cid][0] if cid in writers else (
                chains[cid].runtime if cid in chains else None)
            who = f"tool runtime {runtime}" if runtime else "a tool runtime"
            found.lines.append(f"BROKEN {problem} ({who}, {S.STREAM_TOOLS_AUDIT})")
    if chain is not None:
        return found  # a chain's own links name what is missing inside it
    start = view.first_seq if since_ms is None else (first or view.last_seq + 1)
    expected = view.last_seq - start + 1 if view.last_seq else 0
    if (since_ms is None and view.first_seq > 1) or read < expected:
        found.lines.append(
            f"BROKEN {S.STREAM_TOOLS_AUDIT} holds {read} readable trailers at sequences "
            f"{start}..{view.last_seq}: trailers were removed, lost or are unreadable")
    return found


async def _witnessed_problem(store: Deployment, cid: str, head: checkpoint.Witnessed,
                             read: _Chain | None) -> str | None:
    """Whether the chain `cid` still holds the head a checkpoint witnessed: its length from
    its last message (one direct get), its trailer at the witnessed position from the read
    (or from that last message when it is the one)."""
    _, last = await store.chain_head(S.tools_audit(cid))
    length = last.get("seq") if isinstance(last, dict) else None
    length = length + 1 if isinstance(length, int) else None
    hash_at: str | None = read.hash_at if read is not None else None
    if isinstance(last, dict) and length == head[0]:
        hash_at = last.get("hash") if isinstance(last.get("hash"), str) else ""
    return checkpoint.runtime_chain_problem(cid, head, length, hash_at)


def _report(found: ToolChains, chains: dict[str, _Chain]) -> None:
    """A BROKEN or UNVERIFIED line for each chain that is either, by runtime; the counts."""
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
