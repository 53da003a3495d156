"""The imperative shell around the stages: load a proposal's record, let a pure stage decide,
commit the decision as a trailer, cache the record, publish the retained records, and carry out
the one side effect (the ApplyOrder).

Every step is idempotent on the proposal id. The chain append is the commit point (see store);
when it conflicts — a redelivery, a restart after a crash, a second replica — the engine
re-reads the chain, rebuilds the record from it, and runs the step again, which then finds its
transition already made and does nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import msgspec
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NotFoundError

from improved.client.sdk import enqueue
from improved.core import apply as apply_stage
from improved.core import (
    audit,
    authority,
    boundary,
    breaker,
    evidence,
    identity,
    indexes,
    learnback,
    lkg,
    observe,
    planner,
    policy,
    propose,
    queue,
    quorum,
    replies,
    signing,
    triage,
)
from improved.core import checkpoint as checkpoints
from improved.core.audit import Draft
from improved.core.authority import Act
from improved.core.epochs import Seal
from improved.core.merkle import merkle_root
from improved.core.record import (
    CountedSignal,
    ProposalRecord,
    closed,
    fold,
    same_state,
    state_of,
)
from improved.core.signing import PAYLOAD_TYPES, ActRefused
from improved.protocol import subjects as S
from improved.protocol import wire
from improved.protocol.model import (
    ApplyOrder,
    ApplyOutcome,
    ApplyResult,
    CrisisAct,
    DedupHead,
    Envelope,
    Grant,
    GrantCommand,
    LedgerEntry,
    MeasureRequest,
    ObserverType,
    Proposal,
    Review,
    Signal,
    Trailer,
    Vote,
    to_json,
)
from improved.runtime import anchor as anchor_file
from improved.runtime import archive, checkpointing, indexing, tool_chains
from improved.runtime.answers import Answers
from improved.runtime.config import Config, Trust
from improved.runtime.metrics import Metrics
from improved.runtime.store import (
    ChainConflict,
    NeedsProvision,
    StateConflict,
    Store,
    decode_trailer,
    pause_after_conflict,
)

log = structlog.get_logger("improved.engine")

MAX_CONFLICT_RETRIES = 8
MAX_STEPS = 8  # planner steps in one pass; the next message or retry carries on
AUTONOMY_TTL_MS = 1000  # how stale this process's view of the breaker may be
CACHE_SIZE = 10_000  # records kept in memory per process (the KV bucket holds all of them)
WITNESS_TIMEOUT_S = 2.0  # how long a checkpoint waits for the runtime chains' heads
WITNESS_RETRY_MS = 3600 * 1000  # after a failed read of them, when to try again
# after a measurement's first attested answer, how long to listen for one that disagrees
CONFLICT_GRACE_S = 0.25


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class ChainBroken(ValueError):
    """A chain the daemon was about to decide on does not verify: a trailer no trusted daemon
    wrote, or authority no valid signed act backs. A crisis is open; nothing is decided on it."""


class GrantRevoked(Exception):
    """The grant an L3 auto-apply relies on was revoked before a retry of its order."""


class ServiceUnreachable(Exception):
    """The owning service did not answer the ApplyOrder; the proposal stays retryable.
    `maybe_delivered`: an attempt timed out, so the service may have received the order."""

    record: ProposalRecord | None = None

    def __init__(self, error: str, maybe_delivered: bool = True):
        super().__init__(error)
        self.maybe_delivered = maybe_delivered


P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
A = TypeVar("A")
B = TypeVar("B", bound=authority.SignedBody)
# Before each attempt of an order: (attempt, whether an earlier one may have been delivered);
# raises to stop the send (GrantRevoked).
Allowed = Callable[[int, bool], Awaitable[None]]
# An ingest step: (record or None) → (the record the draft extends, draft) or None when there
# is nothing to do. The record extended is the one given, but for a registration's new record.
Ingest = Callable[[ProposalRecord | None, int], tuple[ProposalRecord, Draft] | None]


def _onto(record: ProposalRecord, draft: Draft | None) -> tuple[ProposalRecord, Draft] | None:
    """A stage's draft (or nothing to do) as an ingest step on `record`."""
    return None if draft is None else (record, draft)


@dataclass
class Handled:
    record: ProposalRecord | None
    changed: bool
    counted: CountedSignal | None = None  # the signal a `signal` pass counted


RETRUST_WAIT_S = 30.0  # how long a reload waits for acts checked under the keys it replaces


def _acting(method: Callable[Concatenate[Engine, P], Awaitable[R]]
            ) -> Callable[Concatenate[Engine, P], Awaitable[R]]:
    """A method that checks a signed act and records it: run inside `Engine.acting`."""

    @functools.wraps(method)
    async def run(self: Engine, /, *args: P.args, **kw: P.kwargs) -> R:
        async with self.acting():
            return await method(self, *args, **kw)

    return run


def _principal(body: Any) -> str:
    """Whom a signed act speaks for, by default: its `principal` field."""
    return str(body.principal)


class Engine:
    def __init__(self, nc: Client, store: Store, config: Config, actor: str):
        self.nc = nc
        self.store = store
        # the daemon's requests to the services, every answer heard as evidence
        self.answers = Answers(nc, lambda: self.chain_trust.history.fallback.signers,
                               config.trust.subjects_bound)
        self.config = config
        self.records_ttl_s = int(config.records_ttl_days * 86400)  # 0: records kept for good
        self.policy = config.policy
        self.actor = actor
        self.trust = config.trust.store()
        self.voters = config.trust.voters()
        self.max_act_age_ms = int(config.trust.act_max_age_s * 1000)
        # who may have written a trailer and signed an act; `use_key` adds this daemon's key,
        # `record_trust` the trust history, each checkpoint what it vouches for
        self.chain_trust = evidence.ChainTrust(
            frozenset(config.trust.daemon_keyids()),
            evidence.History(fallback=evidence.KeySet(self.trust, self.voters,
                                                      config.trust.signer_store())))
        # signed acts and signals in flight, by the trust epoch they were checked in
        self._trust_epoch = 0
        self._acts: Counter[int] = Counter()
        self._cache: OrderedDict[str, tuple[ProposalRecord, int]] = OrderedDict()
        self._autonomy: tuple[breaker.Autonomy, int] | None = None
        self._autonomy_verified = True  # whether that state's trailer verified
        # the anchor of the last checkpoint this process signed, and the daemon keys whose
        # seals count: what the O(1) look at the audit stream before each decision compares
        # with (`_retention_problem`)
        self._retained: tuple[checkpoints.Anchor, set[str], int] | None = None
        self._recording_loss = False
        self.checkpoint_read = 0  # trailers the last checkpoint read: what was new, not the log
        self.metrics = Metrics()
        # observe's learn-back, once per committed trailer: (analyzer id, accepted, its hash)
        self.learn: Callable[[str, bool, str], Awaitable[None]] | None = None
        self.checkpointed_to = 0  # the stream sequence this process's last checkpoint covered
        self._witness_retry_at = 0  # when to try reading the runtime chains' heads again
        # the operator's queue as the review index counts it: recounted from the index by the
        # daemon (`set_queue_size`), moved by this replica's own passes in between
        self.queue_size = 0
        self._started: dict[str, float] = {}  # when handling of a proposal began
        # proposals whose retained records failed to publish after their chain moved
        self._unpublished: dict[str, str] = {}  # proposal id → service
        # proposal id → the record whose retained records this process last published
        self._shown: OrderedDict[str, ProposalRecord] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}
        self._waiters: dict[str, int] = {}
        # told the `valid_to` of every review index entry this process writes, so the daemon's
        # expiry sweep wakes when the earliest is due (`Daemon._expiries`)
        self.on_indexed: Callable[[int], None] | None = None
        # applied proposals awaiting their measurement: proposal id → (review_after, service);
        # only a wake-up call (the pass it makes decides from the chain), see `due_reviews`
        self.reviews: dict[str, tuple[int, str]] = {}
        # proposal id → the indexes the trailers of its pass in progress moved
        self._moved: dict[str, set[str]] = {}
        self._checkpointing = asyncio.Lock()  # one checkpoint at a time in this process
        # the members of each index as the last checkpoint this process signed counted them
        self.counted: indexing.Counted | None = None
        self._recount = False  # count them from the chains at the next checkpoint

    # -- per-proposal serialisation within this process -------------------------------------------

    def busy(self, pid: str) -> bool:
        """Whether a pass of this process is on `pid` now (it writes the indexes after)."""
        return pid in self._locks

    async def passes_done(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until every pass in progress now has ended, so that what
        their trailers moved is in the indexes too."""
        with suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(self._through(pid)
                                                    for pid in list(self._locks))), timeout_s)

    async def _through(self, pid: str) -> None:
        """Queue behind the passes on `pid` and let the next one go at once."""
        lock = self._locks.get(pid)
        if lock is None:
            return
        self._waiters[pid] += 1
        try:
            async with lock:
                pass
        finally:
            self._waiters[pid] -= 1
            if self._waiters[pid] == 0:
                del self._waiters[pid]
                del self._locks[pid]

    async def _acquire(self, pid: str) -> asyncio.Lock:
        lock = self._locks.setdefault(pid, asyncio.Lock())
        self._waiters[pid] = self._waiters.get(pid, 0) + 1
        await lock.acquire()
        return lock

    def _release(self, pid: str, lock: asyncio.Lock) -> None:
        lock.release()
        self._waiters[pid] -= 1
        if self._waiters[pid] == 0:
            del self._waiters[pid]
            del self._locks[pid]

    # -- entry points --------------------------------------------------------------------------------

    async def submit(self, proposal: Proposal, pid: str, dedup: str,
                     republish: bool = False, dispatch: bool = True,
                     fresh: bool = False, proposer: str | None = None,
                     envelope: Envelope | None = None) -> Handled:
        """Register a proposal (once) and carry it as far as its gate allows (short of the
        apply when `dispatch` is False: the inbound consumer then carries the apply). A
        signed one's `proposer` (`verified_proposer`) and `envelope` go on its registration;
        the first registration decides, so a later signed copy of registered content, or a
        later bare one, changes nothing."""

        def ingest(record: ProposalRecord | None, now: int) -> tuple[ProposalRecord, Draft] | None:
            if record is not None:
                return None
            return propose.register(proposal, pid, dedup, self.policy, now, proposer,
                                    envelope)

        svc = proposal.service
        claim: dict[str, DedupHead] = {}  # the head this registration found, when newer
        future = propose.future_dated(proposal, now_ms())  # claims nothing; triage rejects it
        # Newer content that still stands under the key supersedes this one: then nothing of
        # this one is sent (decided below, before anything else carries it on).
        seen: dict[str, DedupHead | None] = {}  # the head as `_standing_head` read it, if so
        standing = (None if future or not dispatch  # without dispatch nothing is sent anyway
                    else await self._standing_head(svc, dedup, pid, proposal, seen))
        dispatch_now = dispatch and standing is None

        async def prepare() -> triage.Rejection | None:
            """Under the proposal's lock, by whoever registers it: claim the dedup_key (a crash
            before the registration leaves the message unacknowledged, so it is claimed again
            on redelivery) and read the rejection ledger, both at once. The ledger is read
            whatever the key held: a head leaves the bucket once its proposal has been closed
            for `records_ttl_days` (`propose.head_may_expire`), a ledger entry never does. An
            entry only names the rejected proposal: its chain says whether an operator
            rejected it (`_rejection`)."""
            if future:
                return None
            # a key just read as absent is most likely still absent: create without a read
            head, rejected = await asyncio.gather(
                self.store.set_dedup_head(svc, dedup, pid, proposal.created_at,
                                          absent=seen.get("head", 0) is None),
                self.store.ledger_get(svc, dedup))
            if head is not None and head.proposal_id != pid:
                claim["head"] = head
            return await self._rejection(svc, dedup, pid, rejected)

        # A first delivery not in this process's cache is taken for new without a read: if
        # the chain exists after all, the append conflicts and the record is rebuilt.
        handled = await self.handle(svc, pid, ingest, proposal, republish, dispatch_now,
                                    fresh, optimistic=not (fresh or republish), prepare=prepare)
        head = claim.get("head")
        other = await self._truth(svc, head.proposal_id) if head is not None else None
        if other is not None and propose.older_under_key(other, proposal, pid, dedup):
            await self.supersede(svc, other.proposal_id, pid)
        elif other is not None and propose.stands_over(other, proposal, pid, dedup):
            # this content arrived after newer content under the same key that still stands
            return await self.supersede(svc, pid, other.proposal_id)
        if dispatch and not dispatch_now:  # held back for nothing: carry it on now
            handled = await self.advance(svc, pid)
        return handled

    async def _rejection(self, svc: str, dedup: str, pid: str,
                         entry: LedgerEntry | None) -> triage.Rejection | None:
        """The operator's rejection a rejection-ledger entry points to, as the rejected
        proposal's verified chain records it under this dedup_key, or None: a bucket any bus
        participant may write never rejects anything itself. A chain gone (archived) or not
        verifying rejects nothing; the proposal then meets an operator again."""
        named = entry.proposal_id if entry is not None else None
        if named is None or not S.ID_RE.match(named) or named == pid:
            return None
        try:
            found = triage.rejection_of(await self._truth(svc, named))
        except ChainBroken:
            return None
        return found if found is not None and found.dedup_key == dedup else None

    async def _standing_head(self, svc: str, dedup: str, pid: str,
                             proposal: Proposal, seen: dict[str, DedupHead | None]
                             ) -> str | None:
        """The newer content under `dedup` that still supersedes `proposal`, if any, as the
        chain of the proposal the bucket names says (`propose.stands_over`); the head read is
        left in `seen["head"]`."""
        head = seen["head"] = await self.store.dedup_head(svc, dedup)
        if head is None or head.proposal_id == pid:
            return None
        other = await self._truth(svc, head.proposal_id)
        return other.proposal_id if other is not None and propose.stands_over(
            other, proposal, pid, dedup) else None

    async def supersede(self, svc: str, old: str, new: str) -> Handled:
        """Mark `old` superseded by `new` (same dedup_key, new content)."""
        return await self.handle(
            svc, old, lambda record, now: _onto(record, propose.supersede(record, new, self.actor))
            if record is not None else None, None, False)

    def verified_proposer(self, proposal: Proposal, env: Envelope | None) -> str | None:
        """Who verifiably proposed `proposal` (the payload of `env`): None when it came
        unsigned; the identity of the `[trust.signers]` key that signed it, an agent of its
        service or the service itself; WireError when it does not verify (nothing changes)."""
        if env is None:
            return None
        signers = self.chain_trust.history.fallback.signers
        return propose.verify_signed(signers, env, proposal).principal

    def emitter_of(self, svc: str, signal: Signal, env: Envelope | None
                   ) -> tuple[str, Envelope | None]:
        """Who verifiably sent a signal that arrived on `svc`'s subject (core/identity.py):
        the principal of the trusted key that signed it (then the envelope, for the trailer);
        else, where services are bound to their subjects, `service:<svc>`; else unverified."""
        if env is not None:
            try:
                verified, _ = authority.check_signed(
                    self.chain_trust.history.fallback.emitters(), env, PAYLOAD_TYPES["signal"],
                    Signal, now_ms(), self.max_act_age_ms, lambda s: s.actor)
                return verified.principal, env
            except ActRefused as refused:
                log.warning("signed signal not verified: counted as unverified evidence",
                            code=refused.code, reason=refused.reason)
        if self.config.trust.subjects_bound:
            return identity.of_subject(svc), None
        return identity.UNVERIFIED, None

    async def signal(self, svc: str, signal: Signal, republish: bool = False,
                     fresh: bool = False, dispatch: bool = True,
                     emitter: str = identity.UNVERIFIED,
                     envelope: Envelope | None = None) -> Handled:
        """Count a learn-back signal for its proposal, then re-triage if it now may proceed.
        `emitter`: who verifiably sent it (`emitter_of`)."""
        box: dict[str, CountedSignal] = {}

        def ingest(record: ProposalRecord | None, now: int) -> tuple[ProposalRecord, Draft] | None:
            if record is None:
                return None
            step = learnback.observe_signal(record, signal, self.policy, now, emitter, envelope)
            if step is None:
                digest = propose.signal_digest(signal)
                box["counted"] = next(s for s in record.signals if s.digest == digest)
                return None
            draft, counted = step
            box["counted"] = counted
            return record, draft

        handled = await self.handle(svc, signal.proposal_id or "", ingest, None, republish,
                                    dispatch=dispatch, fresh=fresh)
        handled.counted = box.get("counted")
        return handled

    async def report(self, svc: str, pid: str,
                     result: boundary.Evidence[ApplyResult]) -> tuple[Handled, bool]:
        """An asynchronous ApplyReport; (handled, whether it was taken as the apply result).
        Where the service's own reports can be told (`Answers.attestable`), one that is not
        its own is refused: WireError `not_attested`, nothing changes."""
        if isinstance(result, boundary.Unattested) and self.answers.attestable(svc):
            raise wire.WireError(wire.NOT_ATTESTED, f"an ApplyReport for {svc} counts only when it "
                            f"is the service's own ({result.why}): sign it with the key "
                            f"[trust.signers] binds to service:{svc}", "proposal_id")
        taken = False

        def ingest(record: ProposalRecord | None, now: int) -> tuple[ProposalRecord, Draft] | None:
            nonlocal taken
            if record is None or not apply_stage.needs_apply(record):
                return None
            taken = True
            return record, apply_stage.transition(record, result,
                                                  apply_stage.authority(record, self.policy))

        handled = await self.handle(svc, pid, ingest, None, False)
        return handled, taken

    @_acting
    async def review(self, svc: str, pid: str, env: Envelope | None, act: Act) -> Handled:
        """An operator's signed review; unsigned (`env` None), bad or replayed ones are refused
        on the proposal's chain and move nothing."""
        record = await self._truth(svc, pid)
        if record is None:
            return Handled(None, False)
        superseded = await self._standing_head(svc, record.dedup_key, pid, record.proposal,
                                               {}) is not None

        ingest = self._signed_act(
            act, env, self.trust, "review", Review,
            lambda record, verified, rv, now: authority.review(
                record, act, verified, rv, superseded, self.actor, now))

        async def ledger(rec: ProposalRecord) -> None:
            """An operator's rejection enters the ledger before anyone can see it."""
            d = rec.decision
            if d is not None and d.verdict == "reject" and d.cause is None:
                await self.store.ledger_put(svc, rec.dedup_key, LedgerEntry(
                    proposal_id=pid, principal=d.actor, reason=d.rationale, at=d.at,
                    evidence=triage.evidence_digest(rec.proposal)))

        return await self.handle(svc, pid, ingest, None, False, on_change=ledger)

    @_acting
    async def vote(self, svc: str, pid: str, env: Envelope, act: Act) -> Handled:
        """A signed quorum vote (SPEC 09 §6): counted on the proposal's chain or refused there
        with its reason; the quorum's decision follows in the same pass."""

        def count(record: ProposalRecord, verified: signing.Verified, vote: Vote,
                  now: int) -> Draft:
            sig = next(s.sig for s in env.signatures if s.keyid == verified.keyid)
            return quorum.count(record, act, verified, vote, sig, self.actor)

        ingest = self._signed_act(act, env, self.voters, "vote", Vote, count,
                                  principal_of=lambda v: v.voter)
        return await self.handle(svc, pid, ingest, None, False)

    def _signed_act(self, act: Act, env: Envelope | None, trust: signing.TrustStore, kind: str,
                    decode_as: type[B],
                    step: Callable[[ProposalRecord, signing.Verified, B, int], Draft],
                    principal_of: Callable[[B], str] | None = None) -> Ingest:
        """The ingest of a signed act on a proposal's chain: a redelivery changes nothing; a
        replay, a bare (unsigned) act or one that does not verify is refused there with its
        reason; a verified one goes to `step(record, verified, body, now)`."""

        def ingest(record: ProposalRecord | None, now: int) -> tuple[ProposalRecord, Draft] | None:
            if record is None:
                return None
            seen = authority.seen(record, act)
            if seen == "redelivery":
                return None
            try:
                if seen == "replay":
                    raise ActRefused("replayed", "this signed act was already used")
                if env is None:
                    raise ActRefused("unsigned", f"a {kind} must be a signed DSSE envelope")
                verified, body = authority.check_signed(
                    trust, env, PAYLOAD_TYPES[kind], decode_as, now, self.max_act_age_ms,
                    principal_of or _principal)
            except ActRefused as refused:
                skip = authority.unrecorded(record, act, False)
                if skip is not None:
                    log.warning("signed act refused, not recorded", proposal_id=record.proposal_id,
                                code=refused.code, why=skip)
                    return None
                return record, authority.refusal(record, act, refused.code, refused.reason,
                                                 self.actor)
            return record, step(record, verified, body, now)

        return ingest

    @_acting
    async def grant(self, env: Envelope, skill: str, act: Act) -> Grant | None:
        """A signed grant or revoke for `<name>:<sha256>`: chained per hash, then retained. A
        grant counts only for the definition of the L2 proposal it names, read from that
        proposal's verified chain once the grant's own signature verified (an unsigned act
        costs no read) and counted only when that proposal was approved and applied."""
        sha = skill.split(":", 1)[1]
        subject = S.grant_audit(sha)
        verified = cmd = refused = None
        try:
            verified, cmd = authority.check_signed(self.trust, env, PAYLOAD_TYPES["grant"],
                                                   GrantCommand, now_ms(), self.max_act_age_ms)
        except ActRefused as exc:
            refused = exc
        if cmd is not None:
            l2 = None
            if cmd.op == "grant" and cmd.proposal_id is not None and \
                    (owner := await self.store.service_of(cmd.proposal_id)) is not None:
                l2 = await self.rebuild(owner, cmd.proposal_id)
            refused = authority.tofu_problem(cmd, l2)
        read: list[list[tuple[int, dict[str, Any]]]] = []

        def next_draft(chain: list[tuple[int, dict[str, Any]]], now: int) -> Draft | None:
            read.append(chain)
            acts = authority.chain_acts([decode_trailer(body) for _, body in chain])
            return authority.grant_act(acts, act, verified, cmd, refused, self.actor)

        appended = await self.store.append_sealed(subject, sha, "L3", "knowledge", next_draft,
                                                  whole=True, clock=now_ms)
        trailers = [decode_trailer(body) for _, body in read[-1]]
        if appended is not None:
            log.info("grant act", skill=skill, verdict=appended.verdict, reason=appended.reason)
            trailers.append(appended)
        state = authority.grant_state(trailers)
        if state is not None:
            await self.store.publish(S.grant_record(*state.skill.split(":", 1)), state)
        return state

    async def advance(self, svc: str, pid: str, republish: bool = False) -> Handled:
        """No new input: carry the proposal on (triage request, apply retry)."""
        return await self.handle(svc, pid, lambda record, now: None, None, republish,
                                 fresh=True)

    async def handle(self, svc: str, pid: str, ingest: Ingest, proposal: Proposal | None,
                     republish: bool, dispatch: bool = True, fresh: bool = False,
                     optimistic: bool = False,
                     prepare: Callable[[], Awaitable[triage.Rejection | None]] | None = None,
                     on_change: Callable[[ProposalRecord], Awaitable[None]] | None = None,
                     ) -> Handled:
        """Load, ingest, advance, then cache and publish once. `fresh` skips this process's
        cache (a request's reply should see what other replicas did)."""
        lock = await self._acquire(pid)
        self._started[pid] = time.perf_counter()
        try:
            for attempt in range(MAX_CONFLICT_RETRIES):
                if attempt:
                    await pause_after_conflict(attempt - 1)
                try:
                    if optimistic and pid not in self._cache:
                        record, rev = None, 0
                    else:
                        record, rev = await self._load(svc, pid, fresh)
                        if record is None and proposal is None:
                            # not a registration: the cache may just be empty (a broker
                            # restart wipes it); the chain is the truth
                            if await self.resync(svc, pid, None) is not None:
                                record, rev = await self._load(svc, pid, True)
                    before = record
                    rejected = await prepare() if record is None and prepare else None
                    now = now_ms()
                    step = ingest(record, now)
                    if step is not None:
                        record = await self._commit(before, *step, now)
                    if record is None:
                        return Handled(None, False)
                    try:
                        record = await self._advance(record, dispatch, rejected)
                    except ServiceUnreachable as exc:
                        # What was decided stands and is published; the apply waits.
                        await self._settle(exc.record or record, rev, before, republish)
                        raise
                    changed = record != before
                    if changed and on_change is not None:
                        await on_change(record)
                    await self._settle(record, rev, before, republish)
                    return Handled(record, changed)
                except ChainConflict:
                    log.info("chain moved, rebuilding from it", proposal_id=pid)
                    self._cache.pop(pid, None)
                    await self.resync(svc, pid, proposal)
                    republish = True
                    fresh = True
                    optimistic = False
            raise RuntimeError(f"proposal {pid}: still conflicting after "
                               f"{MAX_CONFLICT_RETRIES} attempts")
        finally:
            self._started.pop(pid, None)
            self._moved.pop(pid, None)
            self._release(pid, lock)

    async def _load(self, svc: str, pid: str, fresh: bool) -> tuple[ProposalRecord | None, int]:
        """The record to decide on: what this process committed itself (its memory), else
        what the chain says. The state bucket is an output anyone on the bus could rewrite:
        it is read for its revision only, and put back when it disagrees with the chain."""
        if not fresh and self._held(svc, pid):
            self._cache.move_to_end(pid)
            return self._cache[pid]
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
        self._remember(record, rev)
        return record, rev

    async def service_of(self, pid: str) -> str | None:
        """The service whose chain holds `pid`: known here when this process holds its record
        (it committed to that chain), else looked up on the audit stream."""
        held = self._cache.get(pid)
        if held is not None:
            return held[0].service
        return await self.store.service_of(pid)

    async def _truth(self, svc: str, pid: str) -> ProposalRecord | None:
        """A proposal's record as this process committed it or as its chain says; never the
        state bucket's word."""
        if self._held(svc, pid):
            return self._cache[pid][0]
        return await self.rebuild(svc, pid)

    def _held(self, svc: str, pid: str) -> bool:
        """Whether this process holds `pid`'s record as a proposal of `svc`: a message on
        another service's subject naming it finds nothing here, as it finds no chain of
        that service's, whatever this process happens to remember."""
        held = self._cache.get(pid)
        return held is not None and held[0].service == svc

    def _remember(self, record: ProposalRecord, rev: int) -> None:
        self._cache[record.proposal_id] = (record, rev)
        self._cache.move_to_end(record.proposal_id)
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)

    async def _settle(self, record: ProposalRecord, rev: int, before: ProposalRecord | None,
                      republish: bool) -> None:
        """After the chain moved: cache the record once and publish the retained records, both
        at the same time (the cache is rebuildable, so a lost save only costs a rebuild), the
        review index entry when the operator's queue changed (`queue.change`: never for an L0
        proposal), and the measurement index entry when a measurement fell due or was made
        (`learnback.due_change`: never for a proposal without review_after). Of the retained
        records, only those that differ from what this process last published for the
        proposal (`_shown`) are sent again; with nothing shown here (another process's work, a
        restart) all of them are."""
        pid = record.proposal_id
        self.expect_review(record)
        republish = republish or pid in self._unpublished
        jobs = []
        if record != before:
            jobs.append(self._save(record, rev))
        if record != before or republish:
            jobs.append(self.publish(record, since=None if republish else self._shown.get(pid)))
        touched = self._moved.pop(pid, set())
        write = queue.change(before, record, republish, moved="review" in touched)
        if write is not None:
            jobs.append(self.store.index(record.service, pid, write.entry))
            if write.entry is not None and write.entry.valid_to is not None \
                    and self.on_indexed is not None:
                self.on_indexed(write.entry.valid_to)
        due = learnback.due_change(before, record, republish, moved="due" in touched)
        if due is not None:
            jobs.append(self.store.mark_due(record.service, pid, due.entry))
        if self.records_ttl_s and self.store.dedup_ttl and closed(record) and (
                republish or before is None or not closed(before)):
            jobs.append(self._expire_head(record))
        try:
            await asyncio.gather(*jobs)
        except Exception:
            # the chain moved but what watchers read did not: whoever handles this proposal
            # next, or the next reconnect (`republish_unpublished`), publishes it again
            self._unpublished[pid] = record.service
            self._shown.pop(pid, None)
            raise
        self._unpublished.pop(pid, None)
        if record != before or republish:
            self._shown[pid] = record
            self._shown.move_to_end(pid)
            while len(self._shown) > CACHE_SIZE:
                self._shown.popitem(last=False)
        moved = queue.queued(record) - queue.queued(before)
        if moved:
            self.set_queue_size(self.queue_size + moved)

    async def _expire_head(self, record: ProposalRecord) -> None:
        """At the close of `record` (or a republish of it closed), give its dedup head the TTL
        its retained records carry, if the head still names it (`propose.head_may_expire`;
        `Store.expire_dedup_head` writes it compare-and-set). Nothing is lost when this fails:
        the head stays as it was, kept for good as before; logged, never raised, so the records
        published beside it are not marked unpublished for it."""
        try:
            await self.store.expire_dedup_head(
                record.service, record.dedup_key, self.records_ttl_s,
                lambda head: propose.head_may_expire(record, head))
        except Exception as exc:
            log.info("dedup head kept without a TTL", proposal_id=record.proposal_id,
                     error=f"{type(exc).__name__}: {exc}")

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
        for pid, svc in list(self._unpublished.items()):
            try:
                await self.advance(svc, pid, republish=True)
            except Exception as exc:  # still unreachable: the next reconnect tries again
                log.info("records not republished yet", proposal_id=pid,
                         error=f"{type(exc).__name__}: {exc}")
                continue
            done += 1
        return done

    async def _save(self, record: ProposalRecord, rev: int) -> None:
        try:
            self._remember(record, await self.store.save(record, rev))
        except StateConflict:
            self._cache.pop(record.proposal_id, None)  # someone newer saved; re-read next time

    # -- the steps -----------------------------------------------------------------------------------

    async def _commit(self, before: ProposalRecord | None, record: ProposalRecord,
                      draft: Draft, at: int) -> ProposalRecord:
        """Seal `draft` at `at` (the instant the stage decided) onto `record` and append it:
        the commit; the record after it is the fold of the trailer (`record.fold`), as a
        rebuild makes it. `before` is the record at the chain's end (None: the chain begins,
        and `record` is the registration's new record); the trailer says which indexes it
        moves (`indexes.with_moves`)."""
        draft = indexes.with_moves(before, record, draft, at)
        trailer = audit.seal(draft, record, at)
        seq = await self.store.append(record, trailer)
        record = fold(record, trailer, seq)
        moved = indexes.moves(draft.refs)
        if moved:  # what this pass moved, for `_settle`'s index writes
            self._moved.setdefault(record.proposal_id, set()).update(moved)
        log.info("transition", proposal_id=record.proposal_id, stage=trailer.to_stage,
                 **{"class": record.gate_class}, verdict=trailer.verdict, cause=trailer.cause,
                 seq=trailer.seq)
        self.metrics.transition(trailer.to_stage, trailer.verdict, trailer.cause,
                                record.gate_class)
        started = self._started.get(record.proposal_id)
        if started is not None:  # from the message's arrival to this transition
            self.metrics.observe_stage(trailer.to_stage, time.perf_counter() - started)
        if trailer.to_stage == "apply" and trailer.verdict in ("applied", "failed",
                                                               "rolled_back"):
            self.metrics.apply_result("ok" if trailer.verdict == "applied"
                                      else trailer.verdict)
        if self.learn is not None and (accepted := observe.lesson(trailer)) is not None:
            await self.learn(record.proposal.analyzer.id, accepted, trailer.hash)
        return record

    async def _advance(self, record: ProposalRecord, dispatch: bool,
                       rejected: triage.Rejection | None = None) -> ProposalRecord:
        """Carry the proposal on, one planner step at a time, until the planner has nothing
        more to do now. Each step is one effect; the decision is the planner's."""
        grant: planner.GrantRead = planner.UNREAD  # an L3's grant, read by this very pass
        at_intent: tuple[int, bool] | None = None  # that grant as of the intent's sequence
        intended = False  # this pass recorded the order's dispatch
        for _ in range(MAX_STEPS):
            now = now_ms()
            view = planner.View(now=now, autonomy=await self.autonomy(now), dispatch=dispatch,
                                rejected=rejected, grant=grant, grant_at_intent=at_intent)
            step = planner.next_step(record, view, self.policy, self.actor)
            while isinstance(step, planner.ReadGrant | planner.ConfirmGrant
                             | planner.ReadOriginal):
                view = planner.with_read(view, step, await self._read(record, step, now))
                grant, at_intent = view.grant, view.grant_at_intent
                step = planner.next_step(record, view, self.policy, self.actor)
            try:
                match step:
                    case planner.Commit(draft=draft, why=why):
                        if why == "revoked" and record.in_flight:
                            log.warning("dispatch withdrawn: the grant was not active as of "
                                        "it; no order is sent", proposal_id=record.proposal_id,
                                        skill=record.skill, intent_seq=record.dispatched_seq)
                        record = await self._commit(record, record, draft, now)
                        intended = intended or why == "dispatched"
                    case planner.SendRollback():
                        record = await self._rollback(record, step)
                    case planner.CheckLkg():
                        draft = await self._lkg_check(record)
                        record = await self._commit(record, record, draft, now_ms())
                    case planner.SendApply():
                        record = await self._apply(record, step, intended)
                    case planner.AskMeasure(request=request):
                        reading = await self._measure(record, request)
                        at = now_ms()
                        measure = planner.after_measure(record, reading, self.policy,
                                                        self.actor)
                        if measure.rollback is not None:
                            await self.propose_rollback(record, measure.rollback)
                        record = await self._commit(record, record, measure.commit.draft, at)
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
            return await self.store.grant_active(step.skill, now, self.chain_trust)
        if isinstance(step, planner.ConfirmGrant):
            return await self.store.grant_active_as_of(step.skill, step.as_of_seq, step.at,
                                                       self.chain_trust)
        return await self._original(record.service, step.proposal_id)

    async def _rollback(self, record: ProposalRecord,
                        step: planner.SendRollback) -> ProposalRecord:
        """An operator's rollback: the recorded inverse goes to the owning service."""
        result = await self._send(record, step.order)
        at = now_ms()
        record = await self._commit(
            record, record, apply_stage.rollback_transition(record, step.inverse_id, result), at)
        if result.value.ok and record.approved_by is None:
            await self.count_autonomous_rollback(record, at)
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
                                                          self.chain_trust):
                raise GrantRevoked(record.skill)

        try:
            result = await self._send(record, step.order, allowed)
        except GrantRevoked:
            at = now_ms()
            commit = planner.revoked(record, self.policy, at, self.actor)
            return await self._commit(record, record, commit.draft, at)
        except ServiceUnreachable as exc:
            at = now_ms()
            void = planner.unreachable(record, intended, exc.maybe_delivered, str(exc),
                                       self.actor)
            if void is not None:
                exc.record = await self._commit(record, record, void.draft, at)
            raise
        at = now_ms()
        return await self._commit(
            record, record, apply_stage.transition(record, result, step.authority), at)

    async def _original(self, svc: str, pid: str) -> ProposalRecord | None:
        """The record of the proposal a reversal reverts, as its chain says."""
        return await self._truth(svc, pid)

    async def _lkg_check(self, record: ProposalRecord) -> Draft:
        """SPEC 09 §7.1: ask the owning service for a healthy last-known-good of every
        artefact; the planner turns the answer into the transition."""
        body = to_json(lkg.check_request(record))
        report: boundary.Evidence[lkg.LkgReport] = await self._ask(
            record, S.lkg_request(record.service), lambda _: body, replies.parse_lkg_reply,
            self._counting(record.service, lkg.LkgReport))
        commit = planner.after_lkg(record, report, self.policy, self.actor,
                                   self.config.max_message_bytes, now_ms())
        if commit.why == "lkg_refused":
            log.warning("L4 refused before apply", proposal_id=record.proposal_id,
                        reason=commit.draft.reason)
        return commit.draft

    async def _measure(self, record: ProposalRecord,
                       request: MeasureRequest) -> boundary.Answer[learnback.Reading]:
        """Learn-back at review_after: ask the owning service for the metric (timeout, bounded
        retries while nothing answers). Any answer is final — a value, or an error reply or a
        malformed one as the cause; all attempts unanswered: that, as the cause. What counts
        is `boundary.choose`'s: attested answers, or a Conflict when they disagree."""
        body = to_json(request)

        def chosen(heard: list[boundary.Evidence[learnback.Reading]]
                   ) -> boundary.Answer[learnback.Reading] | None:
            return boundary.choose(heard)

        try:
            return await self._ask(record, S.measure_request(record.service), lambda _: body,
                                   replies.parse_measure_reply, chosen, grace=CONFLICT_GRACE_S)
        except ServiceUnreachable as exc:
            return boundary.Unattested(learnback.Reading(cause=str(exc)), "no answer")

    def _counting(self, service: str, of: type[T]
                  ) -> Callable[[list[boundary.Evidence[T]]], boundary.Evidence[T] | None]:
        """What an apply or LKG check takes of the answers heard (`boundary.counting`)."""
        attestable = self.answers.attestable(service)
        return lambda heard: boundary.counting(heard, attestable)

    async def _send(self, record: ProposalRecord, order: ApplyOrder,
                    allowed: Allowed | None = None) -> boundary.Evidence[ApplyResult]:
        """One order to the owning service: timeout, bounded retries, then ServiceUnreachable."""
        return await self._ask(
            record, S.apply_request(record.service),
            lambda attempt: to_json(msgspec.structs.replace(order, attempt=attempt)),
            replies.parse_apply_reply, self._counting(record.service, ApplyResult), allowed)

    async def _ask(self, record: ProposalRecord, subject: str, body: Callable[[int], bytes],
                   parse: Callable[[bytes], T | None],
                   pick: Callable[[list[boundary.Evidence[T]]], A | None],
                   allowed: Allowed | None = None, grace: float = 0.0) -> A:
        """A request to the owning service with a timeout and bounded retries. Every answer
        heard is evidence (`Answers.ask`); `parse` turns each into a result, or None for an
        error reply ("not now"), and `pick` says which counts, or None (only "not now", or
        nothing attributable where something could be): retried. All attempts so:
        ServiceUnreachable (the proposal stays retryable)."""
        settings = self.config.apply
        last_error = "no attempt"
        maybe_delivered = False
        for attempt in range(1, settings.attempts + 1):
            if allowed is not None:
                await allowed(attempt, maybe_delivered)
            try:
                heard = await self.answers.ask(record.service, subject, body(attempt),
                                               settings.timeout_s, grace)
            except NoRespondersError:
                last_error = f"no service answers {subject}"
            except NatsTimeout:
                last_error = f"{subject} timed out"
                maybe_delivered = True
            else:
                parsed = [e.map(parse) for e in heard]
                picked = pick(boundary.present(parsed))
                if picked is not None:
                    return picked
                last_error, silent = replies.unanswered(subject, heard, parsed)
                maybe_delivered = maybe_delivered or silent
            log.warning("request to the owning service failed", proposal_id=record.proposal_id,
                        subject=subject, attempt=attempt, error=last_error)
            await asyncio.sleep(min(0.1 * 2 ** attempt, 2.0))
        raise ServiceUnreachable(last_error, maybe_delivered)

    # -- learn-back rollbacks ------------------------------------------------------------------------

    async def propose_rollback(self, record: ProposalRecord, proposal: Proposal) -> str:
        """Propose the recorded inverse of a regressed change, through the bus like any
        proposal (durable, deduplicated by its id, and gated by its class)."""
        pid, _ = propose.identify(proposal)
        await enqueue(self.store.js, proposal.service, to_json(proposal), pid)
        log.warning("regression: rollback proposed", proposal_id=record.proposal_id,
                    rollback=pid, stage="learn-back")
        return pid

    async def rolled_back(self, svc: str, original: str, inverse: ProposalRecord) -> None:
        handled = await self.handle(
            svc, original, lambda record, now: _onto(record, apply_stage.rolled_back_by(
                record, inverse)) if record is not None else None, None, False)
        if handled.changed and handled.record is not None and \
                apply_stage.counts_toward_breaker(handled.record, inverse):
            await self.count_autonomous_rollback(handled.record, now_ms())

    # -- the breaker and the autonomy switch (constitution IV.5, IV.6) ---------------------------

    async def autonomy(self, now: int) -> breaker.Autonomy:
        """The autonomy chain's current state, read at most once a second, as every pass reads
        it before it decides. A head no trusted daemon wrote (or a resolution no operator
        signed) is not believed: it reads as a crisis, which the next checkpoint records. So
        does an audit stream that forgot what the last checkpoint covered or that no longer
        keeps every trailer (`_retention_problem`, O(1)): the crisis is recorded at once."""
        if self._autonomy is None or now - self._autonomy[1] > AUTONOMY_TTL_MS:
            seq, body = await self.store.chain_head(S.autonomy_audit(breaker.AUTONOMY_ID))
            problem = self.chain_trust.problem(body, breaker.AUTONOMY_ID, seq,
                                               self.chain_trust.start()) if body else None
            if problem:
                log.error("the autonomy chain's head does not verify; applies refused",
                          stream_seq=seq, problem=problem)
            state = breaker.believed(body, seq, problem)
            lost = await self._retention_problem()
            if lost is not None:
                state = breaker.in_crisis(state, state.crisis or f"crisis-{now_ms()}")
            self._autonomy = (state, now_ms())  # when it was read, whatever `now` asked for
            self._autonomy_verified = not problem and lost is None
            self.metrics.set_autonomy(self._autonomy[0].blocks(now) or "on")
            if lost is not None and not self._recording_loss:
                self._recording_loss = True
                try:
                    await self.chain_broken(lost)
                finally:
                    self._recording_loss = False
        return self._autonomy[0]

    async def _retention_problem(self) -> str | None:
        """In O(1), whether the audit stream still holds everything the last checkpoint this
        process signed covered, and keeps every trailer from now on (no limit, no deletes):
        a decision relies on the log not forgetting — a chain that is gone reads as a proposal
        never seen, an autonomy chain that is gone as no crisis — and on an open bus anyone may
        set a limit and take it back between two checkpoints. None when it holds, or before
        this process's first checkpoint."""
        if self._retained is None:
            return None
        kept, trusted, removable = self._retained
        view, changed = await self.store.audit_retention()
        if changed:
            return (f"the audit stream no longer keeps every trailer: its {', '.join(changed)} "
                    "differ from the loop's")
        found = checkpoints.prefix_problem(kept, view, kept.last_hash, removable=removable)
        if found is not None:  # an epoch sealed and removed since allows what it removed
            seal, _ = await archive.last_seal(self.store, trusted)
            found = checkpoints.prefix_problem(kept, view, kept.last_hash,
                                               removable=seal.removable if seal else 0)
        return found

    async def _append_autonomy(self, change: Callable[[breaker.Autonomy], breaker.Autonomy],
                               verdict: breaker.AutonomyVerdict, actor: str,
                               observer: ObserverType,
                               reason: str, marks: breaker.Marks | None = None,
                               envelope: Envelope | None = None) -> breaker.Autonomy:
        """Append the next state (`change(state)`) to the autonomy chain, retrying on a race."""
        states: list[breaker.Autonomy] = []

        def next_draft(chain: list[tuple[int, dict[str, Any]]], now: int) -> Draft:
            states.append(change(breaker.from_trailer(chain[-1][1] if chain else None)))
            return breaker.draft(states[-1], verdict, actor, observer, reason, marks, envelope)

        trailer = await self.store.append_sealed(
            S.autonomy_audit(breaker.AUTONOMY_ID), breaker.AUTONOMY_ID, "L0", "operation",
            next_draft, clock=now_ms)
        assert trailer is not None  # next_draft always has a draft
        self._autonomy = (states[-1], trailer.at)
        return states[-1]

    async def count_autonomous_rollback(self, record: ProposalRecord, at: int) -> None:
        p = self.policy
        state = await self._append_autonomy(
            lambda s: breaker.after_rollback(s, at, p.breaker_threshold, p.breaker_window_days,
                                             p.breaker_pause_hours),
            "rollback", record.rollback_by or self.actor, "rec:system",
            f"autonomous apply {record.proposal_id} rolled back",
            breaker.Marks(proposal=record.proposal_id))
        if state.blocks(at) == "circuit_open":
            log.warning("circuit breaker open: autonomous applies paused",
                        until=state.paused_until, rollbacks=len(state.rollbacks))

    async def sync_switch(self) -> breaker.Autonomy:
        """Record the configured autonomy switch on the chain when it differs from it."""
        current = await self.autonomy(now_ms() + AUTONOMY_TTL_MS + 1)
        wanted = self.policy.autonomy
        if current.switch == wanted:
            return current
        log.warning("autonomy switched by configuration", autonomy=wanted)
        return await self._append_autonomy(
            lambda s: breaker.switched(s, wanted),
            "autonomy_on" if wanted == "on" else "autonomy_off", self.actor,
            "rec:system", f"autonomy switched {wanted} in the configuration")

    # -- the policy in force (DESIGN §9: invariants are floors) ------------------------------------

    async def amendment_problem(self) -> str | None:
        """With `quorum` on: why the named constitution edit does not permit it, judged on the
        record replayed from its verified chain (never the state cache); else None."""
        pid = self.policy.quorum_amendment
        if not self.policy.quorum or pid is None:
            return None
        svc = await self.store.service_of(pid)
        chain = await self.store.read_chain(svc, pid) if svc else []
        record = None
        if chain:
            broken = audit.verify_chain(pid, [body for _, body in chain], self.chain_trust,
                                        [seq for seq, _ in chain])
            if broken is not None:
                return f"the chain of {pid} does not verify: {broken}"
            try:
                record = propose.rebuild_record([decode_trailer(b) for _, b in chain],
                                                [seq for seq, _ in chain], self.policy)
            except (ValueError, KeyError, msgspec.MsgspecError) as exc:
                return f"the chain of {pid} cannot be replayed: {exc}"
            if record.service != svc:
                return f"the chain of {pid} is filed under {svc}, not {record.service}"
        return policy.amendment_problem(pid, record)

    async def record_policy(self) -> Trailer | None:
        """Append the effective policy to the `_policy` chain when its digest differs from the
        last one recorded; the appended trailer, or None when it was already in force."""
        digest = policy.digest(self.policy)

        def next_draft(chain: list[tuple[int, dict[str, Any]]], now: int) -> Draft | None:
            if policy.recorded_digest(chain[-1][1] if chain else None) == digest:
                return None
            return policy.draft(self.policy, self.actor)

        trailer = await self.store.append_sealed(
            S.policy_audit(policy.POLICY_ID), policy.POLICY_ID, "L0", "operation", next_draft,
            clock=now_ms)
        if trailer is not None:
            log.warning("policy changed: recorded on the policy chain", digest=digest,
                        differs=sorted(policy.differences(self.policy)))
        return trailer

    # -- checkpoints and crisis (constitution V.4) -------------------------------------------------

    async def checkpoint(self, key: Ed25519PrivateKey,
                         count_limit: int | None = None) -> str | None:
        """Verify what the log gained since the last checkpoint — every new trailer in its
        chain, every checkpoint met on the way, and in O(1) that the stream still holds what
        the last one (on the stream or kept in the data directory) covered — then sign a new
        checkpoint that carries its Merkle frontier on, and the members of each index
        (`core.indexes`: the last one's counts and the index refs of what is new), and keep it
        in the data directory too (`runtime.checkpointing`). The cost follows what is new,
        not the history; only a first checkpoint reads the whole log, and only one whose base
        has no counts (the first after an upgrade) counts the members from the chains after
        the last seal — unless that is more than `count_limit` trailers: it is then signed
        without counts (`counted` says so), for a later one to count. On a break, enter crisis
        instead (recorded on the autonomy chain and in the data directory, so a lost stream
        cannot take the crisis with it); return the break."""
        async with self._checkpointing:
            return await self._checkpoint(key, count_limit)

    async def _checkpoint(self, key: Ed25519PrivateKey, count_limit: int | None) -> str | None:
        path = anchor_file.path_in(self.config.data_dir)
        problems: list[str] = []
        try:  # before the stream: whatever it covered was on the stream before it was written
            kept = anchor_file.read(path)
        except ValueError as exc:
            kept, problems = None, [f"the checkpoint kept in the data directory cannot be "
                                    f"read: {exc}"]
        written = set(self.store.written)  # what this process appended, as the log is read
        view = await self.store.audit_view()
        if view.created is None:  # deleted under a running daemon: bring it back to say so
            try:
                await self.store.ensure()
                view = await self.store.audit_view()  # new: no anchor's stream any more
            except NeedsProvision as exc:  # the crisis is kept in the data directory anyway
                log.error("the audit stream is gone and this user may not re-create it",
                          error=str(exc))
        crisis = kept.crisis if kept else ""
        if crisis and await self._resolved(crisis):
            crisis, kept = "", None  # an operator accepted the log as it is: the new baseline
        trusted = self._trusted_daemons(key)
        since, scrubbed, seal, covered = None, 0, None, 0
        if view.created is not None:
            seal, unsealed = await archive.last_seal(self.store, trusted)
            problems += [unsealed] if unsealed else []
            base, claims, found = await checkpointing.choose_base(
                self.store, kept, view, self.chain_trust, trusted,
                seal.removable if seal else 0)
            problems += found
            covered = base.count
            if not problems:
                # what the base covers was fully verified before it was signed
                trust = dataclasses.replace(self.chain_trust, covered_to=base.last_seq)
                since = await checkpointing.verify_since(self.store, base, view, trust,
                                                         trusted, claims, archived=seal)
                problems += since.problems
                # an archived epoch is the export's to scrub
                scrubbed, damaged = await checkpointing.scrub(
                    self.store, max(kept.scrubbed_to if kept else 0, seal.upto if seal else 0),
                    base.last_seq, max(checkpointing.SCRUB_SLICE, since.read))
                problems += damaged
        else:
            problems.append(checkpoints.prefix_problem(kept or checkpointing.empty_base(view),
                                                      view, None) or "")
        if crisis and not problems:
            problems = [f"{crisis} is still open (kept in {path}) until an operator resolves it"]
        now = now_ms()
        if problems or since is None:
            await self._crisis(problems, crisis, kept, view, path, now)
            return "; ".join(problems)
        members = await self._members(since, seal, count_limit, first=covered == 0)
        cp = checkpoints.make_from(since.tree.frontier(), since.tree.count, since.last_seq,
                                  since.last_hash, now, key, await self._runtime_heads(now),
                                  members)
        await self.store.append_sealed(
            checkpointing.CP_SUBJECT, checkpoints.CHECKPOINT_ID, "L0", "operation",
            lambda chain, at: checkpoints.draft(cp, self.actor), clock=lambda: now)
        anchor = checkpoints.anchor_of(cp, view.created or "", scrubbed_to=scrubbed)
        anchor_file.write(path, anchor)
        self._retained = (anchor, trusted, seal.removable if seal else 0)
        self.chain_trust = dataclasses.replace(self.chain_trust, covered_to=cp.last_seq)
        self.store.written.difference_update(written)  # the checkpoint vouches for them now
        self.checkpoint_read = since.read
        log.info("checkpoint signed", trailers=cp.count, root=cp.root, read=since.read,
                 **({"members": members} if members is not None else {}))
        self.checkpointed_to = cp.last_seq
        self.counted = indexing.Counted(cp.last_seq, cp.at, members)
        return None

    async def _members(self, since: checkpointing.Since, seal: Seal | None,
                       count_limit: int | None, first: bool) -> dict[str, int] | None:
        """The members of each index as of `since.last_seq`: carried on from the base's
        counts, or — when the base has none (`first`: there is no base, the log's first
        checkpoint), or the last index check found the counts off the chains (`recount`) —
        counted from the chains after the last seal, at most `count_limit` trailers of them
        (None: more; the checkpoint goes without)."""
        members = since.members
        if members is not None and not self._recount and min(members.values(), default=0) >= 0:
            return members
        start = seal.upto + 1 if seal is not None else 1
        if count_limit is not None and since.last_seq - start + 1 > count_limit:
            return None
        say = log.info if first else log.warning
        say("counting the members of the indexes from the audit chains, once: the log's first "
            "checkpoint" if first else "counting the members of the indexes from the audit "
            "chains, once: the last checkpoint has no counts to carry on" if members is None
            else "counting the members of the indexes from the audit chains again: the last "
            "counts were off the chains", from_seq=start, to_seq=since.last_seq)
        started = time.perf_counter()
        records, _ = await indexing.from_chains(self.store, start, since.last_seq, None,
                                                self.policy)
        counts = indexing.counts_of(records)
        log.info("index members counted from the chains", members=counts,
                 seconds=round(time.perf_counter() - started, 2))
        self._recount = False
        return counts

    def recount(self) -> None:
        """Count the index members from the chains at the next checkpoint: the last counts
        did not match what the chains say (an index check found it)."""
        self._recount = True

    async def _runtime_heads(self, now: int) -> tuple[checkpoints.RuntimeHead, ...]:
        """The tool runtimes' chain heads for the checkpoint to witness — for `improved audit
        verify` to tell a runtime chain removed or cut short — or none. A witness only: this
        daemon decides nothing by them, and nothing about them stops a checkpoint. A user
        that may not read IMPROVE_TOOLS_AUDIT (the server drops the request, so it times out)
        records none, and is asked again only after WITNESS_RETRY_MS."""
        if now < self._witness_retry_at:
            return ()
        try:
            return await asyncio.wait_for(tool_chains.runtime_heads(self.nc),
                                          WITNESS_TIMEOUT_S)
        except NotFoundError:  # no such stream (yet): no runtime chain to witness
            return ()
        except Exception as exc:
            self._witness_retry_at = now + WITNESS_RETRY_MS
            log.info("the tool runtimes' chain heads were not witnessed",
                     stream=S.STREAM_TOOLS_AUDIT, error=f"{type(exc).__name__}: {exc}")
            return ()

    async def seal_if_due(self, key: Ed25519PrivateKey) -> None:
        """Seal the next epoch of the log, up to what the last checkpoint of this process
        verified, when it is due (`runtime.archive`). It reads the epoch, so it runs after a
        periodic checkpoint, never on the way to ready or out; a failure is logged and tried
        again after the next checkpoint."""
        if not self.checkpointed_to:
            return
        settings = self.config.audit
        try:
            await archive.seal_if_due(self.store, key, self.actor, self.checkpointed_to,
                                      now_ms(), settings.epoch_trailers, settings.epoch_hours,
                                      settings.retention_days, self._trusted_daemons(key))
        except Exception as exc:  # the log is whole; sealing can wait for the next one
            log.warning("could not seal the epoch", error=f"{type(exc).__name__}: {exc}")

    async def _resolved(self, crisis: str) -> bool:
        """Whether the autonomy chain, verified, records `crisis` as resolved by an operator."""
        chain = await self.store.read_chain_at(S.autonomy_audit(breaker.AUTONOMY_ID))
        if audit.verify_chain(breaker.AUTONOMY_ID, [body for _, body in chain],
                              self.chain_trust, [seq for seq, _ in chain]) is not None:
            return False
        return breaker.resolved([body for _, body in chain], crisis)

    # -- who writes and who authorises: the daemon key and the trust history ---------------------

    def use_key(self, key: Ed25519PrivateKey) -> None:
        """Sign every trailer with `key` and trust what it signed."""
        self.store.signer = key
        own = signing.keyid_of(signing.raw_public(key.public_key()))
        self.chain_trust = dataclasses.replace(self.chain_trust,
                                               daemons=self.chain_trust.daemons | {own},
                                               written=self.store.written)

    def _decide_with(self, trust: Trust) -> None:
        """Check signed acts and signals against `trust` from now on (its operator, voter and
        signer keys and act_max_age_s); what a chain says was trusted still comes from the
        trust history."""
        self.trust = trust.store()
        self.voters = trust.voters()
        self.max_act_age_ms = int(trust.act_max_age_s * 1000)
        fallback = evidence.KeySet(self.trust, self.voters, trust.signer_store())
        self.chain_trust = dataclasses.replace(
            self.chain_trust,
            history=dataclasses.replace(self.chain_trust.history, fallback=fallback))
        self.config = msgspec.structs.replace(self.config, trust=trust)

    @asynccontextmanager
    async def acting(self) -> AsyncIterator[None]:
        """Around checking a signed act (or signal) and recording it on a chain: `retrust`
        waits for those checked under the keys it replaces before it records new ones."""
        epoch = self._trust_epoch
        self._acts[epoch] += 1
        try:
            yield
        finally:
            self._acts[epoch] -= 1

    async def _acts_settled(self, before: int) -> None:
        """Wait until no act checked in a trust epoch before `before` is in flight."""
        deadline = time.monotonic() + RETRUST_WAIT_S
        while any(n for epoch, n in self._acts.items() if epoch < before):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"signed acts checked under the previous keys were still "
                                   f"being recorded after {RETRUST_WAIT_S:g} s")
            await asyncio.sleep(0.01)

    async def retrust(self, trust: Trust) -> dict[str, list[str]]:
        """Take a new trust store while running (SIGHUP): what it `added` and `removed`.
        While the new keys are recorded on the trust chain only the entries both stores hold
        count, so no act is accepted under a key the chain does not yet show trusted, nor
        under one it already shows removed. When recording fails (the broker, say) those
        common entries stay in force and the error is raised: a reload that succeeds later
        records and takes the rest."""
        old = self.config.trust
        before = (dict(old.operators), dict(old.quorum), dict(old.signers))
        after = (dict(trust.operators), dict(trust.quorum), dict(trust.signers))
        changes = evidence.key_changes(before, after)
        if before != after:
            operators, voters, signers = evidence.common_keys(before, after)
            self._decide_with(msgspec.structs.replace(old, operators=operators, quorum=voters,
                                                      signers=signers))
            self._trust_epoch += 1
            await self._acts_settled(self._trust_epoch)
            await self.record_trust(trust)
        self._decide_with(trust)
        return changes

    async def record_trust(self, trust: Trust | None = None) -> Trailer | None:
        """Read the trust chain (verified) into the trust history, and append this daemon's
        operator and voter keys (or those of `trust`) when they differ from the last recorded:
        an old act keeps verifying against the key trusted when it was accepted. The appended
        trailer, or None."""
        subject = S.trust_audit(evidence.TRUST_ID)
        t = trust or self.config.trust
        keys = (dict(t.operators), dict(t.quorum), dict(t.signers))

        def next_draft(chain: list[tuple[int, dict[str, Any]]], now: int) -> Draft | None:
            return evidence.trust_draft(keys, chain[-1][1] if chain else None, self.actor)

        trailer = await self.store.append_sealed(subject, evidence.TRUST_ID, "L0", "operation",
                                                 next_draft, clock=now_ms)
        chain = await self.store.read_chain_at(subject)
        if not chain:  # no key was ever trusted: nothing recorded, nothing to believe
            return trailer
        brk = audit.verify_chain(evidence.TRUST_ID, [body for _, body in chain],
                                 evidence.ChainTrust(self.chain_trust.daemons),
                                 [seq for seq, _ in chain])
        if brk is not None:  # not believed; the checkpoint at start opens the crisis
            log.error("the trust chain does not verify; only this daemon's keys count",
                      problem=str(brk))
            return trailer
        history = evidence.history_of(chain, self.chain_trust.history.fallback)
        self.chain_trust = dataclasses.replace(self.chain_trust, history=history)
        if trailer is not None:
            log.warning("trust store changed: recorded on the trust chain", reason=trailer.reason)
        return trailer

    async def chain_broken(self, problem: str) -> None:
        """A chain about to be decided on does not verify: open a crisis (applies refused)."""
        path = anchor_file.path_in(self.config.data_dir)
        try:
            kept = anchor_file.read(path)
        except ValueError:
            kept = None
        view = checkpoints.StreamView(kept.stream_created if kept else None)
        await self._crisis([problem], kept.crisis if kept else "", kept, view, path, now_ms())

    def _trusted_daemons(self, key: Ed25519PrivateKey) -> set[str]:
        """Whose checkpoints count: the daemon keys whose trailers count (`[trust] daemons` and
        this daemon's own, `use_key`), and the key this checkpoint is signed with."""
        return set(self.chain_trust.daemons) | {signing.keyid_of(signing.raw_public(
            key.public_key()))}

    async def _crisis(self, problems: list[str], crisis: str, kept: checkpoints.Anchor | None,
                      view: checkpoints.StreamView, path: Path, now: int) -> None:
        """Open a crisis (or keep the open one) on the autonomy chain and in the data
        directory: the file first, so a crisis survives even if the chain append fails."""
        state = await self.autonomy(now + AUTONOMY_TTL_MS + 1)
        crisis = crisis or state.crisis or f"crisis-{now}"
        baseline = kept or checkpoints.Anchor(view.created or "", 0, 0, merkle_root([]),
                                             "", now)
        if baseline.crisis != crisis:
            anchor_file.write(path, dataclasses.replace(baseline, crisis=crisis))
        if state.crisis == crisis and self._autonomy_verified:
            return
        problem = "; ".join(problems)
        log.error("audit log broken: entering crisis, applies refused", crisis=crisis,
                  problem=problem)
        await self._append_autonomy(lambda s: breaker.in_crisis(s, crisis), "crisis",
                                    self.actor, "rec:system", f"{crisis}: {problem}"[:500])

    @_acting
    async def resolve_crisis(self, env: Envelope, act: Act) -> bool:
        """An operator's signed act clears the crisis it names; anything else is refused."""
        try:
            verified, cmd = authority.check_signed(self.trust, env, PAYLOAD_TYPES["crisis"],
                                                   CrisisAct, now_ms(), self.max_act_age_ms)
        except ActRefused as refused:
            log.warning("crisis resolution refused", code=refused.code, reason=refused.reason)
            return False
        current = await self.autonomy(now_ms() + AUTONOMY_TTL_MS + 1)
        if not current.crisis or current.crisis != cmd.crisis:
            log.warning("crisis resolution refused: no such open crisis", crisis=cmd.crisis)
            return False
        await self._append_autonomy(lambda s: breaker.in_crisis(s, ""), "crisis_resolved",
                                    cmd.principal, "human",
                                    f"{cmd.crisis} resolved by {cmd.principal}: {cmd.reason}",
                                    breaker.Marks(act=act.digest, keyid=verified.keyid,
                                                  resolved=cmd.crisis), verified.envelope)
        log.warning("crisis resolved; applies resume", crisis=cmd.crisis,
                    principal=cmd.principal)
        return True

    # -- rebuilding from the chain -------------------------------------------------------------------

    async def resync(self, svc: str, pid: str, proposal: Proposal | None) -> ProposalRecord | None:
        """Make the cached record equal to what the chain says (the chain is authoritative)."""
        cached, rev = await self.store.load(svc, pid)
        rebuilt = await self.rebuild(svc, pid)
        if rebuilt is not None and rebuilt != cached:
            try:
                rev = await self.store.save(rebuilt, rev)
            except StateConflict:
                return rebuilt  # someone else just saved; the next attempt re-reads
            self._remember(rebuilt, rev)
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
        brk = audit.verify_chain(chain_id, [body for _, body in chain], self.chain_trust,
                                 [seq for seq, _ in chain],
                                 None if svc in S.MESH_CHAINS else svc)
        if brk is not None:
            await self.chain_broken(f"{svc}/{brk}")
            raise ChainBroken(f"{svc}/{brk}")

    async def republish_all(self, concurrency: int = 32) -> int:
        """Rebuild every record and grant from its chain and publish the retained records and
        the review index again: what they would say had they never been lost. One read of the
        log (with its stream sequences), then `concurrency` chains at a time. Returns the
        chains replayed."""
        chains = iter((await self.store.sequenced_chains()).items())
        count = 0

        async def worker() -> None:
            nonlocal count
            for (svc, cid), entries in chains:  # one shared iterator: each chain once
                trailers = [decode_trailer(body) for _, body in entries]
                try:
                    if svc == S.GRANT_CHAINS:
                        state = authority.grant_state(trailers)
                        if state is not None:
                            await self.store.publish(S.grant_record(*state.skill.split(":", 1)),
                                                     state)
                    elif svc not in S.MESH_CHAINS:
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
        lock; when the chain moved on since the snapshot, from the chain as it is now. The
        state cache is left to fill lazily (`_load`)."""
        lock = await self._acquire(pid)
        try:
            record = propose.rebuild_record(trailers, seqs, self.policy)
            head, _ = await self.store.chain_head(S.audit(svc, pid))
            if head != seqs[-1]:  # the chain moved on since the snapshot: read it again
                record = await self.rebuild(svc, pid) or record
            jobs = [self.publish(record)]
            for name, index in indexes.INDEXES.items():
                if index.member(record):  # lost with the records: no tombstones needed
                    jobs.append(self.store.index_entry(name, svc, pid, index.entry(record)))
            await asyncio.gather(*jobs)
        finally:
            self._release(pid, lock)

    def set_queue_size(self, n: int) -> None:
        """The pending-reviews metric: the entries of the review index (what `improved review`
        lists), as last recounted and moved by this replica's passes since."""
        self.queue_size = max(n, 0)
        self.metrics.set_pending_reviews(self.queue_size)

    # -- retained records ----------------------------------------------------------------------------

    async def publish(self, record: ProposalRecord,
                      since: ProposalRecord | None = None) -> None:
        """Publish the retained records of `record`; with `since` (the record as its records
        were last published), only those that changed since. Once the proposal is closed
        (`record.closed`), every record carries the TTL `records_ttl_days` (the transition that
        closes it sends all of them again, so none stays behind without one): the records
        stream keeps what is open, not the history."""
        svc, pid = record.service, record.proposal_id
        ttl = self.records_ttl_s if self.records_ttl_s and closed(record) else None
        if ttl is not None and since is not None and not closed(since):
            since = None
        jobs = [self.store.publish(S.proposal_state(svc, pid), state_of(record, now_ms()), ttl)]
        if record.decision is not None and (since is None or record.decision != since.decision):
            jobs.append(self.store.publish(S.triage_decision(svc, pid), record.decision, ttl))
        if record.outcome is not None and (since is None or record.outcome != since.outcome):
            jobs.append(self.store.publish(S.apply_outcome(svc, pid), record.outcome, ttl))
        decided = quorum.quorum_record(record)
        if decided is not None and (since is None or decided != quorum.quorum_record(since)):
            jobs.append(self.store.publish_once(S.quorum_record(pid), decided))
        if (len(record.signals) > len(record.proposal.signals or ())
                or record.measured is not None) and (
                since is None or record.signals != since.signals
                or record.measured != since.measured):
            jobs.append(self.store.publish(S.learn_back(svc, pid),
                                           learnback.summary(record, record.updated_at), ttl))
        await asyncio.gather(*jobs)

    async def publish_unreachable(self, record: ProposalRecord, error: str) -> None:
        """Tell watchers the apply is stuck, without a trailer: nothing transitioned."""
        outcome = ApplyOutcome(proposal_id=record.proposal_id, service=record.service, ok=False,
                               applied_id="", authority=apply_stage.authority(record, self.policy),
                               error=f"unreachable: {error}", at=now_ms())
        await self.store.publish(S.apply_outcome(record.service, record.proposal_id), outcome)
