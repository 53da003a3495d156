"""Signed acts on a chain: an operator's review, a quorum vote, a grant or revoke of an L3 skill.
Each is checked against the trust in force (`runtime.trusting`) and recorded on its chain,
refused there with its reason when it is bare, replayed or does not verify; a redelivery
changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from improved.client.chain_writer import decode_trailer
from improved.core import authority, quorum, signing, triage
from improved.core.audit import Draft
from improved.core.authority import Act
from improved.core.record import ProposalRecord
from improved.core.signing import PAYLOAD_TYPES, ActRefused
from improved.protocol import subjects as S
from improved.protocol.model import Envelope, Grant, GrantCommand, LedgerEntry, Review, Vote
from improved.runtime.clock import now_ms
from improved.runtime.engine import Engine, Handled, Ingest
from improved.runtime.trusting import recorded_act

log = structlog.get_logger("improved.engine")

B = TypeVar("B", bound=authority.SignedBody)


def _principal(body: Any) -> str:
    """Whom a signed act speaks for, by default: its `principal` field."""
    return str(body.principal)


class SignedActs:
    """Signed acts, each carried onto its chain by a pass of `engine`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.store = engine.store
        self.records = engine.records
        self.trust = engine.trust
        self.actor = engine.actor

    @recorded_act
    async def review(self, svc: str, pid: str, env: Envelope | None, act: Act) -> Handled:
        """An operator's signed review; unsigned (`env` None), bad or replayed ones are refused
        on the proposal's chain and move nothing."""
        record = await self.records.truth(svc, pid)
        if record is None:
            return Handled(None, False)
        superseded = await self.engine.standing_head(svc, record.dedup_key, pid, record.proposal,
                                               {}) is not None

        ingest = self._signed_act(
            act, env, self.trust.operators, "review", Review,
            lambda record, verified, rv, now: authority.review(
                record, act, verified, rv, superseded, self.actor, now))

        async def ledger(rec: ProposalRecord) -> None:
            """An operator's rejection enters the ledger before anyone can see it."""
            d = rec.decision
            if d is not None and d.verdict == "reject" and d.cause is None:
                await self.store.ledger_put(svc, rec.dedup_key, LedgerEntry(
                    proposal_id=pid, principal=d.actor, reason=d.rationale, at=d.at,
                    evidence=triage.evidence_digest(rec.proposal)))

        return await self.engine.handle(svc, pid, ingest, False, on_change=ledger)

    @recorded_act
    async def vote(self, svc: str, pid: str, env: Envelope, act: Act) -> Handled:
        """A signed quorum vote (SPEC 09 §6): counted on the proposal's chain or refused there
        with its reason; the quorum's decision follows in the same pass."""

        def count(record: ProposalRecord, verified: signing.Verified, vote: Vote,
                  now: int) -> Draft:
            sig = next(s.sig for s in env.signatures if s.keyid == verified.keyid)
            return quorum.count(record, act, verified, vote, sig, self.actor)

        ingest = self._signed_act(act, env, self.trust.voters, "vote", Vote, count,
                                  principal_of=lambda v: v.voter)
        return await self.engine.handle(svc, pid, ingest, False)

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
                    trust, env, PAYLOAD_TYPES[kind], decode_as, now, self.trust.max_act_age_ms,
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

    @recorded_act
    async def grant(self, env: Envelope, skill: str, act: Act) -> Grant | None:
        """A signed grant or revoke for `<name>:<sha256>`: chained per hash, then retained. A
        grant counts only for the definition of the L2 proposal it names, read from that
        proposal's verified chain once the grant's own signature verified (an unsigned act
        costs no read) and counted only when that proposal was approved and applied."""
        sha = skill.split(":", 1)[1]
        subject = S.grant_audit(sha)
        verified = cmd = refused = None
        try:
            verified, cmd = authority.check_signed(
                self.trust.operators, env, PAYLOAD_TYPES["grant"], GrantCommand, now_ms(),
                self.trust.max_act_age_ms)
        except ActRefused as exc:
            refused = exc
        if cmd is not None:
            l2 = None
            if cmd.op == "grant" and cmd.proposal_id is not None and \
                    (owner := await self.store.service_of(cmd.proposal_id)) is not None:
                l2 = await self.records.rebuild(owner, cmd.proposal_id)
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
