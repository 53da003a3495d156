"""A revoked L3 grant never dispatches (issue 29, "Revocation is ordered against dispatch").

Two daemon replicas share one server and its inbound consumer. A skill is applied at L2 and
granted; then a burst of L3 proposals of that skill arrives while the owning service takes a
while per order, and the operator's revocation is published in the middle of the burst.

Every trailer of IMPROVE_AUDIT has a stream sequence, one order across the proposal chains and
the grant chain. The rule: an intent (`apply`/`dispatched`) counts only if the grant was active
as of its own stream sequence. So for every proposal: if it was applied, the `dispatched`
trailer its outcome answers sits below the grant chain's `revoke`; an intent above the revoke
is withdrawn (re-gated as L2) and its order never reaches the service.

Before the rule the daemon read the grant, then appended the intent to the proposal's own
chain: a revoke landing on the grant chain in between did not conflict with that append, and
orders went out under the revoked grant: in two runs of ten rounds, 20 of 192 and 22 of 187
applies answered an intent recorded after the revoke (1 to 3 a round)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from improved.client.sdk import MeshClient, enqueue
from improved.core import propose
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import AnalyzerRef, ApplyResult, Trailer, to_json
from improved.runtime import bus
from improved.runtime.audit_log import decode_trailer
from improved.runtime.daemon import Daemon
from improved.runtime.store import Store
from tests.bus import applied_at_l2, daemon_config, eventually, publish, whole_log_breaks
from tests.factories import grant, skill_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")

BURST = 40  # L3 proposals of one skill per round
REVOKE_AFTER = BURST // 2  # the revocation goes out with the burst's second half
APPLY_S = 0.2  # the owning service's time per order


class SlowApplier:
    """An owning service that takes APPLY_S per order, several orders at once, and applies
    each proposal id once (a re-sent order gets the first answer)."""

    def __init__(self, client: MeshClient) -> None:
        self.client = client
        self.orders: Counter[str] = Counter()
        self.applied: dict[str, ApplyResult] = {}
        self._tasks: set[asyncio.Task] = set()

    async def apply(self, order) -> ApplyResult:
        self.orders[order.proposal_id] += 1
        if order.proposal_id not in self.applied:
            await asyncio.sleep(APPLY_S)
            skill = canonical.skill_identity(order.proposal.proposal_data["skill"])
            self.applied.setdefault(order.proposal_id, ApplyResult(
                ok=True, applied_id=skill, inverse={"retract": skill}, rollbackable=True))
        return self.applied[order.proposal_id]

    async def serve(self, nc):
        async def answer(msg) -> None:
            await msg.respond(to_json(await self.client.answer(msg.data, self.apply)))

        async def on_order(msg) -> None:  # each order in a task of its own: they overlap
            task = asyncio.ensure_future(answer(msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return await nc.subscribe(S.apply_request(self.client.service), cb=on_order)


async def _chain(nc, subject: str) -> list[tuple[int, Trailer]]:
    """(stream sequence, trailer) of every trailer on `subject`."""
    return [(seq, decode_trailer(body)) for seq, body in await Store(nc).read_chain_at(subject)]


def _settled(chain: list[tuple[int, Trailer]]) -> bool:
    """Its outcome recorded, or deferred with no dispatch open."""
    open_intent = False
    last_triage = None
    for _, t in chain:
        if t.to_stage == "apply" and t.verdict == "dispatched":
            open_intent = True
        elif t.to_stage == "apply" and t.verdict in ("applied", "failed", "undelivered"):
            open_intent = False
            if t.verdict != "undelivered":
                return True
        elif t.to_stage == "triage" and t.verdict in ("accept", "defer", "reject"):
            open_intent = False
            last_triage = t
    return not open_intent and last_triage is not None and last_triage.verdict != "accept"


async def _round(nc, applier: SlowApplier, svc: str, n: int) -> tuple[int, int, int, list[str]]:
    """One burst with a revocation in its middle: (applied, applied after the revoke,
    withdrawn intents, what went wrong)."""
    name = f"burst{n}"
    first = skill_proposal(svc, name=name, change_class="L3")
    l2 = await applied_at_l2(nc, first)
    identity = canonical.skill_identity(first.proposal_data["skill"])
    sha = identity.split(":", 1)[1]
    await publish(nc, S.GRANTS, grant(identity, proposal=l2))

    async def granted():
        return any(t.verdict == "grant" for _, t in await _chain(nc, S.grant_audit(sha)))

    await eventually(granted)
    # one skill, one definition: distinct analyzers give each its own dedup_key
    burst = [skill_proposal(svc, name=name, change_class="L3",
                            analyzer=AnalyzerRef(id=f"acme.burst{n}x{i}/1"))
             for i in range(BURST)]
    pids = [propose.identify(p)[0] for p in burst]
    js = nc.jetstream()
    # straight into the inbound stream, in one go: both replicas take them in batches, and
    # the revocation is taken among them
    for i, p in enumerate(burst):
        if i == REVOKE_AFTER:
            await publish(nc, S.GRANTS, grant(identity, op="revoke"))
        await enqueue(js, svc, to_json(p), pids[i])

    async def revoke_seq():
        return next((seq for seq, t in await _chain(nc, S.grant_audit(sha))
                     if t.verdict == "revoke"), None)

    revoked_at = await eventually(revoke_seq)

    async def all_settled():
        chains = {pid: await _chain(nc, S.audit(svc, pid)) for pid in pids}
        return chains if all(_settled(c) for c in chains.values()) else None

    chains = await eventually(all_settled, timeout=60)
    await asyncio.sleep(APPLY_S + 0.3)  # an order still on its way reaches the service
    applied = late = withdrawn = 0
    problems: list[str] = []
    for pid in pids:
        chain = chains[pid]
        what = f"{pid[:12]} (revoke at {revoked_at}): {[(seq, t.verdict) for seq, t in chain]}"
        intents = [seq for seq, t in chain if t.to_stage == "apply" and t.verdict == "dispatched"]
        void = [seq for (seq, t), (_, u) in zip(chain, chain[1:], strict=False)
                if t.verdict == "dispatched" and u.to_stage == "triage"]
        withdrawn += len(void)
        if any(seq < revoked_at for seq in void):
            problems.append(f"an intent before the revoke was withdrawn: {what}")
        if applier.orders[pid] and not any(seq < revoked_at for seq in intents):
            problems.append(f"the service got an order under no intent before the revoke: "
                            f"{what}")
        outcome = next((seq for seq, t in chain if t.to_stage == "apply"
                        and t.verdict in ("applied", "failed")), None)
        if outcome is None:
            if applier.orders[pid]:
                problems.append(f"the service got an order the chain has no outcome of: {what}")
            continue
        applied += 1
        if max(seq for seq in intents if seq < outcome) > revoked_at:
            late += 1
            problems.append(f"applied under an intent after the revoke: {what}")
    return applied, late, withdrawn, problems


async def _rounds(url: str, rounds: int) -> None:
    conns = [await bus.connect(url, f"revoke-replica-{i}") for i in range(2)]
    replicas = [Daemon(c, daemon_config()) for c in conns]
    nc = await bus.connect(url, "revoke-client")
    svc = "revokesvc"
    try:
        for d in replicas:  # one after the other: the first creates the streams
            await d.start()
        client = MeshClient(nc, svc)
        applier = SlowApplier(client)
        await applier.serve(nc)
        totals: Counter[str] = Counter()
        problems: list[str] = []
        for n in range(rounds):
            applied, late, withdrawn, wrong = await _round(nc, applier, svc, n)
            totals.update(applied=applied, late=late, withdrawn=withdrawn)
            print(f"\nround {n}: {applied} applied, {late} after the revoke, "
                  f"{withdrawn} intents withdrawn")
            problems += [f"round {n}: {p}" for p in wrong]
        print(f"\n{rounds} rounds: {dict(totals)}")
        assert not problems, "\n".join(problems[:25])
        # a withdrawn intent is a transition the lifecycle allows: every chain verifies
        assert not await whole_log_breaks(url)
    finally:
        for d in replicas:
            await d.stop()
        for c in (*conns, nc):
            await bus.close(c)


@pytest.mark.timeout(120)
async def test_no_order_leaves_under_a_grant_revoked_before_its_intent(own_server):
    await _rounds(own_server.url, 1)


@pytest.mark.slow  # ten bursts against a deliberately slow service
@pytest.mark.timeout(600)
async def test_ten_bursts_never_apply_after_the_revoke(own_server):
    await _rounds(own_server.url, 10)
