"""The retained records watchers read (a proposal's state, decision, outcome, quorum record and
learn-back summary), published after its chain moved, and published again from the chains
when they were lost. Only what changed since this process last published a proposal's records
is sent again; a publish that failed is owed until one succeeds.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

import msgspec
import structlog

from improved.client.acks import PendingAck, forget, settled
from improved.client.chain_writer import decode_trailer
from improved.core import apply as apply_stage
from improved.core import authority, indexes, propose, quorum, retained
from improved.core.policy import Policy
from improved.core.record import ProposalRecord, closed
from improved.protocol import subjects as S
from improved.protocol.model import ApplyOutcome, Trailer
from improved.runtime.clock import now_ms
from improved.runtime.passes import ProposalLocks
from improved.runtime.records import CACHE_SIZE, ChainRecords
from improved.runtime.store import Store

log = structlog.get_logger("improved.engine")


class Publisher:
    """The retained records of proposals and grants; `records_ttl_s` (0: kept for good) is the
    TTL each record of a closed proposal carries."""

    def __init__(self, store: Store, records: ChainRecords, locks: ProposalLocks,
                 policy: Policy, records_ttl_s: int):
        self.store = store
        self.records = records
        self.locks = locks
        self.policy = policy
        self.records_ttl_s = records_ttl_s
        # proposals whose retained records failed to publish after their chain moved
        self.unpublished: dict[str, str] = {}  # proposal id → service
        # proposal id → the record whose retained records this process last published
        self._shown: OrderedDict[str, ProposalRecord] = OrderedDict()

    def owes(self, pid: str) -> bool:
        """Whether the records of `pid` failed to publish and are owed."""
        return pid in self.unpublished

    async def publish_changes(self, record: ProposalRecord, republish: bool) -> None:
        """The records of `record` that differ from what this process last published for the
        proposal; with `republish`, or with nothing shown here (another process's work, a
        restart), all of them."""
        await self.publish(record, since=None if republish else self._shown.get(
            record.proposal_id))

    def failed(self, record: ProposalRecord) -> None:
        """The chain moved but what watchers read did not: owed, and all of them next time."""
        self.unpublished[record.proposal_id] = record.service
        self._shown.pop(record.proposal_id, None)

    def published(self, record: ProposalRecord, shown: bool) -> None:
        """Nothing is owed for `record`'s proposal; `shown`: its records were sent as `record`."""
        pid = record.proposal_id
        self.unpublished.pop(pid, None)
        if shown:
            self._shown[pid] = record
            self._shown.move_to_end(pid)
            while len(self._shown) > CACHE_SIZE:
                self._shown.popitem(last=False)

    async def publish(self, record: ProposalRecord,
                      since: ProposalRecord | None = None) -> None:
        """Publish the retained records of `record`; with `since` (the record as its records
        were last published), only those that changed since. Once the proposal is closed
        (`record.closed`), every record carries the TTL `records_ttl_days` (the transition that
        closes it sends all of them again, so none stays behind without one): the records
        stream keeps what is open, not the history."""
        ttl = retained.ttl_of(record, self.records_ttl_s)
        if ttl is not None and since is not None and not closed(since):
            since = None
        sent: list[PendingAck] = []  # every record leaves before any ack is awaited
        decided = quorum.quorum_record(record)
        try:
            for subject, shown in retained.shown(record, now_ms(), since):
                sent.append(await self.store.send_record(subject, shown, ttl))
            if decided is not None and (since is None
                                        or decided != quorum.quorum_record(since)):
                await self.store.publish_once(S.quorum_record(record.proposal_id), decided)
        except BaseException:
            forget(sent)
            raise
        await settled(sent)

    async def publish_unreachable(self, record: ProposalRecord, error: str) -> None:
        """Tell watchers the apply is stuck, without a trailer: nothing transitioned."""
        outcome = ApplyOutcome(proposal_id=record.proposal_id, service=record.service, ok=False,
                               applied_id="", authority=apply_stage.authority(record, self.policy),
                               error=f"unreachable: {error}", at=now_ms())
        await self.store.publish(S.apply_outcome(record.service, record.proposal_id), outcome)

    async def republish_all(self, start: int = 1, concurrency: int = 32) -> int:
        """Rebuild records from their chains and publish the retained records and the review
        index again: what they would say had they never been lost. Read are every grant chain
        (the mesh chains stay whole and small) and the proposal chains that begin at or after
        stream sequence `start` — the daemon passes the sequence after the last seal, where
        every open proposal and every index member is (`core.epochs.Scan.cut`), so the cost
        follows the epoch, not the history. A chain that began before `start` is closed: its
        records are not refilled (they would leave the bus after `records_ttl_days`), its chain
        keeps everything. One read of each range (with its stream sequences), then
        `concurrency` chains at a time. Returns the chains replayed."""
        last = (await self.store.audit_view()).last_seq
        chains: dict[tuple[str, str], list[tuple[int, dict[str, Any]]]] = {}
        async for seq, subject, body, _ in self.store.follow(
                S.audit(S.GRANT_CHAINS, "*"), 1, last):
            if body is not None:
                chains.setdefault((S.GRANT_CHAINS, S.token(subject, 3) or ""), []).append(
                    (seq, body))
        began_before: set[str] = set()
        async for seq, subject, body, _ in self.store.follow(S.AUDIT_FILTER, start, last):
            svc = S.token(subject, 2) or ""
            if body is None or svc in S.MESH_CHAINS or subject in began_before:
                continue
            key = (svc, S.token(subject, 3) or "")
            if key not in chains and body.get("seq") != 0:
                began_before.add(subject)  # began before `start`: closed, not refilled
                continue
            chains.setdefault(key, []).append((seq, body))
        todo = iter(chains.items())
        count = 0

        async def worker() -> None:
            nonlocal count
            for (svc, cid), entries in todo:  # one shared iterator: each chain once
                trailers = [decode_trailer(body) for _, body in entries]
                try:
                    if svc == S.GRANT_CHAINS:
                        state = authority.grant_state(trailers)
                        if state is not None:
                            await self.store.publish(S.grant_record(*state.skill.split(":", 1)),
                                                     state)
                    else:
                        await self._republish(svc, cid, trailers, [seq for seq, _ in entries])
                except (ValueError, KeyError, msgspec.MsgspecError) as exc:
                    log.error("chain not replayable; left for audit verify", chain=cid,
                              service=svc, error=str(exc))
                    continue
                count += 1

        try:
            async with asyncio.TaskGroup() as workers:  # the first failure stops them all
                for _ in range(concurrency):
                    workers.create_task(worker())
        except ExceptionGroup as failed:  # a broker outage, once: the caller retries
            raise failed.exceptions[0] from None
        return count

    async def _republish(self, svc: str, pid: str, trailers: list[Trailer],
                         seqs: list[int]) -> None:
        """Republish one proposal's records and index entry from its chain snapshot, under its
        lock; when the chain moved on since the snapshot, from the chain as it is now."""
        lock = await self.locks.acquire(pid)
        try:
            record = propose.rebuild_record(trailers, seqs, self.policy)
            head, _ = await self.store.chain_head(S.audit(svc, pid))
            if head != seqs[-1]:  # the chain moved on since the snapshot: read it again
                record = await self.records.rebuild(svc, pid) or record
            jobs = [self.publish(record)]
            for name, index in indexes.INDEXES.items():
                if index.member(record):  # lost with the records: no tombstones needed
                    jobs.append(self.store.index_entry(name, svc, pid, index.entry(record)))
            await asyncio.gather(*jobs)
        finally:
            self.locks.release(pid, lock)
