"""The reference knowledge store: applies `proposal_cal` (CAL Tier-1 ADD / SUPERSEDE / REVERT)
with the OMS applier obligations (rules 8–9), into grains kept in NATS KV.

- **Under the approver's capability** (rule 8): the order's `authority` — the approving
  principal the daemon recorded with its dispatch, the policy principal for an auto-apply —
  must hold a writer grant for the recommendation's namespace (`--writer PRINCIPAL=NAMESPACE`,
  globs; default: any `operator:*` and `policy:*` principal, any namespace). The analyzer's
  identity is never consulted. Trust the authority to the bus, or bind it to the audit chain
  with `--verify-acceptance` (then an order is applied only if that principal's approval is
  on the chain).
- **Inside the recommendation's namespace** (rule 8): the proposal's `namespace` is where its
  writes land; an address or a `WHERE namespace = …` outside it is refused (E045).
- **Tier-1 quotas** (rule 9): MAX_ADD_PER_MINUTE 20, MAX_SUPERSEDE_PER_MINUTE 10,
  MAX_REVERT_PER_MINUTE 5 per namespace, counted in the namespace's state, so every instance
  of the store sees the same count.
- **A replayable inverse** derived at apply time: `{"cal_inverse": [steps], "namespace"}` with
  the addresses the batch actually wrote (`knowledge` module doc). The daemon's rollback sends
  it back as `proposal_data`, which this store applies like a batch (no quota), and returns
  that plan's own inverse.

Storage (`<svc>` with `-` made `_`): KV `know_<svc>` (history 64) holds one key per namespace,
`ns.<sha256 hex of the namespace>` → the namespace's state (grains by content address, the
index-layer fields, the last minute's writes), so a batch lands by one compare-and-set, all
or nothing; KV `knowapplies_<svc>` is the apply ledger (exactly once per proposal id, the
protocol of `kv_service`). A namespace lives in one KV value: this reference store suits up
to a few thousand grains per namespace (the broker's message size bounds it).

Accepted: target `entity:…` or `grain:…`, `namespace` set, and `proposal_cal`, or
`proposal_data: {"cal_inverse": [...], "namespace"?}` (an inverse this store handed out).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client

from improved.protocol import cal
from improved.protocol.model import ApplyOrder, ApplyResult, Proposal, to_json
from improved_reference import knowledge, kv_service
from improved_reference.kv_service import KVService, Refused

SCHEMES = ("entity", "grain")


@dataclass(frozen=True)
class Change:
    key: str  # the namespace's KV key
    namespace: str
    batch: str | None  # proposal_cal, or None for a plan
    plan: list[dict[str, Any]] | None
    proposal_id: str


def bucket_names(service: str) -> tuple[str, str]:
    """(grains bucket, ledger bucket): `know_<svc>` and `knowapplies_<svc>`."""
    token = service.replace("-", "_")
    return f"know_{token}", f"knowapplies_{token}"


def namespace_key(namespace: str) -> str:
    return "ns." + hashlib.sha256(namespace.encode()).hexdigest()


def parse_change(order: ApplyOrder, writers: tuple[tuple[str, str], ...]) -> Change:
    """The change an order asks of this store, or Refused naming what is wrong. Pure."""
    p: Proposal = order.proposal
    if p.proposal_edit is not None:
        raise Refused("this store applies proposal_cal (and its own inverse plans), not "
                      "proposal_edit")
    scheme = p.target_ref.partition(":")[0]
    if scheme not in SCHEMES:
        raise Refused(f"unsupported target scheme {scheme + ':'!r}; this store applies "
                      + ", ".join(f"{s}:" for s in SCHEMES) + " targets")
    ns = p.namespace
    if not ns:
        raise Refused("the recommendation names no namespace: a CAL batch writes only into "
                      "the namespace its recommendation inhabits (OMS rule 8)")
    if not knowledge.may_write(order.authority, ns, writers):
        raise Refused(f"E045: {order.authority} holds no capability to write namespace {ns!r}; "
                      "a batch runs under its approving principal's capability, never the "
                      "analyzer's (OMS rule 8)")
    if p.proposal_cal is not None:
        try:
            cal.parse(p.proposal_cal)
        except cal.CalError as exc:
            raise Refused(f"proposal_cal refused: {exc.code}: {exc.message}") from None
        return Change(namespace_key(ns), ns, p.proposal_cal, None, order.proposal_id)
    data = p.proposal_data
    if not isinstance(data, dict) or "cal_inverse" not in data or \
            not set(data) <= {"cal_inverse", "namespace"}:
        got = sorted(data) if isinstance(data, dict) else data
        raise Refused('expected proposal_cal, or proposal_data {"cal_inverse": [...]} (an '
                      f"inverse this store handed out); got proposal_data {got}")
    if data.get("namespace", ns) != ns:
        raise Refused(f"E045: the plan is for namespace {data['namespace']!r}, the "
                      f"recommendation inhabits {ns!r}")
    try:
        plan = knowledge.check_plan(data["cal_inverse"])
    except knowledge.Refused as exc:
        raise Refused(str(exc)) from None
    return Change(namespace_key(ns), ns, None, plan, order.proposal_id)


def outcome(change: Change, state: Any, now: int) -> knowledge.Outcome:
    """What the change makes of the namespace's current state, or Refused. Pure."""
    try:
        current = knowledge.empty() if state is None else knowledge.check_state(state)
        if change.batch is not None:
            return knowledge.execute(current, cal.parse(change.batch), change.namespace, now,
                                     change.proposal_id)
        assert change.plan is not None
        return knowledge.replay(current, change.plan, change.namespace, now)
    except knowledge.Refused as exc:
        raise Refused(str(exc)) from None


class KnowledgeStore(KVService[Change]):
    """Namespaces in KV `know_<svc>`, the apply ledger in `knowapplies_<svc>`."""

    KIND = "knowledge store"
    VALUES = "namespaces"

    def __init__(self, nc: Client, service: str, verify_acceptance: bool = False,
                 writers: tuple[tuple[str, str], ...] = knowledge.DEFAULT_WRITERS):
        self.grains_bucket, ledger_bucket = bucket_names(service)
        super().__init__(nc, service, self.grains_bucket, ledger_bucket, verify_acceptance)
        self.writers = writers

    def capabilities(self) -> dict[str, Any]:
        return {
            **self.surface(),
            "schemes": [f"{s}:" for s in SCHEMES],
            "proposal_cal": "CAL Tier-1 ADD / SUPERSEDE / REVERT, into the proposal's namespace",
            "proposal_data": ['{"cal_inverse": [steps], "namespace"?: NS}'],
            "quotas": {"MAX_ADD_PER_MINUTE": knowledge.MAX_ADD_PER_MINUTE,
                       "MAX_SUPERSEDE_PER_MINUTE": knowledge.MAX_SUPERSEDE_PER_MINUTE,
                       "MAX_REVERT_PER_MINUTE": knowledge.MAX_REVERT_PER_MINUTE},
            "writers": [f"{who}={where}" for who, where in self.writers],
            "buckets": {"grains": self.grains_bucket, "ledger": self.ledger_bucket},
        }

    # -- reading -------------------------------------------------------------------------------

    async def state(self, namespace: str) -> dict[str, Any]:
        current, _ = await self._current(namespace_key(namespace))
        return current if isinstance(current, dict) else knowledge.empty()

    async def recall(self, namespace: str, **where: Any) -> dict[str, dict[str, Any]]:
        """The live grains of the namespace (by address) whose fields equal `where`."""
        return {f"sha256:{h}": g for h, g in knowledge.live(await self.state(namespace)).items()
                if all(g.get(k) == v for k, v in where.items())}

    async def seed(self, namespace: str, batch: str) -> list[str]:
        """Apply a CAL batch outside the loop (an import, a demo's starting point); the
        addresses it wrote. The checks are the same, but no proposal and no ledger entry."""
        pid = hashlib.sha256(batch.encode()).hexdigest()
        change = Change(namespace_key(namespace), namespace, batch, None, pid)
        written: list[str] = []

        def make(current: Any) -> bytes:
            done = outcome(change, current, _now())
            written[:] = done.written
            return to_json(done.state)

        await self._store(change.key, make)
        return written

    # -- applying (the protocol is kv_service's) -----------------------------------------------

    def _change(self, order: ApplyOrder) -> Change:
        return parse_change(order, self.writers)

    def _new_entry(self, change: Change, current: Any, cur_rev: int) -> dict[str, Any]:
        done = outcome(change, current, _now())
        return {"key": change.key, "namespace": change.namespace, "batch": change.batch,
                "plan": change.plan, "proposal_id": change.proposal_id, "state": done.state, "inverse": done.inverse,
                "written": done.written, "prior_rev": cur_rev, "revision": None}

    def _rebase(self, entry: dict[str, Any], current: Any, cur_rev: int) -> dict[str, Any]:
        """An unfinished apply whose namespace moved is worked out again on what is there."""
        if entry["prior_rev"] == cur_rev:
            return entry
        change = Change(entry["key"], entry["namespace"], entry["batch"], entry["plan"],
                        entry["proposal_id"])
        return self._new_entry(change, current, cur_rev)

    async def _write(self, pid: str, entry: dict[str, Any], current: Any, cur_rev: int) -> int:
        return await self._publish(entry["key"], to_json(entry["state"]), cur_rev, pid)

    def _result(self, entry: dict[str, Any]) -> ApplyResult:
        written = ",".join(entry["written"]) or "inverse"
        return ApplyResult(ok=True, applied_id=f"{entry['namespace']}:{written}",
                           inverse={"cal_inverse": entry["inverse"],
                                    "namespace": entry["namespace"]},
                           rollbackable=True)


def _now() -> int:
    return int(time.time() * 1000)


def writers_of(specs: list[str]) -> tuple[tuple[str, str], ...]:
    """`PRINCIPAL=NAMESPACE` globs from the command line, or ValueError naming the bad one."""
    return tuple(kv_service.pairs("--writer", specs, "PRINCIPAL=NAMESPACE (globs allowed)"))


def main(argv: list[str] | None = None) -> int:
    module = "improved_reference.knowledge_store"
    description = ("Reference mesh service: applies CAL Tier-1 proposal_cal batches ordered by "
                   "improved into a namespace's grains in NATS KV, under the approving "
                   "principal's capability, within the namespace and the Tier-1 quotas, "
                   "exactly once per proposal, with a replayable inverse.")
    p = kv_service.parser(module, description)
    p.add_argument("--writer", action="append", default=[], metavar="PRINCIPAL=NAMESPACE",
                   help="let PRINCIPAL (a glob, e.g. operator:alice or policy:*) approve writes "
                        "into NAMESPACE (a glob); repeat; default: operator:*=* and policy:*=*")

    def setup(args: argparse.Namespace) -> kv_service.Setup | None:
        try:
            writers = writers_of(args.writer)
        except ValueError as exc:
            p.error(str(exc))
        if not writers:
            return None

        async def narrow(store: KVService[Any]) -> list[str]:
            assert isinstance(store, KnowledgeStore)
            store.writers = writers
            return ["writers " + ", ".join(f"{w}={n}" for w, n in writers)]
        return narrow

    return kv_service.main(KnowledgeStore, argv, module, description, p, setup)


if __name__ == "__main__":
    sys.exit(main())
