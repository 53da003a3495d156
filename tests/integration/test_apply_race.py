"""No apply the chain contradicts (issue 13, item 5).

Two daemon replicas share one server and its inbound consumer. An operator approves an L2 and
rejects it 150 ms later, while the owning service takes half a second to apply. Whichever
replica takes which act, the outcome must be one of exactly two, and the chain must say which:

- the reject is refused — `apply_in_flight` when the dispatch was recorded first (an
  `apply`/`dispatched` intent), else `not_awaiting_review` (an approved proposal is applied
  or expires, OMS has no approved → rejected; or the apply is recorded already) — the chain
  ends `applied` with its applied trailer, and the service applied the change; or
- the reject landed first (not since the approval is taken first and an approval is never
  rejected, but the check stays): the chain ends `rejected` and the service never saw an order.

Before the intent existed, the replica that sent the order lost the race to append its result:
in most rounds the service applied the change while the chain ended `rejected`, with no
applied trailer and no inverse to roll back with."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from improved.client.sdk import MeshClient
from improved.core import audit, signing
from improved.core.record import fold_status
from improved.core.trailers import refs_of
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import ApplyResult, Trailer
from improved.runtime import bus
from improved.runtime.audit_log import decode_trailer
from improved.runtime.daemon import Daemon
from improved.runtime.store import Store
from tests.bus import daemon_config, eventually, publish
from tests.factories import review, skill_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")

ROUNDS = 20
APPLY_S = 0.5  # the owning service's time to apply
REJECT_AFTER_S = 0.15  # the operator's change of mind


class SlowApplier:
    """An owning service that takes APPLY_S per order and applies each proposal id once
    (idempotent: a re-sent order gets the first answer)."""

    def __init__(self) -> None:
        self.orders: Counter[str] = Counter()
        self.applied: dict[str, ApplyResult] = {}

    async def __call__(self, order) -> ApplyResult:
        self.orders[order.proposal_id] += 1
        if order.proposal_id in self.applied:
            return self.applied[order.proposal_id]
        await asyncio.sleep(APPLY_S)
        skill = canonical.skill_identity(order.proposal.proposal_data["skill"])
        result = ApplyResult(ok=True, applied_id=skill, inverse={"retract": skill},
                             rollbackable=True)
        self.applied.setdefault(order.proposal_id, result)
        return self.applied[order.proposal_id]


async def _chain(nc, svc: str, pid: str) -> list[Trailer]:
    """The chain as trailers, once every hash and link of it verified."""
    bodies = [body for _, body in await Store(nc).read_chain(svc, pid)]
    assert audit.verify_chain(pid, bodies) is None
    return [decode_trailer(body) for body in bodies]


def _for_act(chain: list[Trailer], digest: str) -> Trailer | None:
    return next((t for t in chain if refs_of(t).get("act") == digest), None)


def _settled(chain: list[Trailer], approve: str, reject: str) -> bool:
    """Both acts are on the chain, and a recorded dispatch has its outcome."""
    if _for_act(chain, approve) is None or _for_act(chain, reject) is None:
        return False
    verdicts = [t.verdict for t in chain if t.to_stage == "apply"]
    return "dispatched" not in verdicts or "applied" in verdicts or "failed" in verdicts


async def _round(nc, client: MeshClient, applier: SlowApplier, svc: str, n: int) -> str:
    """One approve-then-reject race; returns how it ended ("applied" or "rejected"), after
    asserting that the chain and the service agree."""
    pid = (await client.propose(skill_proposal(svc, name=f"race{n}"))).proposal_id
    decision = await eventually(lambda: client.decision(pid))
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_operator")
    approve, reject = review(pid), review(pid, "reject", reason="changed my mind")
    await publish(nc, S.inbound_review(svc), approve)
    await asyncio.sleep(REJECT_AFTER_S)
    await publish(nc, S.inbound_review(svc), reject)
    a, r = signing.envelope_digest(approve), signing.envelope_digest(reject)

    async def settled():
        chain = await _chain(nc, svc, pid)
        return chain if _settled(chain, a, r) else None

    await eventually(settled, timeout=15)
    await asyncio.sleep(APPLY_S + 0.5)  # an order still on its way reaches the service
    chain = await _chain(nc, svc, pid)
    status, _ = fold_status(chain)
    verdicts = [(t.to_stage, t.verdict) for t in chain]
    received = applier.orders[pid] > 0
    where = f"round {n}: status {status}, service got {applier.orders[pid]} order(s), {verdicts}"
    if status == "applied":
        assert received and pid in applier.applied, where
        assert verdicts.count(("apply", "applied")) == 1, where
        assert ("triage", "reject") not in verdicts, where
        refused = _for_act(chain, r)
        assert refused is not None and refused.verdict == "refused", where
        assert refs_of(refused)["code"] in ("apply_in_flight", "not_awaiting_review"), where
        return "applied" + (":in_flight" if refs_of(refused)["code"] == "apply_in_flight" else "")
    assert status == "rejected", where
    assert not received, where
    assert ("apply", "applied") not in verdicts and ("apply", "dispatched") not in verdicts, where
    return "rejected"


@pytest.mark.slow  # half a minute of a deliberately slow service: with the fault suites
@pytest.mark.timeout(180)
async def test_approve_then_reject_with_two_replicas_and_a_slow_service(own_server):
    conns = [await bus.connect(own_server.url, f"race-replica-{i}") for i in range(2)]
    replicas = [Daemon(c, daemon_config()) for c in conns]
    nc = await bus.connect(own_server.url, "race-client")
    svc = "racesvc"
    try:
        for d in replicas:  # one after the other: the first creates the streams
            await d.start()
        client = MeshClient(nc, svc)
        applier = SlowApplier()
        await client.serve_apply(applier)
        endings: Counter[str] = Counter()
        failures: list[str] = []
        for n in range(ROUNDS):
            try:
                endings[await _round(nc, client, applier, svc, n)] += 1
            except AssertionError as exc:
                failures.append(str(exc).splitlines()[0])
        print(f"\nendings: {dict(endings)}; contradicted: {len(failures)} of {ROUNDS}")
        assert not failures, "\n".join(failures)
    finally:
        for d in replicas:
            await d.stop()
        for c in (*conns, nc):
            await bus.close(c)
