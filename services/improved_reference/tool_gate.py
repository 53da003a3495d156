"""An agent runtime's gate carried out (SPEC 09 §3.1): the ledger reads and writes the core's
steps ask for, and the tool itself.

`improved.core.tools.Runtime` decides every call from values: where it needs the ledger it
answers a step (read an acceptance, ask whether an upgrade is revoked, spend a grant or a
session proof, record an acceptance) whose `then` takes the answer. `ToolGate` does what each
step names against a `Ledger` and hands the answer back until the Runtime decides, then runs the
tool (sync, or awaiting what it returns). `ProcessLedger` keeps the ledger in this process's
memory; `improved_reference.tool_runtime.JetStreamLedger` shares it between the replicas of a
runtime, and `ToolRuntimeService` serves a ToolGate over NATS.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from typing import Any, Protocol

from improved.core.tools import (
    Decision,
    LedgerUntrusted,
    ReadAcceptance,
    ReadRevoked,
    RecordRevocation,
    Runtime,
    SessionProof,
    Spend,
    Step,
    grant_token,
    raised,
    ran,
)
from improved.protocol.model import Envelope


class Ledger(Protocol):
    """Spent grants and session proofs, L2 acceptances and upgrade revocations, shared by
    whoever shares the ledger (a proof's digest and a grant's act id hash different bytes, so
    they share the spent marks).

    `spend` is create-only: True for the one caller that spends `act`, False for every later
    one, whatever was written under the key in between, until `until` (ms, `spent_until`):
    after that the ledger may forget the act, whose own time check refuses it by then.
    `acceptance` answers the signed grant recorded for (runtime, token), which the runtime
    verifies again before believing it. `spend` and `revoked` raise LedgerUntrusted when the
    ledger cannot vouch for what it kept."""

    async def spend(self, act: str, until: int, now: int) -> bool: ...

    async def acceptance(self, runtime: str, token: str) -> Envelope | None: ...

    async def accept(self, runtime: str, token: str, grant: Envelope) -> None: ...

    async def revoked(self, upgrade: str) -> bool: ...

    async def revoke(self, upgrade: str, revocation: Envelope) -> None: ...


class ProcessLedger:
    """A ledger in this process's memory: for one process, and for tests."""

    def __init__(self) -> None:
        self.spent: dict[str, int] = {}  # act id → when it may be forgotten (ms)
        self.accepted: dict[tuple[str, str], Envelope] = {}
        self.revocations: dict[str, Envelope] = {}

    async def spend(self, act: str, until: int, now: int) -> bool:
        self.spent = {a: kept for a, kept in self.spent.items() if kept > now}
        if act in self.spent:
            return False
        self.spent[act] = until
        return True

    async def acceptance(self, runtime: str, token: str) -> Envelope | None:
        return self.accepted.get((runtime, token))

    async def accept(self, runtime: str, token: str, grant: Envelope) -> None:
        self.accepted[(runtime, token)] = grant

    async def revoked(self, upgrade: str) -> bool:
        return upgrade in self.revocations

    async def revoke(self, upgrade: str, revocation: Envelope) -> None:
        self.revocations.setdefault(upgrade, revocation)


async def carry_out(step: Step, ledger: Ledger) -> Decision:
    """Do what each step of a call's decision names against `ledger`, one after the other,
    handing each the ledger's answer, until the Runtime decides. A LedgerUntrusted is an
    answer (the step refuses on it); any other failure of the ledger propagates."""
    while not isinstance(step, Decision):
        if isinstance(step, ReadAcceptance):
            step = step.then(await ledger.acceptance(step.runtime, step.token))
        elif isinstance(step, ReadRevoked):
            step = step.then(await _vouched(ledger.revoked(step.upgrade)))
        elif isinstance(step, Spend):
            step = step.then(await _vouched(ledger.spend(step.act, step.until, step.now)))
        else:
            await ledger.accept(step.runtime, step.token, step.grant)
            step = step.then()
    return step


async def _vouched(answer: Awaitable[bool]) -> bool | LedgerUntrusted:
    try:
        return await answer
    except LedgerUntrusted as exc:
        return exc


class ToolGate:
    """One Runtime's gate over one ledger (a ProcessLedger unless given): every call of the
    runtime's tools goes through `invoke`, or `decide` then `run` for a caller that records the
    decision in between."""

    def __init__(self, runtime: Runtime, ledger: Ledger | None = None):
        self.runtime = runtime
        self.ledger: Ledger = ledger if ledger is not None else ProcessLedger()

    async def refresh(self) -> None:
        """Learn the acceptances other replicas (or an earlier run) recorded in the ledger."""
        rt = self.runtime
        for provider in rt.awaiting_acceptance():
            rt.learn_acceptance(provider, await self.ledger.acceptance(
                rt.name, grant_token(provider)))

    async def invoke(self, name: str, args: dict[str, Any] | None,
                     grant: Envelope | None, now_ms: int, *, session: str | None = None,
                     upgrade: Envelope | None = None,
                     proof: SessionProof | None = None) -> dict[str, Any]:
        """`{"ok": true, "result"}`, `{"ok": false, "error"}` (the tool raised), `{"refused"}`
        (nothing ran), or the not_found error reply for a name not in the catalog."""
        decision = await self.decide(name, args, grant, now_ms, session=session,
                                     upgrade=upgrade, proof=proof)
        return await self.run(decision)

    async def decide(self, name: str, args: dict[str, Any] | None, grant: Envelope | None,
                     now_ms: int, *, session: str | None = None,
                     upgrade: Envelope | None = None,
                     proof: SessionProof | None = None) -> Decision:
        """Whether this call may run (`Runtime.gate`), the grant or the session proof that
        lets it spent and an acceptance it makes recorded; for a refused call nothing is spent
        and no acceptance recorded."""
        first = self.runtime.gate(name, args, grant, now_ms, session=session,
                                  upgrade=upgrade, proof=proof)
        return await carry_out(first, self.ledger)

    async def run(self, decision: Decision) -> dict[str, Any]:
        """Run an allowed call (`decide`); the refusal as it is for one that is not."""
        refusal = decision.refusal
        if refusal is not None:
            return refusal
        assert decision.provider is not None  # `refusal` answers a call without one
        try:
            result = decision.provider.run(decision.args)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            return raised(decision, exc)
        return ran(decision, result)

    async def revoke(self, env: Envelope) -> dict[str, Any]:
        """Record an operator's signed revocation of one of this runtime's upgrades:
        `{"ok": true, "revoked": <act id>}`, or `{"refused"}` when it does not verify."""
        revocation = self.runtime.revocation(env)
        if not isinstance(revocation, RecordRevocation):
            return revocation
        await self.ledger.revoke(revocation.upgrade, revocation.revocation)
        return revocation.reply
