"""Wiring: the inbound consumer, the request/reply capabilities, and a clean drain on stop.

Inbound messages are fetched in batches from the shared durable consumer and decoded (pure).
Each job runs as its own task, chained behind the previous job for the same proposal id: the
order per proposal holds while proposals do not wait for each other, and fetching goes on while
earlier work is in flight, up to MAX_IN_FLIGHT jobs.

Acks: success → ack; bad input → term (it will never become good) and a refusal record; an
unreachable service → nak with backoff until the delivery budget is spent, then kept on a slow
retry (`_park`); anything unexpected → nak and a log line. No message stops the daemon.

Given-up applies resume on their own. Once `apply.max_deliveries` deliveries found the owning
service unreachable, the message is not acknowledged: it is nak'ed with a delay that doubles
from a minute up to `apply.retry_max_s` (five minutes), and so comes back, to this daemon, a
replica or the next one after a restart, with no schedule of its own to keep: the stream holds
it until the proposal leaves the apply (applied, refused, expired) and the pass acks it. A
redelivery past the budget first asks whether anything serves `<svc>.improve.apply` at all (a
probe order every service answers as malformed, SPEC 09 conformance L1; nothing serving it is
"no responders" at once), and only then makes a pass: while the service is down, the wait
writes nothing on the chain. What it holds is bounded by the proposals waiting, never by
history: at most MAX_PARKED such messages per daemon (under the consumer's max_ack_pending);
beyond them a given-up apply is acknowledged and left retryable as before, for `improved retry`
or the service's own triage request.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import signal as signals
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import FetchTimeoutError

from improved.client.sdk import enqueue, publish_deduplicated
from improved.core import apply as apply_stage
from improved.core import boundary, indexes, policy, propose, queue
from improved.core.authority import Act
from improved.core.capabilities import capabilities
from improved.core.inbound import (
    GRANT_SKILL_RE,
    proposal_of,
    review_target,
    signal_of,
    signed_act,
)
from improved.core.observe import Observer, RegressionAnalyzer, StaleSkillAnalyzer
from improved.core.record import status_at
from improved.core.signing import PAYLOAD_TYPES, envelope_digest
from improved.protocol import subjects as S
from improved.protocol import wire
from improved.protocol.model import (
    ApplyReport,
    ApplyResult,
    Envelope,
    Proposal,
    ProposeReply,
    RefineReply,
    Refusal,
    ReviewEntry,
    Signal,
    TriageRequest,
    to_json,
)
from improved.runtime import bus, indexing, keys, metrics, notify
from improved.runtime.config import Config, ConfigError
from improved.runtime.engine import Engine, Handled
from improved.runtime.intake import Intake
from improved.runtime.observing import Observing
from improved.runtime.records import ChainBroken
from improved.runtime.service_requests import ServiceUnreachable
from improved.runtime.signed_acts import SignedActs
from improved.runtime.store import Store
from improved.runtime.surfaces import Surfaces

log = structlog.get_logger("improved.daemon")

FETCH_BATCH = 256
CACHE_CHECK_S = 5.0  # how often the records are checked for a loss and the queue recounted
MAX_IN_FLIGHT = 1024
DRAIN_S = 30.0  # how long `stop` waits for in-flight work before cancelling it
NOT_FOUND_RETRIES = 5
ACK_PROGRESS_S = 1.5  # a third of the inbound consumer's ack wait (store.INBOUND_ACK_WAIT_S)
# A held message is told to be in progress once it has gone this long without: it is then
# told again within ACK_QUIET_S + ACK_PROGRESS_S = 3.5 s, well inside the 5 s ack wait.
ACK_QUIET_S = 2.0
REVIEW_TICK_S = 1.0  # the longest the review_after wake-up sleeps before looking again
REVIEW_RETRY_S = 5.0  # a measurement pass that failed (an outage) is tried again after this
# at start, the index members are counted from the chains before ready (when the last
# checkpoint has no counts) only if that reads at most this many trailers; else after ready
START_COUNT_LIMIT = 20_000
SETTLE_S = 10.0  # how long an index check waits for the passes in progress to write them
MAX_PARKED = 256  # given-up applies kept on a slow retry, per daemon (max_ack_pending is 1024)
PROBE_ORDER = b'{"proposal_id":"probe"}'  # answered as malformed by whatever serves applies


def backoff_s(delivered: int) -> float:
    return min(0.5 * 2.0 ** max(delivered - 1, 0), 60.0)


def slow_backoff_s(past_budget: int, cap: float) -> float:
    """The delay before the next try of a given-up apply: a minute, doubling, up to `cap`."""
    return min(60.0 * 2.0 ** min(max(past_budget, 0), 16), cap)


def instance_actor() -> str:
    """SPEC 07 actor id of a daemon acting on its own: `improved:<uuid>` (v7 where available)."""
    make = getattr(uuid, "uuid7", None)
    return f"improved:{make() if make else uuid.uuid4()}"


@dataclass
class Job:
    """One decoded inbound message, ready to run."""

    key: str
    run: Callable[[], Awaitable[Any]]
    msg: Msg


class Daemon:
    def __init__(self, nc: Client, config: Config, actor: str | None = None):
        self.nc = nc
        self.config = config
        self.actor = actor or instance_actor()
        self.store = Store(nc, config.replicas, config.records_storage)
        # tombstones outlive the next two checkpoints: a reader finds what left since the last
        self.store.tombstone_ttl_s = indexes.tombstone_ttl_s(config.checkpoint_interval_s)
        self.engine = Engine(nc, self.store, config, self.actor)
        # what enters a pass: registrations, signals and reports; signed acts
        self.intake = Intake(self.engine)
        self.acts = SignedActs(self.engine)
        # what each service advertises: its own (attested) "improve": false refuses proposals
        self.surfaces = Surfaces(self.engine.answers)
        self.observer = Observing(self.store,
                                  Observer([RegressionAnalyzer(), StaleSkillAnalyzer()]))
        self.engine.learn = self.observer.learn
        self._stopping = anyio.Event()
        self._in_flight = 0
        self._subs: list[Subscription] = []
        self._service: asyncio.Task[None] | None = None  # runs serve(): every background task
        self._scope: anyio.CancelScope | None = None  # serve()'s task group, to halt it
        self.ready = anyio.Event()
        self._refill = anyio.Lock()  # one refill of the records and the index at a time
        # the inbound messages taken and not yet settled, with when each was last fetched or
        # told to the broker to be in progress (monotonic seconds)
        self._held: dict[int, tuple[Msg, float]] = {}
        self._parked: set[int] = set()  # stream sequences of given-up applies on slow retry
        # the expiry sweep: the earliest valid_to ahead among the review index's entries (as
        # last read, lowered by this process's own index writes), and a wake-up when it drops
        self._next_expiry: int | None = None
        self._expiry_wake = anyio.Event()
        self._sweeping = anyio.Lock()
        self.engine.on_indexed = self._indexed

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the daemon key, bind the streams, record the trust store and the policy, verify
        what the log gained since the last checkpoint, subscribe; what a broker restart lost is
        refilled after ready (`_after_ready`).
        ConfigError (nothing subscribed) when the policy loosens a floor or `policy.quorum`
        names no approved amendment."""
        # the daemon key signs every trailer this replica writes and every checkpoint
        self._checkpoint_key = keys.load_or_create_key(
            self.config.checkpoint_key or self.config.data_dir / "checkpoint.pem")
        self.engine.trust.use_key(self._checkpoint_key)
        changed = await self.store.ensure()
        if changed:
            log.info("streams and buckets brought to this configuration", changes=changed)
        await self.engine.trust.record_trust()
        await self._policy_in_force()
        await self.engine.autonomy.sync_switch()
        # verifies the log as it was left; counting the index members from the chains, when
        # the last checkpoint has no counts, waits until after ready unless the log is short
        await self.engine.checkpoints.checkpoint(self._checkpoint_key, count_limit=START_COUNT_LIMIT)
        bus.on_reconnect(self.nc, self._reconnected)
        for subject, handler in (
            (S.PROPOSE_REQUESTS, self.on_propose),
            (S.TRIAGE_REQUESTS, self.on_triage),
            (S.REFINE_REQUESTS, self.on_refine),
            (S.SPEC_GET, self.on_spec),
        ):
            self._subs.append(await self.nc.subscribe(subject, queue=S.QUEUE_GROUP,
                                                      cb=self._guarded(handler)))
        self._psub = await self.store.js.pull_subscribe_bind(
            durable=S.CONSUMER_INBOUND, stream=S.STREAM_INBOUND)
        self._service = asyncio.get_running_loop().create_task(self.serve(),
                                                               name="improved-serve")
        # ready means answering: the subscriptions are on the server, not in our send buffer
        await self.nc.flush()
        self.ready.set()
        self.engine.metrics.set_ready(True)
        self.engine.metrics.set_connected(True)
        log.info("daemon ready", actor=self.actor, streams=[S.STREAM_INBOUND, S.STREAM_RECORDS,
                                                           S.STREAM_AUDIT])

    async def _policy_in_force(self) -> None:
        """Refuse a loosened floor and a quorum no approved constitution edit permits; log the
        effective policy and record it on the `_policy` chain when it changed."""
        p = self.config.policy
        loose = policy.loosening(p)  # config.parse refuses it too; a Config built in code here
        if loose is not None:
            raise ConfigError(f"config error: policy.{'.'.join(loose[0])}: {loose[1]}")
        problem = await self.engine.policy_chain.amendment_problem()
        if problem is not None:
            raise ConfigError(f"config error: policy.quorum_amendment: {problem}")
        log.info("effective policy", digest=policy.digest(p), forbidden_targets=list(p.forbidden),
                 min_class=policy.effective(p).min_class, fallback_min_class=p.fallback_min_class,
                 quorum=p.quorum, quorum_amendment=p.quorum_amendment)
        await self.engine.policy_chain.record_policy()

    async def serve(self) -> None:
        """Every background task of a started daemon, in one task group: the inbound consumer
        (and the jobs it runs), the checkpoints, the records watch. It ends when all of them
        have drained after `stop`, or at once on `halt`; an unexpected error in one cancels
        the others and ends it, so `healthy` turns false and the watchdog restarts us."""
        try:
            async with anyio.create_task_group() as tg:
                self._scope = tg.cancel_scope
                tg.start_soon(self._consume, name="improved-consume")
                if self.config.checkpoint_interval_s > 0:
                    tg.start_soon(self._checkpoints, name="improved-checkpoints")
                tg.start_soon(self._watch_records, name="improved-records-watch")
                tg.start_soon(self._expiries, name="improved-expiries")
                tg.start_soon(self._reviews, name="improved-reviews")
                tg.start_soon(self._after_ready, name="improved-after-ready")
        except Exception:
            log.exception("a background task of the daemon failed; it stops serving")
            raise

    async def _after_ready(self) -> None:
        """What may cost as much as the history does, after ready rather than before: refill
        the retained records and the indexes when the broker lost them (memory storage
        across a restart, a purge, an upgrade from a version without the index); count the
        index members from the chains when the start's checkpoint could not (the first start
        after an upgrade, over a long log); then count the queue from the index and check
        both indexes against the checkpoint (`_check_indexes`: the measurements still owed are
        remembered from it). None of it is read by a decision (every decision replays its
        chain), only by watchers, `review`, the metric and the wake-ups."""
        await self._restore(ensure=False)
        counted = self.engine.checkpoints.counted
        if counted is None or counted.members is None:
            try:
                await self.engine.checkpoints.checkpoint(self._checkpoint_key)
            except Exception as exc:  # an outage: the checkpoint timer counts them
                log.warning("checkpoint failed", error=f"{type(exc).__name__}: {exc}")
        await self._recount()
        await self._check_indexes()

    async def _find_reviews(self) -> None:
        """Remember every measurement still to make: the measurement index read against the
        last checkpoint (`_check_index`), so a restart wakes each at the review_after its
        chain says, whoever applied it and however long ago, whatever was done to its entry;
        O(open measurements) while the index holds every one."""
        await self._check_index("due")

    async def _check_indexes(self) -> None:
        """Each index read against the last checkpoint this process signed: at start, and
        after every checkpoint (so at most once per checkpoint), once the passes in progress
        here have written what their trailers moved."""
        await self.engine.locks.passes_done(SETTLE_S)
        for name in indexes.INDEXES:
            await self._check_index(name)

    async def _check_index(self, name: str) -> None:
        """Read the index `name` as a reader does (`indexing.read`), against the counts of the
        last checkpoint this process signed; what it omitted (or holds wrongly) is rewritten
        from the chains, named in an error; counts the chains do not bear out are counted
        again at the next checkpoint. For the measurement index, every member is remembered
        with the review_after its chain says. Never raises: the next checkpoint tries again."""
        daemons = set(self.engine.trust.chain_trust.daemons)
        counted = self.engine.checkpoints.counted
        try:
            found = await indexing.read(
                self.store, name, counted, "this daemon has signed no checkpoint yet",
                indexing.trust_of(daemons), self.config.policy, int(time.time() * 1000),
                self.store.tombstone_ttl_s, daemons)
            if name == "due":
                for record in found.members:
                    self.engine.expect_review(record)
                if found.members:
                    log.info("measurements to make", count=len(found.members))
            await self._repair(found, counted)
        except Exception as exc:
            log.warning("could not check an index against the chains", index=name,
                        error=f"{type(exc).__name__}: {exc}")

    async def _repair(self, found: indexing.IndexRead, counted: indexing.Counted | None) -> None:
        """Write again the entry of every member whose subject lost it or holds another one,
        unless a pass of this process is on it or the entry came meanwhile; the lost ones
        named in an error. When the chains were read and do not bear out the checkpoint's
        count, the next checkpoint counts from the chains."""
        index = indexes.INDEXES[found.index]
        lost: list[str] = []
        rewritten: list[str] = []
        for record in found.wrong:
            pid = record.proposal_id
            if self.engine.locks.busy(pid):
                continue
            entry = index.entry(record)
            held = await self.store.index_subject(found.index, record.service, pid)
            if held == entry:
                continue
            await self.store.index_entry(found.index, record.service, pid, entry)
            if found.index == "review" and entry.valid_to is not None:
                self._indexed(entry.valid_to)
            (lost if held is None else rewritten).append(pid)
        if found.source == "chains":
            count = counted.members.get(found.index) if counted and counted.members else None
            if count is not None and found.chains_counted is not None \
                    and found.chains_counted != count:
                log.error("an index count is off the chains; counting again at the next "
                          "checkpoint", index=found.index, counted=count,
                          chains=found.chains_counted)
                self.engine.checkpoints.recount()
        why = {"why": found.why} if found.source == "chains" else {}
        if lost:
            log.error("index entries of members lost (tombstoned, purged or never written); "
                      "rewritten from their chains", index=found.index, lost=lost,
                      rewritten=rewritten, shortfall=found.short, **why)
        elif rewritten:
            log.warning("index entries differed from their chains; rewritten",
                        index=found.index, rewritten=rewritten, **why)
        elif found.source == "chains":
            log.warning("an index was read from the audit chains; it lists every member now",
                        index=found.index, shortfall=found.short, **why)

    async def _reviews(self) -> None:
        """Learn-back at review_after: when an applied proposal's `metric_snapshot.review_after`
        comes, make a pass over it, which asks the owning service for the metric
        (`<svc>.improve.measure`) and records held, regressed or unmeasured."""
        while not self._stopping.is_set():
            now = int(time.time() * 1000)
            upcoming = [at for at, _ in self.engine.reviews.values()]
            wait = min([REVIEW_TICK_S, *((at - now) / 1000 for at in upcoming)])
            if wait > 0:
                await self._pause(wait)
                continue
            async with anyio.create_task_group() as tg:
                for svc, pid in self.engine.due_reviews(now):
                    tg.start_soon(self._review_due, svc, pid)

    async def _review_due(self, svc: str, pid: str) -> None:
        try:
            await self.engine.advance(svc, pid)
        except ChainBroken as exc:  # the crisis is open; nothing is decided on this chain
            log.error("measurement skipped: its chain does not verify", proposal_id=pid,
                      problem=str(exc))
        except Exception as exc:  # a broker outage: try again a little later
            log.warning("learn-back measurement failed; trying again", proposal_id=pid,
                        error=f"{type(exc).__name__}: {exc}")
            self.engine.reviews[pid] = (int(time.time() * 1000 + REVIEW_RETRY_S * 1000), svc)

    async def _recount(self) -> None:
        """Read the review index once, in O(open items): set the pending-reviews metric to its
        entries (what `review` lists, the same on every replica), and record the expiry of
        each whose `valid_to` has passed, so it leaves the queue (`_sweep`)."""
        try:
            entries = await self.store.read_index()
        except Exception as exc:  # a metric and a sweep: never worth stopping the daemon for
            log.warning("could not count the proposals waiting for review",
                        error=f"{type(exc).__name__}: {exc}")
            return
        self.engine.set_queue_size(len(entries))
        await self._sweep(entries)

    async def _sweep(self, entries: list[ReviewEntry]) -> None:
        """Carry on every indexed proposal whose `valid_to` has passed: the pass records its
        expiry on the chain (the planner decides, from the chain: an entry only says where to
        look) and takes it out of the index; then note when the next is due. Its cost follows
        the open items, never the history; every replica may sweep, and the chain append lets
        one expiry through."""
        async with self._sweeping:
            due, ahead = queue.due(entries, int(time.time() * 1000))
            for entry in due:
                if self._stopping.is_set():
                    return
                try:
                    await self.engine.advance(entry.service, entry.proposal_id)
                except Exception as exc:  # the next sweep tries again
                    log.warning("expiry not recorded yet", proposal_id=entry.proposal_id,
                                error=f"{type(exc).__name__}: {exc}")
            self._next_expiry = ahead

    def _indexed(self, valid_to: int) -> None:
        """This process wrote an index entry that expires at `valid_to`: wake the sweep when
        that is earlier than what it waits for."""
        if self._next_expiry is None or valid_to < self._next_expiry:
            self._next_expiry = valid_to
            self._expiry_wake.set()

    async def _expiries(self) -> None:
        """Sweep the review index as soon as the earliest `valid_to` in it has passed, so an
        expired proposal leaves the queue at its `valid_to`, not at the next records check
        (which sweeps too, every CACHE_CHECK_S: entries other replicas wrote, or written before
        a restart)."""
        while not self._stopping.is_set():
            self._expiry_wake = anyio.Event()
            wait = CACHE_CHECK_S
            if self._next_expiry is not None:
                wait = min(wait, max(0.0, self._next_expiry / 1000 - time.time()))
            with anyio.move_on_after(wait):
                await self._expiry_wake.wait()
            if self._stopping.is_set():
                return
            if self._next_expiry is not None and self._next_expiry <= time.time() * 1000 \
                    and self.nc.is_connected:
                await self._recount()

    async def _pause(self, seconds: float) -> None:
        """Sleep `seconds`, or less when the daemon is stopping."""
        with anyio.move_on_after(seconds):
            await self._stopping.wait()

    async def _checkpoints(self) -> None:
        """Sign a checkpoint every interval (verifying the log first), then seal an epoch of
        the log if one is due, until stopped."""
        while not self._stopping.is_set():
            await self._pause(self.config.checkpoint_interval_s)
            try:
                if await self.engine.checkpoints.checkpoint(self._checkpoint_key) is None \
                        and not self._stopping.is_set():  # a seal reads its epoch: not on the way out
                    await self._check_indexes()
                    await self.engine.checkpoints.seal_if_due(self._checkpoint_key)
            except Exception as exc:  # a broker outage: the next interval tries again
                log.warning("checkpoint failed", error=str(exc))

    async def reload_trust(self, config: Config) -> None:
        """SIGHUP: take the trust store of `config`, the configuration file read again — its
        `[trust.operators]`, `[trust.quorum]` and `[trust.signers]` keys and `act_max_age_s` —
        and log in one line what changed. The new keys are recorded on the trust chain before
        any act is accepted under them (`TrustInForce.retrust`). Everything else in the file
        (`[trust] daemons` and `subjects_bound` included) is read at start only: a difference
        is named in that line as needing a restart, and not applied."""
        old = self.config
        new_trust = msgspec.structs.replace(
            old.trust, operators=config.trust.operators, quorum=config.trust.quorum,
            signers=config.trust.signers, act_max_age_s=config.trust.act_max_age_s)
        later = [f.name for f in msgspec.structs.fields(Config)
                 if f.name != "trust" and getattr(old, f.name) != getattr(config, f.name)]
        later += [f"trust.{name}" for name in ("daemons", "subjects_bound")
                  if getattr(old.trust, name) != getattr(config.trust, name)]
        changes = await self.engine.trust.retrust(new_trust)
        self.config = msgspec.structs.replace(old, trust=self.engine.trust.config)
        changed = changes["added"] or changes["removed"] or \
            old.trust.act_max_age_s != new_trust.act_max_age_s
        say = log.warning if changed else log.info
        say("trust store reloaded", added=changes["added"], removed=changes["removed"],
            act_max_age_s=new_trust.act_max_age_s,
            **({"not_reloaded_restart_to_apply": later} if later else {}))

    def healthy(self) -> bool:
        """The consumer task is alive (what the systemd watchdog checks)."""
        return self.ready.is_set() and self._service is not None and not self._service.done()

    async def republish_if_lost(self) -> bool:
        """When the retained records or the review index were lost — records in memory storage
        across a broker restart, a purge, or an upgrade from a version without the index —
        republish them from the chains, so `review`, the metric and late joiners read the
        truth again; True when it did. A broker restart over file storage loses neither (the
        state cache it does lose fills lazily, `ChainRecords.load`).

        A loss is told by the marker a complete refill leaves in the records stream
        (`Store.filled`), never by an empty stream: a proposal that arrives during the
        reconnect lands in a new stream first, and one record must not pass for all of them.
        The marker names the stream as it was when the refill began, so a refill cut short by
        another restart, or outrun by one, leaves no valid marker behind and the next check
        refills again."""
        async with self._refill:
            seen = await self.store.incarnation()
            if await self.store.filled(seen):
                return False
            if await self.store.has_chains():
                log.warning("retained records or the review index incomplete; refilling them "
                            "from the audit chains")
                started = time.perf_counter()
                count = await self.engine.publisher.republish_all()
                log.info("records and review index republished", chains=count,
                         seconds=round(time.perf_counter() - started, 2))
            await self.store.mark_filled(seen)
            return True

    async def _reconnected(self) -> None:
        self.engine.metrics.set_connected(True)
        await self._restore(ensure=True)
        await self.engine.republish_unpublished()
        await self._recount()

    async def _restore(self, ensure: bool) -> bool:
        """Bring the streams and buckets back and refill what the broker lost, retried until it
        holds: a single failed attempt (JetStream still recovering, a second restart) must not
        leave the records half-filled until some later reconnect. Whether it refilled; never
        raises."""
        delay = 0.2
        while not self._stopping.is_set():
            try:
                if ensure:
                    await self.store.ensure()
                return await self.republish_if_lost()
            except Exception as exc:
                log.warning("could not restore the retained records yet; trying again",
                            error=f"{type(exc).__name__}: {exc}", retry_in_s=delay)
            ensure = True  # the bucket may be gone without a reconnect having told us
            await self._pause(delay)
            delay = min(delay * 2, 5.0)
        return False

    async def _watch_records(self) -> None:
        """Every few seconds, check the records' marker — a loss no reconnect announced (a
        purge, the replicas of a memory stream all restarted) is refilled too — publish again
        the records a broker outage kept from being published, and recount the queue from the
        index, so every replica's metric says what the index says."""
        while not self._stopping.is_set():
            await self._pause(CACHE_CHECK_S)
            if self._stopping.is_set() or not self.nc.is_connected:
                continue
            await self._restore(ensure=False)
            await self.engine.republish_unpublished()
            await self._recount()

    async def stop(self) -> None:
        """Stop taking work, finish what is in flight, unsubscribe."""
        self._stopping.set()
        self._expiry_wake.set()
        for sub in self._subs:
            await sub.unsubscribe()
        if self._service is not None:
            with anyio.move_on_after(DRAIN_S):  # a wedged job must not hold the stop forever
                await asyncio.wait([self._service])
            if not self._service.done():
                log.warning("in-flight work did not drain; cancelling it", seconds=DRAIN_S)
                self.halt()
            with suppress(Exception, asyncio.CancelledError):
                await self._service
        with_psub = getattr(self, "_psub", None)
        if with_psub is not None:
            await with_psub.unsubscribe()
        log.info("daemon stopped", actor=self.actor)

    def halt(self) -> None:
        """Stop at once, without draining: every background task is cancelled (what is not
        acknowledged is redelivered to the next daemon)."""
        self._stopping.set()
        if self._scope is not None:
            self._scope.cancel()

    # -- the inbound consumer ------------------------------------------------------------------------

    async def _consume(self) -> None:
        """Fetch inbound messages and run each as a job: at most MAX_IN_FLIGHT at once, and
        the jobs of one proposal (one key) one after the other, in arrival order. On stop,
        fetching ends and the task group drains what was taken. Every message held meanwhile
        (queued or running) is kept from redelivery by `_keep_alive`."""
        slots = anyio.CapacityLimiter(MAX_IN_FLIGHT)
        tails: dict[str, anyio.Event] = {}  # set when the last job of each key is done
        async with anyio.create_task_group() as keeper:
            keeper.start_soon(self._keep_alive, name="improved-ack-progress")
            async with anyio.create_task_group() as jobs:
                while not self._stopping.is_set():
                    batch = await self._fetch()
                    fetched = time.monotonic()
                    self._held.update((id(job), (job.msg, fetched)) for job in batch)
                    for job in batch:
                        done = anyio.Event()  # also the job's claim on a slot
                        await slots.acquire_on_behalf_of(done)
                        jobs.start_soon(self._run_after, tails.get(job.key), done, job, slots)
                        tails[job.key] = done
                        self._in_flight += 1
                        self.engine.metrics.set_in_flight(self._in_flight)
                    tails = {key: done for key, done in tails.items() if not done.is_set()}
            keeper.cancel_scope.cancel()  # every job is done: nothing left to keep

    async def _keep_alive(self) -> None:
        """Tell the broker, every ACK_PROGRESS_S, that each message held for ACK_QUIET_S or
        more is still being worked on, so the inbound consumer's short ack wait
        (`store.INBOUND_ACK_WAIT_S`, what brings back a delivery lost with a dying connection)
        never redelivers a message in hand. A message settled sooner costs no extra word."""
        while True:
            await anyio.sleep(ACK_PROGRESS_S)
            now = time.monotonic()
            for key, (msg, since) in list(self._held.items()):
                if now - since < ACK_QUIET_S:
                    continue
                with suppress(Exception):  # an outage: the message is redelivered, as it must
                    await msg.in_progress()
                if key in self._held:
                    self._held[key] = (msg, now)

    async def _fetch(self) -> list[Job]:
        """The next batch of inbound messages as jobs; none on a timeout or a broker outage
        (never raises: the consumer must outlive both)."""
        try:
            msgs = await self._psub.fetch(FETCH_BATCH, timeout=0.5)
        except (TimeoutError, FetchTimeoutError, NatsTimeout):
            return []
        except Exception as exc:  # broker outage: wait and try again, never die
            log.warning("fetch failed", error=str(exc))
            await anyio.sleep(0.5)
            return []
        out = []
        for msg in msgs:
            try:
                job = await self._decode(msg)
            except Exception:  # a bug in decoding must not end the consumer
                log.exception("could not decode an inbound message; terminated",
                              subject=msg.subject)
                await msg.term()
                continue
            if job is not None:
                out.append(job)
        return out

    async def _run_after(self, previous: anyio.Event | None, done: anyio.Event, job: Job,
                         slots: anyio.CapacityLimiter) -> None:
        """Run `job` once the previous job of its proposal is done; free its slot after."""
        try:
            if previous is not None:
                await previous.wait()
            await self._run(job)
        except Exception as exc:  # an ack lost to a broker outage: the message comes again
            log.warning("could not settle an inbound message; it is redelivered",
                        key=job.key, error=f"{type(exc).__name__}: {exc}")
        finally:
            self._held.pop(id(job), None)
            done.set()
            slots.release_on_behalf_of(done)
            self._in_flight -= 1
            self.engine.metrics.set_in_flight(self._in_flight)

    async def _decode(self, msg: Msg) -> Job | None:
        """Turn one inbound message into a Job, or refuse it (term + refusal record)."""
        kind, svc = S.token(msg.subject, 1), S.token(msg.subject, 2)
        act = Act(hashlib.sha256(msg.data).hexdigest(), msg.metadata.sequence.stream)
        try:
            if msg.subject in (S.GRANTS, S.QUORUM):
                return self._signed_job(msg, act)
            if svc is None or not S.SERVICE_RE.match(svc):
                raise wire.WireError(wire.INVALID_VALUE, f"bad service token in {msg.subject}")
            return await self._service_job(kind or "", svc, msg, act)
        except RecursionError:
            err = wire.WireError(wire.TOO_DEEP, "message nests too deeply")
            await self._refuse(svc or "_", msg.subject, err, len(msg.data))
            await msg.term()
            return None
        except wire.WireError as err:
            await self._refuse(svc or "_", msg.subject, err, len(msg.data))
            await msg.term()
            return None

    def _signed_job(self, msg: Msg, act: Act) -> Job:
        """A signed act on a mesh subject: a grant, a revoke or a crisis resolution on
        `improve.grants`, a vote on `improve.quorum`, routed by its (not yet verified)
        payload; the engine checks the signature."""
        env, payload = signed_act(msg.data, self.config.max_message_bytes)
        act = Act(envelope_digest(env), act.stream_seq)
        if msg.subject == S.QUORUM:
            pid = payload.get("proposal_id")
            if not isinstance(pid, str) or not S.ID_RE.match(pid):
                raise wire.WireError(wire.INVALID_VALUE, "a vote names a 64-hex proposal_id",
                                     "proposal_id")
            return Job(pid, lambda: self._vote(pid, env, act), msg)
        if env.payloadType == PAYLOAD_TYPES["crisis"]:  # improve.grants carries both
            return Job("crisis", lambda: self.engine.autonomy.resolve_crisis(env, act), msg)
        claimed = payload.get("skill")
        if not isinstance(claimed, str) or not GRANT_SKILL_RE.match(claimed):
            raise wire.WireError(wire.INVALID_VALUE, "a grant names `<name>:<sha256>`", "skill")
        return Job(f"grant:{claimed}", lambda: self.acts.grant(env, claimed, act), msg)

    async def _service_job(self, kind: str, svc: str, msg: Msg, act: Act) -> Job:
        """A message on one of `svc`'s inbound subjects (`improve.<kind>.<svc>`)."""
        limit = self.config.max_message_bytes
        if kind == "proposals":
            proposal, penv = proposal_of(msg.data, svc, limit)
            pid, dedup = propose.identify(proposal)
            await self._check_surface(svc, pid, proposal)
            redelivered = msg.metadata.num_delivered > 1
            return Job(pid, lambda: self._propose(proposal, pid, dedup, penv, redelivered), msg)
        if kind == "outcomes":
            sig, senv = signal_of(msg.data, limit)
            if sig.proposal_id is None:  # one target's signals in order, targets at once
                return Job(f"observe:{svc}:{sig.target_ref or ''}",
                           lambda: self._observe(svc, sig), msg)
            return Job(sig.proposal_id, lambda: self._signal(svc, sig, senv, msg), msg)
        if kind == "applied":
            said = boundary.attest_report(msg.data, service=svc,
                                          signers=self.engine.answers.signers(),
                                          bound=self.engine.answers.bound)
            report = wire.decode(said.value, ApplyReport, limit)
            if report.service != svc:
                raise wire.WireError(wire.SUBJECT_MISMATCH, f"service {report.service!r} "
                                     f"disagrees with the subject's {svc!r}", "service")
            return Job(report.proposal_id, lambda: self._report(said.map(lambda _: report)),
                       msg)
        if kind == "triage":
            renv, target = review_target(msg.data, limit)
            if renv is not None:
                act = Act(envelope_digest(renv), act.stream_seq)
            return Job(target, lambda: self._review(svc, target, renv, act, msg), msg)
        raise wire.WireError(wire.INVALID_VALUE, f"no inbound subject {msg.subject}")

    async def _run(self, job: Job) -> None:
        parked = False
        try:
            parked = await self._settle(job)
        finally:
            if not parked:
                self._parked.discard(job.msg.metadata.sequence.stream)

    async def _settle(self, job: Job) -> bool:
        """Run the job and settle its message; True when it was parked on the slow retry."""
        msg = job.msg
        delivered = msg.metadata.num_delivered
        budget = self.config.apply.max_deliveries
        if delivered > budget and not await self._worth_a_pass(job):
            return await self._park(job, delivered - budget)
        try:
            await job.run()
        except ServiceUnreachable as exc:
            if delivered < budget:
                await msg.nak(delay=backoff_s(delivered))
                return False
            if delivered == budget:
                self.engine.metrics.apply_result("unreachable")
                record = exc.record
                if record is None:
                    record, _ = await self.store.load(S.token(msg.subject, 2) or "", job.key)
                if record is not None:
                    await self.engine.publisher.publish_unreachable(record, str(exc))
            return await self._park(job, delivered - budget, str(exc))
        except _ProposalUnknown as exc:
            if delivered < NOT_FOUND_RETRIES:
                await msg.nak(delay=backoff_s(delivered))
                return False
            await self._refuse(S.token(msg.subject, 2) or "_", msg.subject,
                               wire.WireError(wire.NOT_FOUND, str(exc), "proposal_id"),
                               len(msg.data))
            await msg.term()
            return False
        except wire.WireError as err:
            await self._refuse(S.token(msg.subject, 2) or "_", msg.subject, err, len(msg.data))
            await msg.term()
            return False
        except ChainBroken as exc:  # the crisis is open; nothing is decided on this chain
            log.error("message dropped: its chain does not verify", subject=msg.subject,
                      key=job.key, problem=str(exc))
            await msg.term()
            return False
        except Exception:
            log.exception("handler failed; will retry", subject=msg.subject, key=job.key)
            await msg.nak(delay=backoff_s(delivered))
            return False
        await msg.ack()
        return False

    async def _park(self, job: Job, past_budget: int, error: str | None = None) -> bool:
        """Keep a given-up apply's message on a slow retry (see the module's docstring), or,
        with MAX_PARKED already kept, acknowledge it: the proposal stays retryable. True when
        it was kept."""
        msg, seq = job.msg, job.msg.metadata.sequence.stream
        if seq not in self._parked and len(self._parked) >= MAX_PARKED:
            log.error("apply gave up for now; the proposal stays retryable (`improved retry`)",
                      proposal_id=job.key, error=error, parked=len(self._parked))
            await msg.ack()
            return False
        delay = slow_backoff_s(past_budget, self.config.apply.retry_max_s)
        if error is not None:
            log.warning("apply unreachable; retrying slowly", proposal_id=job.key, error=error,
                        retry_in_s=delay)
        self._parked.add(seq)
        await msg.nak(delay=delay)
        return True

    async def _worth_a_pass(self, job: Job) -> bool:
        """For a message past its delivery budget: is a pass worth making now? Not while
        nothing serves the owning service's apply subject and the proposal has not expired
        (a pass would only record an intent and withdraw it); yes otherwise, and whenever
        that cannot be told (no such proposal cached, a probe timing out or answered)."""
        if not S.ID_RE.match(job.key):
            return True
        try:
            svc = await self.store.service_of(job.key)
            record = (await self.store.load(svc, job.key))[0] if svc else None
        except Exception:  # a read that fails decides nothing: make the pass
            return True
        if record is None or not apply_stage.needs_apply(record):
            return True
        valid_to = record.proposal.valid_to
        if valid_to is not None and valid_to <= time.time() * 1000:
            return True  # the pass expires it
        try:
            await self.nc.request(S.apply_request(record.service), PROBE_ORDER,
                                  timeout=self.config.apply.timeout_s)
        except NoRespondersError:
            return False
        except Exception:
            return True
        return True

    async def _propose(self, proposal: Proposal, pid: str, dedup: str, env: Envelope | None,
                       republish: bool) -> None:
        """Register a proposal from the inbound stream; a signed one only once its signature
        verified (a WireError otherwise: refused, and nothing changes)."""
        async with self.engine.trust.acting():  # the signer's key is checked, then recorded
            proposer = self.engine.trust.verified_proposer(proposal, env)
            await self.intake.submit(proposal, pid, dedup, republish, proposer=proposer,
                                     envelope=env)

    async def _signal(self, svc: str, sig: Signal, env: Envelope | None, msg: Msg) -> None:
        handled = await self._count(svc, sig, env, republish=msg.metadata.num_delivered > 1)
        if handled.record is None:
            raise _ProposalUnknown(f"no proposal {sig.proposal_id} for service {svc}")

    async def _count(self, svc: str, sig: Signal, env: Envelope | None, *,
                     republish: bool = False, fresh: bool = False,
                     dispatch: bool = True) -> Handled:
        """Count a signal that arrived on `svc`'s subject for the proposal it names, whichever
        service that proposal is of (a world signal comes on its emitter's own subject)."""
        owner = await self.engine.records.service_of(sig.proposal_id or "") or svc
        async with self.engine.trust.acting():  # a signed signal's key is checked, then recorded
            emitter, verified = self.engine.trust.emitter_of(svc, sig, env)
            return await self.intake.signal(owner, sig, republish, fresh, dispatch,
                                            emitter=emitter, envelope=verified)

    async def _review(self, svc: str, pid: str, env: Envelope | None, act: Act,
                      msg: Msg) -> None:
        handled = await self.acts.review(svc, pid, env, act)
        if handled.record is None:
            raise _ProposalUnknown(f"no proposal {pid} for service {svc}")

    async def _vote(self, pid: str, env: Envelope, act: Act) -> None:
        svc = await self.engine.records.service_of(pid)
        handled = await self.acts.vote(svc, pid, env, act) if svc else None
        if handled is None or handled.record is None:
            raise _ProposalUnknown(f"no proposal {pid}")

    async def _report(self, said: boundary.Evidence[ApplyReport]) -> None:
        """An asynchronous apply result: accepted only while the proposal awaits its apply
        (and, where the service's own reports can be told, only its own)."""
        report = said.value
        result = said.map(lambda r: apply_stage.recordable(ApplyResult(
            ok=r.ok, applied_id=r.applied_id, inverse=r.inverse, rollbackable=r.rollbackable,
            error=r.error, schema_class=r.schema_class)))
        handled, taken = await self.intake.report(report.service, report.proposal_id, result)
        if handled.record is None:
            raise _ProposalUnknown(f"no proposal {report.proposal_id} for {report.service}")
        if not taken:
            raise wire.WireError("not_awaiting_apply", f"proposal {report.proposal_id} is "
                                 f"{handled.record.status} and not waiting for an apply",
                                 "proposal_id")

    async def _observe(self, svc: str, sig: Signal) -> None:
        for proposal in await self.observer.observe(svc, sig):
            pid, _ = propose.identify(proposal)
            await enqueue(self.store.js, proposal.service, to_json(proposal), pid)
            log.info("observed a candidate", proposal_id=pid, stage="observe",
                     analyzer=proposal.analyzer.id)

    async def _refuse(self, svc: str, subject: str, err: wire.WireError, size: int) -> None:
        log.warning("refused", subject=subject, code=err.code, field=err.field,
                    reason=err.message)
        self.engine.metrics.refused(err.code)
        try:
            await self.store.refuse(svc if S.SERVICE_RE.match(svc) else "_", Refusal(
                subject=subject, code=err.code, field=err.field, message=err.message,
                size=size, at=int(time.time() * 1000)))
        except Exception as exc:  # the refusal log is best effort; the refusal itself stands
            log.warning("could not record a refusal", error=str(exc))

    # -- request/reply -------------------------------------------------------------------------------

    def _guarded(self, handler: Callable[[str, Msg], Awaitable[bytes]]
                 ) -> Callable[[Msg], Awaitable[None]]:
        """Every request gets a reply: a record, or the error reply of DESIGN §3.1."""

        async def run(msg: Msg) -> None:
            svc = S.token(msg.subject, 0) or "_"
            try:
                if msg.subject != S.SPEC_GET and not S.SERVICE_RE.match(svc):
                    raise wire.WireError(wire.INVALID_VALUE, f"bad service token {svc!r}")
                reply = await handler(svc, msg)
            except wire.WireError as err:
                await self._refuse(svc, msg.subject, err, len(msg.data))
                reply = err.reply()
            except _ProposalUnknown as exc:
                reply = wire.WireError(wire.NOT_FOUND, str(exc), "proposal_id").reply()
            except ChainBroken as exc:
                reply = wire.WireError(wire.CHAIN_BROKEN, f"the chain does not verify, nothing "
                                       f"is decided on it: {exc}", "proposal_id").reply()
            except Exception:
                log.exception("request failed", subject=msg.subject)
                reply = wire.WireError(wire.INTERNAL, "internal error; see the daemon log").reply()
            if msg.reply:
                try:
                    await msg.respond(reply)
                except Exception as exc:
                    log.warning("could not reply", subject=msg.subject, error=str(exc))

        return run

    async def _check_surface(self, svc: str, pid: str, proposal: Proposal) -> None:
        """WireError `no_surface` for a new proposal of a service that advertises it takes
        none; one already on a chain here is carried on (it was accepted before), and so is
        the reversal of an applied change (a way back is never refused)."""
        if apply_stage.rolls_back(proposal) is not None:
            return
        problem = propose.surface_problem(svc, await self.surfaces.spec(svc))
        if problem is not None and await self.engine.records.service_of(pid) is None:
            raise wire.WireError(wire.NO_SURFACE, problem, "service")

    async def on_propose(self, svc: str, msg: Msg) -> bytes:
        proposal, env = proposal_of(msg.data, svc, self.config.max_message_bytes)
        pid, dedup = propose.identify(proposal)
        await self._check_surface(svc, pid, proposal)
        async with self.engine.trust.acting():
            # a signed proposal that does not verify is refused before anything is kept
            proposer = self.engine.trust.verified_proposer(proposal, env)
            # Durable first: once the stream has it, a crash cannot lose it.
            await enqueue(self.store.js, svc, msg.data, pid)
            # Register and triage now, so the reply carries the status; the inbound consumer,
            # which has the message too, carries the apply with its retries.
            handled = await self.intake.submit(proposal, pid, dedup, dispatch=False,
                                               fresh=True, proposer=proposer, envelope=env)
        status = (status_at(handled.record, int(time.time() * 1000)) if handled.record
                  else "pending")
        return to_json(ProposeReply(proposal_id=pid, status=status))

    async def on_triage(self, svc: str, msg: Msg) -> bytes:
        req = wire.decode(msg.data, TriageRequest, self.config.max_message_bytes)
        try:
            handled = await self.engine.advance(svc, req.proposal_id, republish=True)
            record = handled.record
        except ServiceUnreachable:
            record, _ = await self.store.load(svc, req.proposal_id)
        if record is None:
            raise _ProposalUnknown(f"no proposal {req.proposal_id} for service {svc}")
        if record.decision is None:
            raise wire.WireError(wire.NOT_FOUND, "the proposal has no decision yet",
                                 "proposal_id")
        return to_json(record.decision)

    async def on_refine(self, svc: str, msg: Msg) -> bytes:
        sig, env = signal_of(msg.data, self.config.max_message_bytes)
        if sig.proposal_id is None:
            raise wire.WireError(wire.MISSING_FIELD, "a refine signal names its proposal_id",
                                 "proposal_id")
        # Durable first, like a proposal: the inbound consumer carries any apply it releases.
        await publish_deduplicated(self.store.js, S.inbound_outcome(svc), msg.data,
                                   S.message_id(propose.signal_digest(sig), msg.data),
                                   S.STREAM_INBOUND)
        handled = await self._count(svc, sig, env, fresh=True, dispatch=False)
        counted = handled.counted
        if handled is not None and handled.record is None:
            raise _ProposalUnknown(f"no proposal {sig.proposal_id} for service {svc}")
        return to_json(RefineReply(proposal_id=sig.proposal_id, counted=counted is not None,
                                   independent=bool(counted and counted.independent)))

    async def on_spec(self, svc: str, msg: Msg) -> bytes:
        return msgspec.json.encode(capabilities(self.config.policy.quorum))


class _ProposalUnknown(Exception):
    pass


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT; install it first, so a stop during start-up still
    ends in a drain and exit 0."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def received(sig: signals.Signals) -> None:
        log.info("signal received", signal=sig.name)
        stop.set()

    for sig in (signals.SIGTERM, signals.SIGINT):
        loop.add_signal_handler(sig, received, sig)
    return stop


# The cyclic collector's youngest generation is collected after this many new container
# objects (CPython's default is 700). Every proposal allocates thousands of short-lived ones
# (messages, futures, structs) that reference counting frees; at 700 the collector runs
# hundreds of times a second and scans them for nothing.
GC_THRESHOLDS = (20_000, 20, 20)


def settle_garbage_collector() -> None:
    """For a long-running daemon, once started: move everything alive at start (modules,
    config, keys, connections) out of the collector's sight for good (`gc.freeze`), and
    collect the young generation less often. Cycles are still collected."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def _reload_on_hup(daemon: Daemon, reread: Callable[[], Config],
                         hup: asyncio.Event) -> None:
    """Each SIGHUP: read the configuration file again and take its trust store; a file that
    does not load (or a reload that cannot be recorded) is one error line, and the trust in
    force stays."""
    while True:
        await hup.wait()
        hup.clear()
        try:
            config = reread()
        except ConfigError as exc:
            log.error("trust store not reloaded", error=str(exc),
                      why="the configuration does not load; the trust in force stays")
            continue
        try:
            await daemon.reload_trust(config)
        except Exception as exc:
            log.error("trust store not reloaded", error=f"{type(exc).__name__}: {exc}",
                      why="the new keys could not be recorded on the trust chain; only the "
                          "keys both stores hold count until a SIGHUP succeeds")


async def run_until_stopped(nc: Client, config: Config,
                            on_ready: Callable[[Daemon], None] | None = None,
                            stop: asyncio.Event | None = None,
                            reread: Callable[[], Config] | None = None) -> int:
    """Run a daemon until SIGTERM or SIGINT, then drain and return 0. With `reread` (how to
    read the configuration again), SIGHUP reloads the trust store from it."""
    daemon = Daemon(nc, config)
    stop = stop or stop_on_signals()
    hup = asyncio.Event()
    if reread is not None:  # before the start: a SIGHUP while starting waits, never kills
        asyncio.get_running_loop().add_signal_handler(signals.SIGHUP, hup.set)
    http = None
    try:
        if config.metrics_port is not None:  # bound first: a busy port stops the start
            http = await metrics.serve(daemon.engine.metrics, config.metrics_host,
                                       config.metrics_port, ready=lambda: daemon.ready.is_set(),
                                       healthy=daemon.healthy)
        await daemon.start()
    except BaseException:  # e.g. a ConfigError: the connection is not left behind
        if reread is not None:
            asyncio.get_running_loop().remove_signal_handler(signals.SIGHUP)
        if http is not None:
            http.close()
        await bus.close(nc)
        raise
    settle_garbage_collector()  # before "ready" is said: it holds the loop for a moment
    if on_ready:
        on_ready(daemon)
    notify.ready()  # systemd Type=notify: streams and consumers are bound
    notify.status(f"serving as {daemon.actor}")
    # The watchdog is fed while the consumer runs: a wedged loop gets restarted. A broker
    # outage is not fed back: a restart would not cure it.
    async with anyio.create_task_group() as tg:
        tg.start_soon(notify.watchdog_loop, daemon.healthy, name="improved-watchdog")
        if reread is not None:
            tg.start_soon(_reload_on_hup, daemon, reread, hup, name="improved-reload")
        if http is not None:
            log.info("metrics and health served", host=config.metrics_host,
                     port=http.sockets[0].getsockname()[1])
        await stop.wait()
        log.info("stopping: draining in-flight work", pid=os.getpid())
        notify.stopping()
        tg.cancel_scope.cancel()  # the watchdog and the reloads
    if reread is not None:
        asyncio.get_running_loop().remove_signal_handler(signals.SIGHUP)
    daemon.engine.metrics.set_ready(False)
    if http is not None:
        http.close()
    await daemon.stop()
    await bus.close(nc)
    return 0
