"""The inbound consumer: every message of IMPROVE_IN, from the durable pull consumer every replica
shares, decoded (pure) and run as a job of the engine.

Inbound messages are pulled from the shared durable consumer, as many as there is room for, and
handed over as they arrive (`client.pulls`), then decoded (pure).
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

import hashlib
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import anyio
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from improved.client import connection
from improved.client.config import Config
from improved.client.pulls import REFILL_AT, Pull
from improved.client.sdk import enqueue
from improved.core import apply as apply_stage
from improved.core import boundary, propose
from improved.core.authority import Act
from improved.core.inbound import (
    GRANT_SKILL_RE,
    proposal_of,
    review_target,
    signal_of,
    signed_act,
)
from improved.core.record import ProposalRecord
from improved.core.signing import PAYLOAD_TYPES, envelope_digest
from improved.protocol import subjects as S
from improved.protocol import wire
from improved.protocol.model import (
    ApplyReport,
    ApplyResult,
    Envelope,
    Proposal,
    Signal,
    to_json,
)
from improved.protocol.tracecontext import of_headers
from improved.runtime.admission import Admission, ProposalUnknown
from improved.runtime.engine import Engine
from improved.runtime.intake import Intake
from improved.runtime.observing import Observing
from improved.runtime.records import ChainBroken
from improved.runtime.service_requests import ServiceUnreachable
from improved.runtime.signed_acts import SignedActs
from improved.runtime.store import Store
from improved.runtime.telemetry import incoming

log = structlog.get_logger("improved.daemon")

PULL_BATCH = 256  # messages asked for by one pull request, at most
MAX_IN_FLIGHT = 1024
NOT_FOUND_RETRIES = 5
ACK_PROGRESS_S = 1.5  # a third of the inbound consumer's ack wait (store.INBOUND_ACK_WAIT_S)
# A held message is told to be in progress once it has gone this long without: it is then
# told again within ACK_QUIET_S + ACK_PROGRESS_S = 3.5 s, well inside the 5 s ack wait.
ACK_QUIET_S = 2.0
MAX_PARKED = 256  # given-up applies kept on a slow retry, per daemon (max_ack_pending is 1024)
PROBE_ORDER = b'{"proposal_id":"probe"}'  # answered as malformed by whatever serves applies


def backoff_s(delivered: int) -> float:
    return min(0.5 * 2.0 ** max(delivered - 1, 0), 60.0)


def slow_backoff_s(past_budget: int, cap: float) -> float:
    """The delay before the next try of a given-up apply: a minute, doubling, up to `cap`."""
    return min(60.0 * 2.0 ** min(max(past_budget, 0), 16), cap)


@dataclass
class Job:
    """One decoded inbound message, ready to run."""

    key: str
    run: Callable[[], Awaitable[Any]]
    msg: Msg
    traceparent: str | None = None  # its header, read only while tracing is on


class InboundConsumer:
    """The jobs of the inbound consumer, run until `stopping` is set, then drained."""

    def __init__(self, nc: Client, store: Store, config: Config, engine: Engine, intake: Intake,
                 acts: SignedActs, observer: Observing, admission: Admission,
                 stopping: anyio.Event):
        self.nc = nc
        self.store = store
        self.config = config
        self.engine = engine
        self.intake = intake
        self.acts = acts
        self.observer = observer
        self.admission = admission
        self._stopping = stopping
        self._in_flight = 0
        # the inbound messages taken and not yet settled, with when each was last fetched or
        # told to the broker to be in progress (monotonic seconds)
        self._held: dict[int, tuple[Msg, float]] = {}
        # the last job of each key with one in flight: set when it is done, and the next job
        # of that key waits for it (gone once done, if no later one came)
        self._tails: dict[str, anyio.Event] = {}
        self._parked: set[int] = set()  # stream sequences of given-up applies on slow retry
        # the pull requests on the shared consumer, once bound (`bind`)
        self._pull: Pull | None = None

    async def bind(self) -> None:
        """Listen for the deliveries of the shared durable consumer (made by `Store.ensure`)."""
        self._pull = Pull(self.nc, S.STREAM_INBOUND, S.CONSUMER_INBOUND,
                                 batch=PULL_BATCH, refill_at=min(REFILL_AT, MAX_IN_FLIGHT))
        await self._pull.start()
        connection.on_reconnect(self.nc, self._pull.reconnected)

    async def unbind(self) -> None:
        """Leave the consumer (after the drain): what was delivered and not taken is handed
        back at once (nak); what is not acknowledged is redelivered."""
        if self._pull is not None:
            for msg in await self._pull.stop():
                with suppress(Exception):
                    await msg.nak()

    async def run(self) -> None:
        """Fetch inbound messages and run each as a job: at most MAX_IN_FLIGHT at once, and
        the jobs of one proposal (one key) one after the other, in arrival order. On stop,
        fetching ends and the task group drains what was taken. Every message held meanwhile
        (queued or running) is kept from redelivery by `_keep_alive`."""
        tails = self._tails
        async with anyio.create_task_group() as keeper:
            keeper.start_soon(self._keep_alive, name="improved-ack-progress")
            async with anyio.create_task_group() as jobs:
                while not self._stopping.is_set():
                    batch = await self._fetch()
                    fetched = time.monotonic()
                    self._held.update((id(job), (job.msg, fetched)) for job in batch)
                    for job in batch:
                        done = anyio.Event()
                        jobs.start_soon(self._run_after, tails.get(job.key), done, job)
                        tails[job.key] = done
                        self._in_flight += 1
                        self.engine.metrics.set_in_flight(self._in_flight)
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
        """The next inbound messages as jobs, as many as were delivered (within 0.5 s when
        none was yet): the pull asks only for the room MAX_IN_FLIGHT leaves beside the jobs in
        flight; none on a timeout or a broker outage (never raises: the consumer must outlive
        both)."""
        assert self._pull is not None, "bound before the consumer runs"
        try:
            msgs = await self._pull.take(lambda: MAX_IN_FLIGHT - self._in_flight, timeout=0.5)
        except Exception as exc:  # broker outage: wait and try again, never die
            log.warning("fetch failed", error=str(exc))
            await anyio.sleep(0.5)
            return []
        out = []
        for msg in msgs:
            try:
                job = await self._decode(msg)
            except Exception:  # a bug in decoding, or no message of the stream at all (a
                # forged delivery into the fetch's inbox), must not end the consumer
                log.exception("could not decode an inbound message; terminated",
                              subject=msg.subject)
                with suppress(Exception):  # a forgery has nothing to terminate
                    await msg.term()
                continue
            if job is not None:
                if self.engine.tracing.on:
                    job.traceparent = of_headers(msg.headers)
                out.append(job)
        return out

    async def _run_after(self, previous: anyio.Event | None, done: anyio.Event,
                         job: Job) -> None:
        """Run `job` once the previous job of its proposal is done; its room is free after."""
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
            if self._tails.get(job.key) is done:  # no later job of its key waits for it
                del self._tails[job.key]
            self._in_flight -= 1
            self.engine.metrics.set_in_flight(self._in_flight)
            if self._pull is not None:
                self._pull.nudge()

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
            await self.admission.refuse(svc or "_", msg.subject, err, len(msg.data))
            await msg.term()
            return None
        except wire.WireError as err:
            await self.admission.refuse(svc or "_", msg.subject, err, len(msg.data))
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
            await self.admission.check_surface(svc, pid, proposal)
            redelivered = msg.metadata.num_delivered > 1
            return Job(pid, lambda: self._propose(proposal, pid, dedup, penv, redelivered), msg)
        if kind == "outcomes":
            sig, senv = signal_of(msg.data, limit)
            if sig.proposal_id is None:  # one target's signals in order, targets at once
                return Job(f"observe:{svc}:{sig.target_ref or ''}",
                           lambda: self.observe(svc, sig), msg)
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
        if job.traceparent is not None:  # this job's task only: its spans continue it
            incoming.set(job.traceparent)
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
                record = exc.record or await self._truth(S.token(msg.subject, 2) or "", job.key)
                if record is not None:
                    await self.engine.publisher.publish_unreachable(record, str(exc))
            return await self._park(job, delivered - budget, str(exc))
        except ProposalUnknown as exc:
            if delivered < NOT_FOUND_RETRIES:
                await msg.nak(delay=backoff_s(delivered))
                return False
            await self.admission.refuse(S.token(msg.subject, 2) or "_", msg.subject,
                               wire.WireError(wire.NOT_FOUND, str(exc), "proposal_id"),
                               len(msg.data))
            await msg.term()
            return False
        except wire.WireError as err:
            await self.admission.refuse(S.token(msg.subject, 2) or "_", msg.subject, err,
                                        len(msg.data))
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

    async def _truth(self, svc: str, pid: str) -> ProposalRecord | None:
        """`pid`'s record as this process committed it or as its chain says, to tell watchers
        its apply is stuck; None when it cannot be read (no such chain, one that does not
        verify, the broker away): a read that fails decides nothing."""
        if not svc:
            return None
        try:
            return await self.engine.records.truth(svc, pid)
        except Exception as exc:
            log.info("record not read; the apply's outcome is not told", proposal_id=pid,
                     error=f"{type(exc).__name__}: {exc}")
            return None

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
        that cannot be told (no such chain, a probe timing out or answered)."""
        if not S.ID_RE.match(job.key):
            return True
        try:
            svc = await self.engine.records.service_of(job.key)
            record = await self.engine.records.truth(svc, job.key) if svc else None
        except Exception:  # a read that fails decides nothing: make the pass
            return True
        if record is None or not apply_stage.needs_apply(record):
            return True
        valid_to = record.proposal.valid_to
        if valid_to is not None and valid_to <= time.time() * 1000:
            return True  # the pass expires it
        try:
            await self.engine.answers.ask(record.service, S.apply_request(record.service),
                                          PROBE_ORDER, timeout=self.config.apply.timeout_s,
                                          first=True)
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
        handled = await self.admission.count(svc, sig, env,
                                             republish=msg.metadata.num_delivered > 1)
        if handled.record is None:
            raise ProposalUnknown(f"no proposal {sig.proposal_id} for service {svc}")

    async def _review(self, svc: str, pid: str, env: Envelope | None, act: Act,
                      msg: Msg) -> None:
        handled = await self.acts.review(svc, pid, env, act)
        if handled.record is None:
            raise ProposalUnknown(f"no proposal {pid} for service {svc}")

    async def _vote(self, pid: str, env: Envelope, act: Act) -> None:
        svc = await self.engine.records.service_of(pid)
        handled = await self.acts.vote(svc, pid, env, act) if svc else None
        if handled is None or handled.record is None:
            raise ProposalUnknown(f"no proposal {pid}")

    async def _report(self, said: boundary.Evidence[ApplyReport]) -> None:
        """An asynchronous apply result: accepted only while the proposal awaits its apply
        (and, where the service's own reports can be told, only its own)."""
        report = said.value
        result = said.map(lambda r: apply_stage.recordable(ApplyResult(
            ok=r.ok, applied_id=r.applied_id, inverse=r.inverse, rollbackable=r.rollbackable,
            error=r.error, schema_class=r.schema_class)))
        handled, taken = await self.intake.report(report.service, report.proposal_id, result)
        if handled.record is None:
            raise ProposalUnknown(f"no proposal {report.proposal_id} for {report.service}")
        if not taken:
            raise wire.WireError("not_awaiting_apply", f"proposal {report.proposal_id} is "
                                 f"{handled.record.status} and not waiting for an apply",
                                 "proposal_id")

    async def observe(self, svc: str, sig: Signal) -> None:
        for proposal in await self.observer.observe(svc, sig):
            pid, _ = propose.identify(proposal)
            await enqueue(self.store.js, proposal.service, to_json(proposal), pid)
            log.info("observed a candidate", proposal_id=pid, stage="observe",
                     analyzer=proposal.analyzer.id)
