"""A proposal's record as its chain says: rebuilt from the verified chain, and remembered by this
process for what it committed itself. The state bucket is an output anyone on the bus could
rewrite: it is read for its revision only, and put back when it disagrees with the chain.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import structlog

from improved.client.chain_writer import decode_trailer
from improved.core import audit, propose
from improved.core.policy import Policy
from improved.core.record import ProposalRecord, same_state
from improved.protocol import subjects as S
from improved.protocol.model import Proposal
from improved.runtime.autonomy import AutonomyChain
from improved.runtime.conflicts import StateConflict
from improved.runtime.store import Store
from improved.runtime.trusting import TrustInForce

log = structlog.get_logger("improved.engine")

CACHE_SIZE = 10_000  # records kept in memory per process (the KV bucket holds all of them)


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
        # what this process committed itself, by proposal id: (record, state bucket revision)
        self.cache: OrderedDict[str, tuple[ProposalRecord, int]] = OrderedDict()

    async def load(self, svc: str, pid: str, fresh: bool) -> tuple[ProposalRecord | None, int]:
        """The record to decide on: what this process committed itself (its memory), else
        what the chain says. The state bucket is an output anyone on the bus could rewrite:
        it is read for its revision only, and put back when it disagrees with the chain."""
        if not fresh and self.held(svc, pid):
            self.cache.move_to_end(pid)
            return self.cache[pid]
        cached, rev = await self.store.load(svc, pid)
        record = await self.rebuild(svc, pid)
        if record is None:
            return None, rev
        if cached is not None and not same_state(record, cached):
            log.warning("state cache disagrees with the chain; the chain decides",
                        proposal_id=pid, cached=f"{cached.status}/{cached.approved_by}",
                        chain=f"{record.status}/{record.approved_by}")
        if cached is None or not same_state(record, cached):  # lacking (a broker restart
            try:  # empties the bucket) or wrong: put the chain's word back
                rev = await self.store.save(record, rev)
            except StateConflict:
                pass  # someone saved meanwhile; the next save re-reads
        self.remember(record, rev)
        return record, rev

    async def service_of(self, pid: str) -> str | None:
        """The service whose chain holds `pid`: known here when this process holds its record
        (it committed to that chain), else looked up on the audit stream."""
        held = self.cache.get(pid)
        if held is not None:
            return held[0].service
        return await self.store.service_of(pid)

    async def truth(self, svc: str, pid: str) -> ProposalRecord | None:
        """A proposal's record as this process committed it or as its chain says; never the
        state bucket's word."""
        if self.held(svc, pid):
            return self.cache[pid][0]
        return await self.rebuild(svc, pid)

    def held(self, svc: str, pid: str) -> bool:
        """Whether this process holds `pid`'s record as a proposal of `svc`: a message on
        another service's subject naming it finds nothing here, as it finds no chain of
        that service's, whatever this process happens to remember."""
        held = self.cache.get(pid)
        return held is not None and held[0].service == svc

    def remember(self, record: ProposalRecord, rev: int) -> None:
        self.cache[record.proposal_id] = (record, rev)
        self.cache.move_to_end(record.proposal_id)
        while len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)

    async def save(self, record: ProposalRecord, rev: int) -> None:
        try:
            self.remember(record, await self.store.save(record, rev))
        except StateConflict:
            self.cache.pop(record.proposal_id, None)  # someone newer saved; re-read next time

    async def resync(self, svc: str, pid: str, proposal: Proposal | None) -> ProposalRecord | None:
        """Make the cached record equal to what the chain says (the chain is authoritative)."""
        cached, rev = await self.store.load(svc, pid)
        rebuilt = await self.rebuild(svc, pid)
        if rebuilt is not None and rebuilt != cached:
            try:
                rev = await self.store.save(rebuilt, rev)
            except StateConflict:
                return rebuilt  # someone else just saved; the next attempt re-reads
            self.remember(rebuilt, rev)
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
