"""Who is trusted, now and as the chains recorded it: the operator, voter and signer keys signed
acts and signals are checked against, the daemon keys whose trailers count, and the trust
history the trust chain keeps, so an old act keeps verifying against the key trusted when it
was accepted.

A reload (SIGHUP, `retrust`) changes what is trusted while acts are in flight: every check of
a signed act runs inside `acting`, and a reload waits for those checked under the keys it
replaces before it records and takes the new ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import msgspec
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from improved.client.config import Trust
from improved.core import audit, authority, evidence, identity, propose, signing
from improved.core.audit import Draft
from improved.core.signing import PAYLOAD_TYPES, ActRefused
from improved.protocol import subjects as S
from improved.protocol.model import Envelope, Proposal, Signal, Trailer
from improved.runtime.clock import now_ms
from improved.runtime.store import Store

log = structlog.get_logger("improved.engine")

RETRUST_WAIT_S = 30.0  # how long a reload waits for acts checked under the keys it replaces

P = ParamSpec("P")
R = TypeVar("R")


class TrustInForce:
    """The keys acts are checked against now (`operators`, `voters`, `signers`), and what a
    chain is believed by (`chain_trust`: the daemon keys, the trust history, what the last
    checkpoint covered)."""

    def __init__(self, config: Trust, store: Store, actor: str):
        self.store = store
        self.actor = actor
        self.config = config
        self.operators = config.store()
        self.voters = config.voters()
        self.max_act_age_ms = int(config.act_max_age_s * 1000)
        # who may have written a trailer and signed an act; `use_key` adds this daemon's key,
        # `record_trust` the trust history, each checkpoint what it vouches for
        self.chain_trust = evidence.ChainTrust(
            frozenset(config.daemon_keyids()),
            evidence.History(fallback=evidence.KeySet(self.operators, self.voters,
                                                      config.signer_store())))
        # signed acts and signals in flight, by the trust epoch they were checked in
        self._trust_epoch = 0
        self._acts: Counter[int] = Counter()

    def signers(self) -> signing.TrustStore:
        """The `[trust.signers]` keys in force: agents and services that sign what they send."""
        return self.chain_trust.history.fallback.signers

    def cover(self, last_seq: int) -> None:
        """A checkpoint verified the log up to `last_seq`: what it covers is believed."""
        self.chain_trust = dataclasses.replace(self.chain_trust, covered_to=last_seq)

    def use_key(self, key: Ed25519PrivateKey) -> None:
        """Sign every trailer with `key` and trust what it signed."""
        self.store.signer = key
        own = signing.keyid_of(signing.raw_public(key.public_key()))
        self.chain_trust = dataclasses.replace(self.chain_trust,
                                               daemons=self.chain_trust.daemons | {own},
                                               written=self.store.written)

    def trusted_daemons(self, key: Ed25519PrivateKey) -> set[str]:
        """Whose checkpoints count: the daemon keys whose trailers count (`[trust] daemons` and
        this daemon's own, `use_key`), and the key this checkpoint is signed with."""
        return set(self.chain_trust.daemons) | {signing.keyid_of(signing.raw_public(
            key.public_key()))}

    def verified_proposer(self, proposal: Proposal, env: Envelope | None) -> str | None:
        """Who verifiably proposed `proposal` (the payload of `env`): None when it came
        unsigned; the identity of the `[trust.signers]` key that signed it, an agent of its
        service or the service itself; WireError when it does not verify (nothing changes)."""
        if env is None:
            return None
        return propose.verify_signed(self.signers(), env, proposal).principal

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
        if self.config.subjects_bound:
            return identity.of_subject(svc), None
        return identity.UNVERIFIED, None

    def decide_with(self, trust: Trust) -> None:
        """Check signed acts and signals against `trust` from now on (its operator, voter and
        signer keys and act_max_age_s); what a chain says was trusted still comes from the
        trust history."""
        self.operators = trust.store()
        self.voters = trust.voters()
        self.max_act_age_ms = int(trust.act_max_age_s * 1000)
        fallback = evidence.KeySet(self.operators, self.voters, trust.signer_store())
        self.chain_trust = dataclasses.replace(
            self.chain_trust,
            history=dataclasses.replace(self.chain_trust.history, fallback=fallback))
        self.config = trust

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
        old = self.config
        before = (dict(old.operators), dict(old.quorum), dict(old.signers))
        after = (dict(trust.operators), dict(trust.quorum), dict(trust.signers))
        changes = evidence.key_changes(before, after)
        if before != after:
            operators, voters, signers = evidence.common_keys(before, after)
            self.decide_with(msgspec.structs.replace(old, operators=operators, quorum=voters,
                                                      signers=signers))
            self._trust_epoch += 1
            await self._acts_settled(self._trust_epoch)
            await self.record_trust(trust)
        self.decide_with(trust)
        return changes

    async def record_trust(self, trust: Trust | None = None) -> Trailer | None:
        """Read the trust chain (verified) into the trust history, and append this daemon's
        operator and voter keys (or those of `trust`) when they differ from the last recorded:
        an old act keeps verifying against the key trusted when it was accepted. The appended
        trailer, or None."""
        subject = S.trust_audit(evidence.TRUST_ID)
        t = trust or self.config
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
        if trailer is not None:  # a start's (or a reload's) normal business
            log.info("trust store recorded on the trust chain", reason=trailer.reason)
        return trailer


class _Acts(Protocol):
    trust: TrustInForce


A = TypeVar("A", bound=_Acts)


def recorded_act(method: Callable[Concatenate[A, P], Awaitable[R]]
                 ) -> Callable[Concatenate[A, P], Awaitable[R]]:
    """A method that checks a signed act and records it: run inside `TrustInForce.acting`."""

    @functools.wraps(method)
    async def run(self: A, /, *args: P.args, **kw: P.kwargs) -> R:
        async with self.trust.acting():
            return await method(self, *args, **kw)

    return run
