"""The reference mesh service that applies L0 changes: a ranking/config store in NATS KV.

It exists so the loop closes end to end, and to show what DESIGN §3.4 asks of an owning service:
validate proposal_data itself, apply each proposal id exactly once, answer a repeated order with
the first result while changing nothing, and hand back an inverse so the change can be undone.

Accepted proposal_data: `{"set": {"key": K, "value": scalar}}`, and `{"delete": K}` so that the
inverse this store hands out can itself be applied; the target is `rank:K`, `score:K`, `cache:K`
or `config:K`.

Exactly once and crash-safe by the ledger protocol of `services.kv_service`. The inverse restores
the value the write replaced: an unfinished order that has to write anew records the key's value
at that moment as its prior.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client

from improved.protocol import subjects as S
from improved.protocol.model import ApplyOrder, ApplyResult, MeasureRequest, Proposal, to_json
from improved_reference import kv_service
from improved_reference.kv_service import KVService, Refused

SCHEMES = ("rank", "score", "cache", "config")
# `[A-Za-z0-9_.-]+` without empty dot-tokens, which NATS KV keys cannot have.
KEY_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
MAX_KEY = 256
MAX_TEXT = 4096


@dataclass(frozen=True)
class Change:
    key: str
    op: str  # "set" | "delete"
    value: Any = None


def bucket_names(service: str) -> tuple[str, str]:
    """(values bucket, ledger bucket): `rank_<svc>` and `applies_<svc>`, `-` made `_`."""
    token = service.replace("-", "_")
    return f"rank_{token}", f"applies_{token}"


def _check_scalar(value: Any) -> None:
    if value is None:
        raise Refused("value null cannot be stored; remove a key with {\"delete\": key}")
    if isinstance(value, bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Refused("value must be a finite number")
        return
    if isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise Refused(f"a string value is limited to {MAX_TEXT} characters")
        return
    kind = "object" if isinstance(value, dict) else "array" if isinstance(value, list) else \
        type(value).__name__
    raise Refused(f"value must be a JSON scalar (string, number or boolean), not an {kind}")


def parse_change(proposal: Proposal) -> Change:
    """The one change a proposal asks of this store, or Refused naming what is wrong. Pure."""
    if proposal.proposal_cal is not None or proposal.proposal_edit is not None:
        raise Refused("this store applies proposal_data only, not proposal_cal or proposal_edit")
    scheme, _, rest = proposal.target_ref.partition(":")
    if scheme not in SCHEMES:
        raise Refused(f"unsupported target scheme {scheme + ':'!r}; this store applies "
                      + ", ".join(f"{s}:" for s in SCHEMES) + " targets")
    if len(rest) > MAX_KEY or not KEY_RE.match(rest):
        raise Refused(f"target key {rest!r} must match [A-Za-z0-9_.-]+ (dot-separated, no empty "
                      f"parts, at most {MAX_KEY} characters)")
    data = proposal.proposal_data
    if data is None:
        raise Refused('proposal_data is missing; expected {"set": {"key": ..., "value": ...}}')
    if set(data) == {"delete"}:
        key = data["delete"]
        if key != rest:
            raise Refused(f"delete key {key!r} does not match the target_ref's key {rest!r}")
        return Change(key=rest, op="delete")
    if set(data) != {"set"}:
        raise Refused('proposal_data must be {"set": {"key": ..., "value": ...}} (or '
                      f'{{"delete": key}}); got keys {sorted(data)}')
    body = data["set"]
    if not isinstance(body, dict) or set(body) != {"key", "value"}:
        got = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise Refused(f'proposal_data.set must be {{"key": ..., "value": ...}}; got {got}')
    key = body["key"]
    if key != rest:
        raise Refused(f"set key {key!r} does not match the target_ref's key {rest!r}")
    _check_scalar(body["value"])
    return Change(key=rest, op="set", value=body["value"])


class RankingStore(KVService[Change]):
    """Values in KV `rank_<svc>`, the per-proposal apply ledger in KV `applies_<svc>`."""

    KIND = "ranking store"

    def __init__(self, nc: Client, service: str, verify_acceptance: bool = False):
        self.values_bucket, ledger_bucket = bucket_names(service)
        super().__init__(nc, service, self.values_bucket, ledger_bucket, verify_acceptance)
        self.values_stream = self.stream

    def capabilities(self) -> dict[str, Any]:
        return {
            **self.surface(),
            "measure": S.measure_request(self.service),  # a metric is a key: the query names it
            "schemes": [f"{s}:" for s in SCHEMES],
            "proposal_data": ['{"set": {"key": K, "value": scalar}}', '{"delete": K}'],
            "buckets": {"values": self.values_bucket, "ledger": self.ledger_bucket},
        }

    async def measure(self, request: MeasureRequest) -> float:
        """Learn-back at review_after (`<svc>.improve.measure`): the current value of the key
        the request's query names (its metric's name when it has no query) — metrics this
        store keeps are keys like any other. Refused, naming why, when there is no such key
        or its value is not a number."""
        key = (request.query if request.query is not None else request.metric).strip()
        if len(key) > MAX_KEY or not KEY_RE.match(key):
            raise Refused(f"this store measures a key: {key[:80]!r} must match [A-Za-z0-9_.-]+")
        value = await self.value(key)
        if value is None:
            raise Refused(f"no value under {key!r} to measure {request.metric}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Refused(f"the value under {key!r} is not a number")
        return float(value)

    async def _serve(self) -> None:
        await super()._serve()
        self._subs.append(await self.client.serve_measure(self.measure))

    async def value(self, key: str) -> Any:
        """The key's current value, or None when it has none."""
        return (await self._current(key))[0]

    # -- applying (the protocol is kv_service's) -----------------------------------------------

    def _change(self, order: ApplyOrder) -> Change:
        return parse_change(order.proposal)

    def _new_entry(self, change: Change, prior: Any, prior_rev: int) -> dict[str, Any]:
        return {"key": change.key, "op": change.op, "value": change.value, "prior": prior,
                "prior_rev": prior_rev, "revision": None}

    def _rebase(self, entry: dict[str, Any], prior: Any, prior_rev: int) -> dict[str, Any]:
        return {**entry, "prior": prior, "prior_rev": prior_rev}

    async def _write(self, pid: str, entry: dict[str, Any], current: Any, prior_rev: int) -> int:
        """The value write, only on top of `prior_rev`, tagged with the proposal id."""
        delete = entry["op"] == "delete"
        data = b"" if delete else to_json(entry["value"])
        return await self._publish(entry["key"], data, prior_rev, pid, delete)

    def _result(self, entry: dict[str, Any]) -> ApplyResult:
        """The one result of a completed ledger entry: the same every time it is asked for."""
        key, prior = entry["key"], entry["prior"]
        inverse = {"delete": key} if prior is None else {"set": {"key": key, "value": prior}}
        return ApplyResult(ok=True, applied_id=f"{self.values_bucket}:{key}@{entry['revision']}",
                           inverse=inverse, rollbackable=True)


async def run(url: str, service: str) -> int:
    return await kv_service.run(RankingStore, url, service)


def main(argv: list[str] | None = None) -> int:
    return kv_service.main(
        RankingStore, argv, "improved_reference.ranking_store",
        "Reference mesh service: applies L0 rank:/score:/cache:/config: changes ordered by "
        "improved into a NATS KV bucket, exactly once per proposal.")


if __name__ == "__main__":
    sys.exit(main())
