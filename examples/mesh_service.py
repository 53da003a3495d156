"""A complete mesh service in one file: it connects, advertises what it takes, serves its
applies with an inverse, proposes an L0 change to itself, waits until the daemon applied it,
and prints the outcome (docs/services.md walks through it).

    python examples/mesh_service.py --service mysvc [--nats URL] [--key value] [--value 1.5]

The service holds ranking weights in memory. Against a running `improved run`; on a bus with
users, give it one (`improved accounts add-service mysvc`) and export the two variables that
command prints. Exit 0 when applied, 1 when the daemon said no, 2 when it could not run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from improved import (
    AnalyzerRef,
    ApplyOrder,
    ApplyResult,
    ImproveError,
    MeshClient,
    Origin,
    Proposal,
    Summary,
    failed,
    serve_spec,
)
from improved.client import connection


class Weights:
    """The service's own state, and the one apply handler: idempotent on the proposal id."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.done: dict[str, ApplyResult] = {}  # proposal id → its one result

    async def apply(self, order: ApplyOrder) -> ApplyResult:
        if order.proposal_id in self.done:  # a redelivered order: same answer, no change
            return self.done[order.proposal_id]
        data = order.proposal.proposal_data or {}
        key = order.proposal.target_ref.partition(":")[2]
        if set(data) == {"set"} and data["set"].get("key") == key:
            value = data["set"].get("value")
        elif data == {"delete": key}:  # the inverse of a first set, replayed by a rollback
            value = None
        else:
            return failed(f"expected {{'set': {{'key': {key!r}, 'value': N}}}}, got {data}")
        prior = self.values.pop(key, None)
        if value is not None:
            self.values[key] = float(value)
        inverse = {"delete": key} if prior is None else {"set": {"key": key, "value": prior}}
        result = ApplyResult(ok=True, applied_id=f"{key}@{len(self.done) + 1}",
                             inverse=inverse, rollbackable=True)
        self.done[order.proposal_id] = result
        return result


def rank_change(service: str, key: str, value: float) -> Proposal:
    """An L0 proposal: a ranking weight, applied by the daemon with no one asked."""
    return Proposal(
        service=service, target_ref=f"rank:{key}", change_class="L0", scope="knowledge",
        origin=Origin(actor=f"{service}:tuner", service=service),
        analyzer=AnalyzerRef(id="example.tuner/1"),
        summary=Summary(template_id="adjust_rank", args={"item": key, "delta": value}),
        proposal_data={"set": {"key": key, "value": value}},
        created_at=int(time.time() * 1000))


async def main(args: argparse.Namespace) -> int:
    nc = await connection.connect(connection.target(args.nats), f"example-{args.service}",
                                  persistent=False)
    try:
        weights = Weights()
        client = MeshClient(nc, args.service)
        await client.serve_apply(weights.apply)
        await serve_spec(nc, args.service, {
            "service": args.service, "improve": True, "schemes": ["rank:"],
            "apply": f"{args.service}.improve.apply"})
        change = rank_change(args.service, args.key, args.value)

        async def sample() -> Proposal:  # `improved conformance` asks what it proposes (L1)
            return change

        await client.serve_conformance(sample)
        reply = await client.propose(change)
        print(f"proposed {reply.proposal_id} ({reply.status})")
        deadline = time.monotonic() + args.timeout
        while (outcome := await client.outcome(reply.proposal_id)) is None:
            decision = await client.decision(reply.proposal_id)
            if decision is not None and decision.verdict != "accept":
                print(f"not applied: {decision.verdict}/{decision.cause}: {decision.rationale}")
                return 1
            if time.monotonic() > deadline:
                print(f"not applied within {args.timeout:g}s", file=sys.stderr)
                return 1
            await asyncio.sleep(0.2)
        shown = {"ok": outcome.ok, "applied_id": outcome.applied_id,
                 "authority": outcome.authority, "inverse": outcome.inverse}
        print(f"applied: {json.dumps(shown)}" if outcome.ok else f"failed: {outcome.error}")
        print(f"{args.key} = {weights.values.get(args.key)}")
        return 0 if outcome.ok else 1
    finally:
        await nc.drain()


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--service", default="mysvc", help="the service's name (default mysvc)")
    p.add_argument("--nats", default=os.environ.get("IMPROVED_NATS_URL",
                                                    "nats://127.0.0.1:4222"))
    p.add_argument("--key", default="search.title_boost", help="the weight to change")
    p.add_argument("--value", type=float, default=1.5)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the apply")
    args = p.parse_args(argv)
    try:
        return asyncio.run(main(args))
    except KeyboardInterrupt:
        return 130
    except ImproveError as exc:  # the daemon refused the proposal, naming the field
        print(f"mesh_service: refused: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # nobody at the URL, a refused proposal: one line, no traceback
        print(f"mesh_service: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
