"""The daemon's lifecycle: start (the daemon key, the streams, the trust, the policy and a
checkpoint before anything is subscribed), serve every background task in one task group, and a
clean drain on stop. What it runs has a home of its own, each handed what it needs: the
inbound consumer (`runtime.inbound`), the request/reply capabilities (`runtime.request_reply`),
the periodic passes (`runtime.upkeep`) and the index checks (`runtime.index_checks`), over the
engine's passes (`runtime.engine`, `runtime.intake`, `runtime.signed_acts`).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal as signals
import uuid
from collections.abc import Callable
from contextlib import suppress

import anyio
import msgspec
import structlog
from nats.aio.client import Client

from improved.client import connection, keys
from improved.client.config import Config
from improved.client.connection import ConfigError
from improved.core import indexes, policy
from improved.core.observe import Observer, RegressionAnalyzer, StaleSkillAnalyzer
from improved.protocol import subjects as S
from improved.runtime import metrics, notify, telemetry
from improved.runtime.admission import Admission
from improved.runtime.engine import Engine
from improved.runtime.inbound import InboundConsumer
from improved.runtime.index_checks import IndexChecks
from improved.runtime.intake import Intake
from improved.runtime.observing import Observing
from improved.runtime.request_reply import RequestReply
from improved.runtime.signed_acts import SignedActs
from improved.runtime.store import Store
from improved.runtime.surfaces import Surfaces
from improved.runtime.telemetry import Tracing
from improved.runtime.upkeep import Upkeep

log = structlog.get_logger("improved.daemon")

DRAIN_S = 30.0  # how long `stop` waits for in-flight work before cancelling it
# at start, the index members are counted from the chains before ready (when the last
# checkpoint has no counts) only if that reads at most this many trailers; else after ready
START_COUNT_LIMIT = 20_000


def instance_actor() -> str:
    """SPEC 07 actor id of a daemon acting on its own: `improved:<uuid>` (v7 where available)."""
    make = getattr(uuid, "uuid7", None)
    return f"improved:{make() if make else uuid.uuid4()}"


class Daemon:
    """One replica of the loop: its store, engine and the parts that feed the engine."""

    def __init__(self, nc: Client, config: Config, actor: str | None = None,
                 tracing: Tracing | None = None):
        self.nc = nc
        self.config = config
        self.actor = actor or instance_actor()
        self.store = Store(nc, config.replicas, config.records_storage)
        # tombstones outlive the next two checkpoints: a reader finds what left since the last
        self.store.tombstone_ttl_s = indexes.tombstone_ttl_s(config.checkpoint_interval_s)
        self.engine = Engine(nc, self.store, config, self.actor, tracing)
        # what enters a pass: registrations, signals and reports; signed acts
        self.intake = Intake(self.engine)
        self.acts = SignedActs(self.engine)
        # what each service advertises: its own (attested) "improve": false refuses proposals
        self.surfaces = Surfaces(self.engine.answers)
        self.observer = Observing(self.store,
                                  Observer([RegressionAnalyzer(), StaleSkillAnalyzer()]))
        self.engine.commits.learn = self.observer.learn
        self._stopping = anyio.Event()
        self._service: asyncio.Task[None] | None = None  # runs serve(): every background task
        self._scope: anyio.CancelScope | None = None  # serve()'s task group, to halt it
        self.ready = anyio.Event()
        # set once the work after ready (`_after_ready`: refills, counts, index checks) is done
        self.settled = anyio.Event()
        admission = Admission(self.store, self.engine, self.intake, self.surfaces)
        self.requests = RequestReply(nc, self.store, config, self.engine, self.intake, admission)
        self.inbound = InboundConsumer(nc, self.store, config, self.engine, self.intake,
                                       self.acts, self.observer, admission, self._stopping)
        self.upkeep = Upkeep(nc, self.store, self.engine, self._stopping)
        self.index_checks = IndexChecks(self.store, self.engine, config, self.upkeep.indexed)
        self.engine.on_indexed = self.upkeep.indexed

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
        await self.engine.checkpoints.checkpoint(self._checkpoint_key,
                                                 count_limit=START_COUNT_LIMIT)
        connection.on_reconnect(self.nc, self.upkeep.reconnected)
        await self.requests.subscribe()
        await self.inbound.bind()
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
                tg.start_soon(self.inbound.run, name="improved-consume")
                if self.config.checkpoint_interval_s > 0:
                    tg.start_soon(self._checkpoints, name="improved-checkpoints")
                tg.start_soon(self.upkeep.watch_records, name="improved-records-watch")
                tg.start_soon(self.upkeep.expiries, name="improved-expiries")
                tg.start_soon(self.upkeep.reviews, name="improved-reviews")
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
        both indexes against the checkpoint (`IndexChecks.check_indexes`: the measurements
        still owed are remembered from it). None of it is read by a decision (every decision
        replays its chain), only by watchers, `review`, the metric and the wake-ups."""
        await self.upkeep.restore(ensure=False)
        counted = self.engine.checkpoints.counted
        if counted is None or counted.members is None:
            try:
                await self.engine.checkpoints.checkpoint(self._checkpoint_key)
            except Exception as exc:  # an outage: the checkpoint timer counts them
                log.warning("checkpoint failed", error=f"{type(exc).__name__}: {exc}")
        await self.upkeep.recount()
        await self.index_checks.check_indexes()
        self.settled.set()

    async def _checkpoints(self) -> None:
        """Sign a checkpoint every interval (verifying the log first), then seal an epoch of
        the log if one is due, until stopped."""
        while not self._stopping.is_set():
            await self.upkeep.pause(self.config.checkpoint_interval_s)
            try:
                if await self.engine.checkpoints.checkpoint(self._checkpoint_key) is None \
                        and not self._stopping.is_set():  # a seal reads its epoch: not on the way out
                    await self.index_checks.check_indexes()
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

    async def stop(self) -> None:
        """Stop taking work, finish what is in flight, unsubscribe."""
        self._stopping.set()
        self.upkeep.wake()
        await self.requests.unsubscribe()
        if self._service is not None:
            with anyio.move_on_after(DRAIN_S):  # a wedged job must not hold the stop forever
                await asyncio.wait([self._service])
            if not self._service.done():
                log.warning("in-flight work did not drain; cancelling it", seconds=DRAIN_S)
                self.halt()
            with suppress(Exception, asyncio.CancelledError):
                await self._service
        await self.inbound.unbind()
        await self.store.acks.close()
        await self.store.record_acks.close()
        log.info("daemon stopped", actor=self.actor)

    def halt(self) -> None:
        """Stop at once, without draining: every background task is cancelled (what is not
        acknowledged is redelivered to the next daemon)."""
        self._stopping.set()
        if self._scope is not None:
            self._scope.cancel()


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
    read the configuration again), SIGHUP reloads the trust store from it. Traces as
    `[telemetry]` and the OTEL_* variables say (`telemetry.start`: off by default)."""
    try:
        tracing = telemetry.start(config.telemetry, os.environ)
    except ConfigError:
        await connection.close(nc)
        raise
    daemon = Daemon(nc, config, tracing=tracing)
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
        await connection.close(nc)
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
    await connection.close(nc)
    await asyncio.to_thread(tracing.shutdown)  # what is still buffered is exported
    return 0
