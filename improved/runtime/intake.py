"""What arrives for a proposal besides a signed act: its registration (once, the first one
deciding), a learn-back signal, an asynchronous apply report. Each is taken onto the
proposal's chain by a pass of the engine; newer content under the same dedup_key that still
stands supersedes a registration before anything of it is sent.
"""

from __future__ import annotations

from improved.core import apply as apply_stage
from improved.core import boundary, identity, learnback, propose, triage
from improved.core.audit import Draft
from improved.core.record import CountedSignal, ProposalRecord
from improved.protocol import subjects as S
from improved.protocol import wire
from improved.protocol.model import (
    ApplyResult,
    DedupHead,
    Envelope,
    LedgerEntry,
    Proposal,
    Signal,
)
from improved.runtime.buckets import Claim, ledger_entry
from improved.runtime.clock import now_ms
from improved.runtime.engine import Engine, Handled
from improved.runtime.records import ChainBroken


class Intake:
    """Registrations, signals and apply reports, each carried on by a pass of `engine`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.store = engine.store
        self.records = engine.records
        self.policy = engine.policy

    async def submit(self, proposal: Proposal, pid: str, dedup: str,
                     republish: bool = False, dispatch: bool = True,
                     fresh: bool = False, proposer: str | None = None,
                     envelope: Envelope | None = None) -> Handled:
        """Register a proposal (once) and carry it as far as its gate allows (short of the
        apply when `dispatch` is False: the inbound consumer then carries the apply). A
        signed one's `proposer` (`TrustInForce.verified_proposer`) and `envelope` go on its
        registration; the first registration decides, so a later signed copy of registered
        content, or a later bare one, changes nothing."""

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
        seen: dict[str, DedupHead | None] = {}  # the head as it was before this one's claim
        ledger: dict[str, LedgerEntry | None] = {}

        async def claim_key(absent: bool) -> tuple[DedupHead | None, LedgerEntry | None]:
            """Claim the dedup_key (with `absent`, a create without a read) and read the
            rejection ledger, both at once: (the head the key held before, the entry)."""
            claimed, entry = await self._claim(svc, dedup, pid, proposal.created_at, absent)
            self.engine.heads.claimed(pid, claimed.revision, DedupHead(
                proposal_id=pid, created_at=proposal.created_at), claimed.leased)
            return claimed.before, entry

        if not future and pid not in self.records.cache:
            # most likely new: claim the key first (no read) and read the ledger beside it;
            # what the key held before says whether newer content stands
            seen["head"], ledger["entry"] = await claim_key(absent=True)
            standing = (await self.engine.standing_over(svc, seen["head"], pid, proposal, dedup)
                        if dispatch else None)
        else:
            standing = (None if future or not dispatch  # without dispatch nothing is sent
                        else await self.engine.standing_head(svc, dedup, pid, proposal, seen))
        dispatch_now = dispatch and standing is None

        async def prepare() -> triage.Rejection | None:
            """Under the proposal's lock, by whoever registers it: claim the dedup_key (a crash
            before the registration leaves the message unacknowledged, so it is claimed again
            on redelivery) and read the rejection ledger, both at once — unless both were done
            above. The ledger is read whatever the key held: a head leaves the bucket once its
            proposal has been closed for `records_ttl_days` (`propose.head_may_expire`), a
            ledger entry never does. An entry only names the rejected proposal: its chain says
            whether an operator rejected it (`_rejection`)."""
            if future:
                return None
            # a key just read as absent is most likely still absent: create without a read
            head, rejected = (seen["head"], ledger["entry"]) if "entry" in ledger \
                else await claim_key(absent=seen.get("head", 0) is None)
            if head is not None and head.proposal_id != pid:
                claim["head"] = head
            return await self._rejection(svc, dedup, pid, rejected)

        # A first delivery not in this process's cache is taken for new without a read: if
        # the chain exists after all, the append conflicts and the record is rebuilt.
        handled = await self.engine.handle(svc, pid, ingest, republish, dispatch_now,
                                    fresh, optimistic=not (fresh or republish), prepare=prepare)
        head = claim.get("head")
        other = await self.records.truth(svc, head.proposal_id) if head is not None else None
        if other is not None and propose.older_under_key(other, proposal, pid, dedup):
            await self.engine.supersede(svc, other.proposal_id, pid)
        elif other is not None and propose.stands_over(other, proposal, pid, dedup):
            # this content arrived after newer content under the same key that still stands
            return await self.engine.supersede(svc, pid, other.proposal_id)
        if dispatch and not dispatch_now:  # held back for nothing: carry it on now
            handled = await self.engine.advance(svc, pid)
        return handled

    async def _claim(self, svc: str, dedup: str, pid: str, created_at: int,
                     absent: bool) -> tuple[Claim, LedgerEntry | None]:
        """Claim the dedup_key for `pid` (`Buckets.claim_dedup_head`, leased) and read the
        rejection ledger beside it: the read leaves first, its answer is awaited after."""
        ledger_read = await self.store.ledger_send(svc, dedup)
        try:
            claimed = await self.store.claim_dedup_head(svc, dedup, pid, created_at, absent,
                                                        self.engine.heads.lease_s)
        except BaseException:
            ledger_read.forget()
            raise
        return claimed, await ledger_entry(ledger_read)

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
            found = triage.rejection_of(await self.records.truth(svc, named))
        except ChainBroken:
            return None
        return found if found is not None and found.dedup_key == dedup else None

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

        handled = await self.engine.handle(svc, signal.proposal_id or "", ingest, republish,
                                    dispatch=dispatch, fresh=fresh)
        handled.counted = box.get("counted")
        return handled

    async def report(self, svc: str, pid: str,
                     result: boundary.Evidence[ApplyResult]) -> tuple[Handled, bool]:
        """An asynchronous ApplyReport; (handled, whether it was taken as the apply result).
        Where the service's own reports can be told (`Answers.attestable`), one that is not
        its own is refused: WireError `not_attested`, nothing changes."""
        if isinstance(result, boundary.Unattested) and self.engine.answers.attestable(svc):
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

        handled = await self.engine.handle(svc, pid, ingest, False)
        return handled, taken
