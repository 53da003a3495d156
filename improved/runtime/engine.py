"""The pipeline that carries out the planner's steps for one proposal: load its record, let a
pure stage ingest the input, commit the decision as a trailer, ask the planner for the next
step and carry it out (an ApplyOrder, an LKG check, a measurement, a rollback), then remember
the record and publish its retained records once.

Every step is idempotent on the proposal id. The chain append is the commit point (see store);
when it conflicts — a redelivery, a restart after a crash, a second replica — the engine
re-reads the chain, rebuilds the record from it, and runs the step again, which then finds its
transition already made and does nothing. What one pass decides in a row — a registration,
its triage decision and the dispatch intent, say — is one commit: its trailers are folded as
they are decided and appended together, in one message, before anything leaves the pass (an
order, a request, a read that needs the commit's stream sequence, the retained records), so
nothing is sent on a decision the chain does not hold yet.

What the passes rely on across the mesh has a home of its own, made here and handed what each
needs: the trust in force (`runtime.trusting`), the autonomy chain with its breaker and crisis
(`runtime.autonomy`), records from the chains (`runtime.records`), the requests to the owning
service (`runtime.service_requests`), the retained records (`runtime.publishing`), the
checkpoints (`runtime.checkpointer`) and the policy chain (`runtime.policy_chain`). What
enters a pass comes through `runtime.intake` and `runtime.signed_acts`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog
from nats.aio.client import Client

from improved.client.answers import Answers
from improved.client.chain_writer import ChainConflict, pause_after_conflict
from improved.client.config import Config
from improved.client.sdk import enqueue
from improved.core import apply as apply_stage
from improved.core import (
    learnback,
    planner,
    propose,
    queue,
    triage,
)
from improved.core.audit import Draft
from improved.core.record import CountedSignal, ProposalRecord
from improved.protocol.model import DedupHead, Proposal, to_json
from improved.runtime.autonomy import AutonomyChain
from improved.runtime.checkpointer import Checkpointer
from improved.runtime.clock import now_ms
from improved.runtime.commits import Commits
from improved.runtime.dedup_heads import DedupHeads
from improved.runtime.metrics import Metrics
from improved.runtime.passes import ProposalLocks
from improved.runtime.policy_chain import PolicyInForce
from improved.runtime.publishing import Publisher
from improved.runtime.records import ChainRecords
from improved.runtime.service_requests import GrantRevoked, ServiceRequests, ServiceUnreachable
from improved.runtime.store import Store
from improved.runtime.telemetry import Tracing
from improved.runtime.trusting import TrustInForce

log = structlog.get_logger("improved.engine")

MAX_CONFLICT_RETRIES = 8
MAX_STEPS = 8  # planner steps in one pass; the next message or retry carries on
# An ingest step: (record or None) → (the record the draft extends, draft) or None when there
# is nothing to do. The record extended is the one given, but for a registration's new record.
Ingest = Callable[[ProposalRecord | None, int], tuple[ProposalRecord, Draft] | None]


def _onto(record: ProposalRecord, draft: Draft | None) -> tuple[ProposalRecord, Draft] | None:
    """A stage's draft (or nothing to do) as an ingest step on `record`."""
    return None if draft is None else (record, draft)


async def _together(jobs: Sequence[Awaitable[object]]) -> None:
    """Await `jobs` side by side; a lone one (an L0's records) without the task a gather
    makes of it."""
    if len(jobs) == 1:
        await jobs[0]
    elif jobs:
        await asyncio.gather(*jobs)


@dataclass
class Handled:
    record: ProposalRecord | None
    changed: bool
    counted: CountedSignal | None = None  # the signal a `signal` pass counted


class Engine:
    """The passes over proposals of this process, and the parts of the shell they rely on."""

    def __init__(self, nc: Client, store: Store, config: Config, actor: str,
                 tracing: Tracing | None = None):
        self.nc = nc
        self.store = store
        self.config = config
        self.records_ttl_s = int(config.records_ttl_days * 86400)  # 0: records kept for good
        self.policy = config.policy
        self.actor = actor
        self.metrics = Metrics()
        self.trust = TrustInForce(config.trust, store, actor)
        # the daemon's requests to the services, every answer heard as evidence
        self.answers = Answers(nc, self.trust.signers, config.trust.subjects_bound)
        self.tracing = tracing or Tracing()  # off unless the daemon was started with it
        self.requests = ServiceRequests(self.answers, config.apply, self.tracing)
        self.autonomy = AutonomyChain(store, self.trust, config.policy, actor, config.data_dir,
                                      self.metrics)
        self.records = ChainRecords(store, self.trust, self.autonomy, config.policy)
        self.tracing.trace_of, self.tracing.keep_trace = (self.records.trace_of,
                                                          self.records.keep_trace)
        self.locks = ProposalLocks()
        # what each pass decided, appended (and traced)
        self.commits = Commits(store, self.metrics, self.tracing)
        self.publisher = Publisher(store, self.records, self.locks, config.policy,
                                   self.records_ttl_s)
        self.checkpoints = Checkpointer(nc, store, config, actor, self.trust, self.autonomy,
                                        self.metrics)
        self.policy_chain = PolicyInForce(store, self.trust, config.policy, actor)
        # the operator's queue as the review index counts it: recounted from the index by the
        # daemon (`set_queue_size`), moved by this replica's own passes in between
        self.queue_size = 0
        # told the `valid_to` of every review index entry this process writes, so the daemon's
        # expiry sweep wakes when the earliest is due (`Upkeep.expiries`)
        self.on_indexed: Callable[[int], None] | None = None
        # the dedup heads this process claimed: their lease and their close (`DedupHeads`)
        self.heads = DedupHeads(store, self.records_ttl_s)
        # applied proposals awaiting their measurement: proposal id → (review_after, service);
        # only a wake-up call (the pass it makes decides from the chain), see `due_reviews`
        self.reviews: dict[str, tuple[int, str]] = {}

    # -- entry points --------------------------------------------------------------------------------

    async def advance(self, svc: str, pid: str, republish: bool = False) -> Handled:
        """No new input: carry the proposal on (triage request, apply retry)."""
        return await self.handle(svc, pid, lambda record, now: None, republish,
                                 fresh=True)

    async def supersede(self, svc: str, old: str, new: str) -> Handled:
        """Mark `old` superseded by `new` (same dedup_key, new content)."""
        return await self.handle(
            svc, old, lambda record, now: _onto(record, propose.supersede(record, new, self.actor))
            if record is not None else None, False)

    async def standing_head(self, svc: str, dedup: str, pid: str,
                             proposal: Proposal, seen: dict[str, DedupHead | None]
                             ) -> str | None:
        """The newer content under `dedup` that still supersedes `proposal`, if any, as the
        chain of the proposal the bucket names says (`propose.stands_over`); the head read is
        left in `seen["head"]`."""
        head = seen["head"] = await self.store.dedup_head(svc, dedup)
        return await self.standing_over(svc, head, pid, proposal, dedup)

    async def standing_over(self, svc: str, head: DedupHead | None, pid: str,
                            proposal: Proposal, dedup: str) -> str | None:
        """The newer content the dedup head `head` names that still supersedes `proposal`, if
        any, as its chain says (`propose.stands_over`)."""
        if head is None or head.proposal_id == pid:
            return None
        other = await self.records.truth(svc, head.proposal_id)
        return other.proposal_id if other is not None and propose.stands_over(
            other, proposal, pid, dedup) else None

    async def handle(self, svc: str, pid: str, ingest: Ingest, republish: bool,
                     dispatch: bool = True, fresh: bool = False,
                     optimistic: bool = False,
                     prepare: Callable[[], Awaitable[triage.Rejection | None]] | None = None,
                     on_change: Callable[[ProposalRecord], Awaitable[None]] | None = None,
                     ) -> Handled:
        """Load, ingest, advance, then remember and publish once. `fresh` skips this process's
        memory (a request's reply should see what other replicas did)."""
        lock = await self.locks.acquire(pid)
        self.commits.begin(pid)
        try:
            for attempt in range(MAX_CONFLICT_RETRIES):
                if attempt:
                    await pause_after_conflict(attempt - 1)
                try:
                    record = None if optimistic and pid not in self.records.cache \
                        else await self.records.load(svc, pid, fresh)
                    before = record
                    rejected = await prepare() if record is None and prepare else None
                    now = now_ms()
                    step = ingest(record, now)
                    if step is not None:
                        record = self.commits.add(before, *step, now)
                    if record is None:
                        return Handled(None, False)
                    try:
                        record = await self._advance(record, dispatch, rejected)
                    except ServiceUnreachable as exc:
                        # What was decided stands and is published; the apply waits.
                        await self._settle(await self.commits.append(exc.record or record), before,
                                           republish, waiting=True)
                        raise
                    record = await self.commits.append(record)
                    changed = record != before
                    if changed and on_change is not None:
                        await on_change(record)
                    await self._settle(record, before, republish)
                    return Handled(record, changed)
                except ChainConflict:
                    self.commits.discard(pid)
                    log.info("chain moved, rebuilding from it", proposal_id=pid)
                    self.records.cache.pop(pid, None)  # the next attempt reads the chain
                    republish = True
                    fresh = True
                    optimistic = False
            raise RuntimeError(f"proposal {pid}: still conflicting after "
                               f"{MAX_CONFLICT_RETRIES} attempts")
        finally:
            self.commits.end(pid)  # what was not appended did not happen
            self.locks.release(pid, lock)

    async def _settle(self, record: ProposalRecord, before: ProposalRecord | None,
                      republish: bool, waiting: bool = False) -> None:
        """After the chain moved: remember the record and publish the retained records, the
        review index entry when the operator's queue changed (`queue.change`: never for an L0
        proposal), and the measurement index entry when a measurement fell due or was made
        (`learnback.due_change`: never for a proposal without review_after). A dedup head
        this pass's claim leased keeps its TTL while the apply is owed (the next pass closes
        the proposal, or finds the service unreachable: `waiting`), and loses it when the
        proposal is left open waiting for anything else (`DedupHeads.after_pass`). Of the retained
        records, only those that differ from what this process last published for the
        proposal are sent again (`Publisher.publish_changes`); with nothing shown here
        (another process's work, a restart) all of them are."""
        pid = record.proposal_id
        self.expect_review(record)
        republish = republish or self.publisher.owes(pid)
        jobs = []
        if record != before:
            self.records.remember(record)
        if record != before or republish:
            jobs.append(self.publisher.publish_changes(record, republish))
        touched = self.commits.moved(pid)
        write = queue.change(before, record, republish, moved="review" in touched)
        if write is not None:
            jobs.append(self.store.index(record.service, pid, write.entry))
            if write.entry is not None and write.entry.valid_to is not None \
                    and self.on_indexed is not None:
                self.on_indexed(write.entry.valid_to)
        due = learnback.due_change(before, record, republish, moved="due" in touched)
        if due is not None:
            jobs.append(self.store.mark_due(record.service, pid, due.entry))
        head = self.heads.after_pass(record, before, republish, waiting)
        if head is not None:
            jobs.append(head)
        try:
            await _together(jobs)
        except Exception:
            # the chain moved but what watchers read did not: whoever handles this proposal
            # next, or the next reconnect (`republish_unpublished`), publishes it again
            self.publisher.failed(record)
            raise
        self.publisher.published(record, shown=record != before or republish)
        moved = queue.queued(record) - queue.queued(before)
        if moved:
            self.set_queue_size(self.queue_size + moved)

    def expect_review(self, record: ProposalRecord) -> None:
        """Remember when `record` is due for its measurement at review_after (or forget it)."""
        at = learnback.awaiting(record)
        if at is None:
            self.reviews.pop(record.proposal_id, None)
        else:
            self.reviews[record.proposal_id] = (at, record.service)

    def due_reviews(self, now: int) -> list[tuple[str, str]]:
        """(service, proposal id) of every remembered measurement due by `now`, forgotten
        here (the pass it makes remembers it again if it is still due: an unanswered ask)."""
        due = [(svc, pid) for pid, (at, svc) in self.reviews.items() if at <= now]
        for _, pid in due:
            self.reviews.pop(pid, None)
        return due

    async def republish_unpublished(self) -> int:
        """Publish again the records of every proposal whose publish failed (a broker outage
        between the append and the records), so none is left behind its chain when no later
        message touches it; how many were. Failures stay for the next call."""
        done = 0
        for pid, svc in list(self.publisher.unpublished.items()):
            try:
                await self.advance(svc, pid, republish=True)
            except Exception as exc:  # still unreachable: the next reconnect tries again
                log.info("records not republished yet", proposal_id=pid,
                         error=f"{type(exc).__name__}: {exc}")
                continue
            done += 1
        return done

    def set_queue_size(self, n: int) -> None:
        """The pending-reviews metric: the entries of the review index (what `improved review`
        lists), as last recounted and moved by this replica's passes since."""
        self.queue_size = max(n, 0)
        self.metrics.set_pending_reviews(self.queue_size)

    # -- the steps -----------------------------------------------------------------------------------

    async def _advance(self, record: ProposalRecord, dispatch: bool,
                       rejected: triage.Rejection | None = None) -> ProposalRecord:
        """Carry the proposal on, one planner step at a time, until the planner has nothing
        more to do now. Each step is one effect; the decision is the planner's."""
        grant: planner.GrantRead = planner.UNREAD  # an L3's grant, read by this very pass
        at_intent: tuple[int, bool] | None = None  # that grant as of the intent's sequence
        intended = False  # this pass recorded the order's dispatch
        for _ in range(MAX_STEPS):
            now = now_ms()
            view = planner.View(now=now, autonomy=await self.autonomy.state(now), dispatch=dispatch,
                                rejected=rejected, grant=grant, grant_at_intent=at_intent)
            step = planner.next_step(record, view, self.policy, self.actor)
            while isinstance(step, planner.ReadGrant | planner.ConfirmGrant
                             | planner.ReadOriginal):
                if isinstance(step, planner.ConfirmGrant) and self.commits.pending(record):
                    # as of the intent's stream sequence: the intent appended first
                    record = await self.commits.append(record)
                else:
                    view = planner.with_read(view, step, await self._read(record, step, now))
                    grant, at_intent = view.grant, view.grant_at_intent
                step = planner.next_step(record, view, self.policy, self.actor)
            if not isinstance(step, planner.Commit):  # an effect: nothing on an unheld decision
                record = await self.commits.append(record)
            try:
                match step:
                    case planner.Commit(draft=draft, why=why):
                        if why == "revoked" and record.in_flight:
                            log.warning("dispatch withdrawn: the grant was not active as of "
                                        "it; no order is sent", proposal_id=record.proposal_id,
                                        skill=record.skill, intent_seq=record.dispatched_seq)
                        record = self.commits.add(record, record, draft, now)
                        intended = intended or why == "dispatched"
                    case planner.SendRollback():
                        record = await self._rollback(record, step)
                    case planner.CheckLkg():
                        draft = await self._lkg_check(record)
                        record = self.commits.add(record, record, draft, now_ms())
                    case planner.SendApply():
                        record = await self._apply(record, step, intended)
                    case planner.AskMeasure(request=request):
                        reading = await self.requests.measure(record, request)
                        at = now_ms()
                        measure = planner.after_measure(record, reading, self.policy,
                                                        self.actor)
                        if measure.rollback is not None:
                            await self.propose_rollback(record, measure.rollback)
                        record = self.commits.add(record, record, measure.commit.draft, at)
                    case planner.FinishRollback(original_id=original):
                        await self.rolled_back(record.service, original, record)
                        break
                    case planner.Halt(reason=reason):
                        log.warning("applies refused", proposal_id=record.proposal_id,
                                    reason=reason)
                        break
                    case _:
                        break
            except ServiceUnreachable as exc:
                exc.record = exc.record or record  # what was decided stands; the send waits
                raise
        return record

    async def _read(self, record: ProposalRecord,
                    step: planner.ReadGrant | planner.ReadOriginal | planner.ConfirmGrant,
                    now: int) -> bool | ProposalRecord | None:
        """Carry out a planner read: the grant of an L3 skill (now, or as of its intent's
        stream sequence: asked only once that append was acknowledged), the original of a
        reversal."""
        if isinstance(step, planner.ReadGrant):
            return await self.store.grant_active(step.skill, now, self.trust.chain_trust)
        if isinstance(step, planner.ConfirmGrant):
            return await self.store.grant_active_as_of(step.skill, step.as_of_seq, step.at,
                                                       self.trust.chain_trust)
        return await self.records.truth(record.service, step.proposal_id)

    async def _rollback(self, record: ProposalRecord,
                        step: planner.SendRollback) -> ProposalRecord:
        """An operator's rollback: the recorded inverse goes to the owning service."""
        result = await self.requests.send(record, step.order)
        at = now_ms()
        record = await self.commits.append(self.commits.add(
            record, record, apply_stage.rollback_transition(record, step.inverse_id, result), at))
        if result.value.ok and record.approved_by is None:
            await self.autonomy.count_autonomous_rollback(record, at)
        return record

    async def _apply(self, record: ProposalRecord, step: planner.SendApply,
                     intended: bool) -> ProposalRecord:
        """Send the ApplyOrder whose dispatch the chain records, and commit its result (the
        service is idempotent on the proposal id, so an order sent again applies nothing
        twice). Unreachable, or the grant revoked before a retry: the planner says whether the
        dispatch is withdrawn."""

        async def allowed(attempt: int, maybe_delivered: bool) -> None:
            if attempt > 1 and planner.recheck_grant(record, intended, maybe_delivered) \
                    and not await self.store.grant_active(record.skill, now_ms(),
                                                          self.trust.chain_trust, fresh=True):
                raise GrantRevoked(record.skill)

        try:
            result = await self.requests.send(record, step.order, allowed)
        except GrantRevoked:
            at = now_ms()
            commit = planner.revoked(record, self.policy, at, self.actor)
            return self.commits.add(record, record, commit.draft, at)
        except ServiceUnreachable as exc:
            at = now_ms()
            void = planner.unreachable(record, intended, exc.maybe_delivered, str(exc),
                                       self.actor)
            if void is not None:
                exc.record = self.commits.add(record, record, void.draft, at)
            raise
        at = now_ms()
        return self.commits.add(
            record, record, apply_stage.transition(record, result, step.authority), at)

    async def _lkg_check(self, record: ProposalRecord) -> Draft:
        """SPEC 09 §7.1: ask the owning service for a healthy last-known-good of every
        artefact; the planner turns the answer into the transition."""
        report = await self.requests.lkg(record)
        commit = planner.after_lkg(record, report, self.policy, self.actor,
                                   self.config.max_message_bytes, now_ms())
        if commit.why == "lkg_refused":
            log.warning("L4 refused before apply", proposal_id=record.proposal_id,
                        reason=commit.draft.reason)
        return commit.draft

    # -- learn-back rollbacks ------------------------------------------------------------------------

    async def propose_rollback(self, record: ProposalRecord, proposal: Proposal) -> str:
        """Propose the recorded inverse of a regressed change, through the bus like any
        proposal (durable, deduplicated by its id, and gated by its class)."""
        pid, _ = propose.identify(proposal)
        await enqueue(self.store.js, proposal.service, to_json(proposal), pid,
                      self.tracing.headers_for(record.proposal_id))  # the original's trace
        log.warning("regression: rollback proposed", proposal_id=record.proposal_id,
                    rollback=pid, stage="learn-back")
        return pid

    async def rolled_back(self, svc: str, original: str, inverse: ProposalRecord) -> None:
        handled = await self.handle(
            svc, original, lambda record, now: _onto(record, apply_stage.rolled_back_by(
                record, inverse)) if record is not None else None, False)
        if handled.changed and handled.record is not None and \
                apply_stage.counts_toward_breaker(handled.record, inverse):
            await self.autonomy.count_autonomous_rollback(handled.record, now_ms())
