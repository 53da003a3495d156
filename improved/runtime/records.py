"""A proposal's record as its chain says: rebuilt from the verified chain, and remembered by this
process for what it committed itself. Nothing else is read for a decision: the retained
records are outputs anyone on the bus could rewrite.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from improved.client.chain_writer import decode_trailer
from improved.core import audit, propose
from improved.core.policy import Policy
from improved.core.record import ProposalRecord
from improved.protocol import subjects as S
from improved.runtime.autonomy import AutonomyChain
from improved.runtime.store import Store
from improved.runtime.trusting import TrustInForce

CACHE_SIZE = 10_000  # records kept in memory per process (the chains hold all of them)


class ChainBroken(ValueError):
    """A chain the daemon was about to decide on does not verify: a trailer no trusted daemon
    wrote, or authority no valid signed act backs. A crisis is open; nothing is decided on it."""


class ChainRecords:
    """Records by proposal id, from the chains; a chain that does not verify opens a crisis on
    the autonomy chain (`verified`)."""

    def __init__(self, store: Store, trust: TrustInForce, autonomy: AutonomyChain,
                 policy: Policy):
        self.store = store
        self.trust = trust
        self.autonomy = autonomy
        self.policy = policy
        # what this process committed itself, or last rebuilt, by proposal id
        self.cache: OrderedDict[str, ProposalRecord] = OrderedDict()
        # with tracing on: each proposal's trace context (a `traceparent`), kept beside its
        # record and never on its chain; forgotten as the records are (runtime/telemetry.py)
        self.traces: OrderedDict[str, str] = OrderedDict()

    def trace_of(self, pid: str) -> str | None:
        """The trace `pid`'s spans continue, if this process knows one."""
        return self.traces.get(pid)

    def keep_trace(self, pid: str, traceparent: str) -> None:
        """Keep `pid`'s trace context, the oldest forgotten beyond CACHE_SIZE."""
        self.traces[pid] = traceparent
        self.traces.move_to_end(pid)
        while len(self.traces) > CACHE_SIZE:
            self.traces.popitem(last=False)

    async def load(self, svc: str, pid: str, fresh: bool) -> ProposalRecord | None:
        """The record to decide on: what this process holds (its memory) unless `fresh`, else
        the chain's, rebuilt and remembered; None when there is no chain."""
        if not fresh and self.held(svc, pid):
            self.cache.move_to_end(pid)
            return self.cache[pid]
        return await self.resync(svc, pid)

    async def service_of(self, pid: str) -> str | None:
        """The service whose chain holds `pid`: known here when this process holds its record
        (it committed to that chain), else looked up on the audit stream."""
        held = self.cache.get(pid)
        if held is not None:
            return held.service
        return await self.store.service_of(pid)

    async def truth(self, svc: str, pid: str) -> ProposalRecord | None:
        """A proposal's record as this process committed it or as its chain says."""
        if self.held(svc, pid):
            return self.cache[pid]
        return await self.rebuild(svc, pid)

    def held(self, svc: str, pid: str) -> bool:
        """Whether this process holds `pid`'s record as a proposal of `svc`: a message on
        another service's subject naming it finds nothing here, as it finds no chain of
        that service's, whatever this process happens to remember."""
        held = self.cache.get(pid)
        return held is not None and held.service == svc

    def remember(self, record: ProposalRecord) -> None:
        """Hold `record` as this process committed it (or rebuilt it), the oldest forgotten
        beyond CACHE_SIZE."""
        self.cache[record.proposal_id] = record
        self.cache.move_to_end(record.proposal_id)
        while len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)

    async def resync(self, svc: str, pid: str) -> ProposalRecord | None:
        """The record its chain says (the chain is authoritative), remembered."""
        rebuilt = await self.rebuild(svc, pid)
        if rebuilt is not None:
            self.remember(rebuilt)
        return rebuilt

    async def rebuild(self, svc: str, pid: str) -> ProposalRecord | None:
        """A proposal's record from its chain alone (the registration carries the proposal)."""
        chain = await self.store.read_chain(svc, pid)
        if not chain:
            return None
        await self.verified(svc, pid, chain)
        trailers = [decode_trailer(body) for _, body in chain]
        return propose.rebuild_record(trailers, [seq for seq, _ in chain], self.policy)

    async def verified(self, svc: str, chain_id: str,
                       chain: list[tuple[int, dict[str, Any]]]) -> None:
        """Believe a chain only when it verifies — hashes, links, a trusted daemon's signature
        on every trailer, a valid signed act under every authority — else open a crisis and
        raise ChainBroken."""
        brk = audit.verify_chain(chain_id, [body for _, body in chain], self.trust.chain_trust,
                                 [seq for seq, _ in chain],
                                 None if svc in S.MESH_CHAINS else svc)
        if brk is not None:
            await self.autonomy.chain_broken(f"{svc}/{brk}")
            raise ChainBroken(f"{svc}/{brk}")
