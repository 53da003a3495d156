"""What every scene of the demo's walk stands on: the mesh and the timeline it is handed, the
ids the scenes pass on to each other, and the few moves they all make (propose, wait for the
decision or a status, sign an operator's act, check that nothing was ordered).

The scenes themselves are grouped by what they show (skill_scenes, ranking_scenes,
store_scenes); the demo is all of them, walked in order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any, Literal, TypeVar

from improved.client.sdk import MeshClient
from improved.core.signing import PAYLOAD_TYPES, sign
from improved.protocol import subjects as S
from improved.protocol.model import (
    ApplyOutcome,
    Proposal,
    ProposalState,
    Review,
    TriageDecision,
    to_json,
)
from improved_demo.cast import OPERATOR
from improved_demo.mesh import Mesh
from improved_demo.timeline import StepFailed, Timeline
from improved_reference.kv_service import KVService

T = TypeVar("T")

SETTLE = 0.3  # how long to watch for something that must NOT happen (an apply order)


def short(pid: str) -> str:
    return pid[:12]


def short_identity(identity: str) -> str:
    name, _, sha = identity.partition(":")
    return f"{name}:{sha[:12]}"


class Scenes:
    """The walk's shared state and moves; `step_timeout` bounds each expected state."""

    def __init__(self, mesh: Mesh, timeline: Timeline, step_timeout: float):
        self.mesh = mesh
        self.timeline = timeline
        self.step_timeout = step_timeout
        self._last_ms = 0
        self.ids: dict[str, str] = {}  # what the newcomer may want to `improved show`

    def event(self, label: str, text: str) -> None:
        self.timeline.event(label, text)

    def ok(self, text: str) -> None:
        self.timeline.ok(text)

    def expect(self, condition: bool, what: str) -> None:
        if not condition:
            raise StepFailed(what)

    async def wait(self, what: str, check: Callable[[], Awaitable[T | None]],
                   timeout: float | None = None) -> T:
        """Poll `check()` until it returns something truthy; StepFailed after `timeout`
        (default: the walk's step timeout)."""
        timeout = self.step_timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last: T | Exception | None = None
        while True:
            try:
                last = await check()
            except Exception as exc:  # a transient read error is just "not yet"
                last = exc
            if last and not isinstance(last, Exception):
                return last
            if loop.time() >= deadline:
                seen = f" (last seen: {last!r})" if last not in (None, False) else ""
                raise StepFailed(f"{what} did not arrive within {timeout:g}s{seen}")
            await asyncio.sleep(0.05)

    def now_ms(self) -> int:
        """Strictly increasing creation times: supersession orders proposals by them."""
        self._last_ms = max(int(time.time() * 1000), self._last_ms + 1)
        return self._last_ms

    async def propose(self, client: MeshClient, proposal: Proposal) -> str:
        reply = await client.propose(proposal)
        self.event("propose", f"{proposal.change_class} {proposal.target_ref} by "
                   f"{proposal.origin.actor} -> {short(reply.proposal_id)}, {reply.status}")
        return reply.proposal_id

    async def decision(self, client: MeshClient, pid: str) -> TriageDecision:
        """The retained TriageDecision record, as any late joiner would read it."""
        d = await self.wait(f"the triage decision of {short(pid)}",
                            lambda: client.decision(pid))
        cause = f" {d.cause}" if d.cause else ""
        self.event("triage", f"{d.verdict}/{d.gate_class}{cause}: {d.rationale}")
        return d

    async def status(self, client: MeshClient, pid: str, status: str) -> None:
        async def reached() -> ProposalState | None:
            state = await client.state(pid)
            return state if state is not None and state.status == status else None

        await self.wait(f"status {status} of {short(pid)}", reached)

    async def chain(self, svc: str, pid: str) -> list[dict[str, Any]]:
        return [body for _, body in await self.mesh.reader.read_chain(svc, pid)]

    async def signed(self, subject: str, kind: str, body: Any) -> None:
        """Sign an act with the demo operator's key and publish it into the inbound stream."""
        env = sign(PAYLOAD_TYPES[kind], to_json(body), self.mesh.operator_key)
        await self.mesh.js.publish(subject, to_json(env))

    async def review(self, svc: str, pid: str, verdict: Literal["approve", "reject", "rollback"],
                     reason: str,
                     body_digest: str | None = None) -> None:
        await self.signed(S.inbound_review(svc), "review", Review(
            proposal_id=pid, verdict=verdict, principal=OPERATOR, reason=reason,
            at=int(time.time() * 1000), body_digest=body_digest))
        self.event("operator", f"{OPERATOR} signs {verdict!r} of {short(pid)} "
                   f"(DSSE, Ed25519) -> {S.inbound_review(svc)}")

    async def why_not(self, subject: str, failure: StepFailed) -> StepFailed:
        """`failure`, with the daemon's reason when it refused the act (the chain says)."""
        with suppress(Exception):
            chain = await self.mesh.reader.read_chain_at(subject)
            last = chain[-1][1] if chain else {}
            if last.get("verdict") == "refused":
                return StepFailed(f"{failure}; the daemon refused the act: {last.get('reason')}")
        return failure

    async def no_orders(self, store: KVService[Any], before: int, svc: str) -> None:
        await asyncio.sleep(SETTLE)
        self.expect(store.orders == before,
                    f"{svc} received {store.orders - before} apply order(s); expected none")

    async def outcome(self, client: MeshClient, pid: str) -> ApplyOutcome:
        return await self.wait(f"the apply outcome of {short(pid)}", lambda: client.outcome(pid))
