"""Read models of the terminal: what `review`, `status` and `audit rebuild` show, read
from the retained records, the state cache or the audit chains. Nothing here changes anything."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from nats.js.errors import BucketNotFoundError, NotFoundError

from improved.cli.common import deployment
from improved.core import authority
from improved.core.policy import Policy
from improved.protocol import subjects as S
from improved.runtime.bus import Target
from improved.runtime.store import Store, decode_trailer


async def review_queue(url: str | Target, policy: Policy | None = None) -> list[dict[str, Any]]:
    """What `improved review` lists: every proposal waiting for an operator or a quorum
    (`authority.is_waiting`) and every surfaced L1 proposal, oldest first."""
    queue, _ = await review_view(url, policy or Policy())
    return queue


async def review_view(url: str | Target, policy: Policy) -> tuple[list[dict[str, Any]], str]:
    """The review queue, and where it was read: `cache` or `chains`."""
    async with deployment(url, bind=False) as store:
        records, source = await current_records(store, policy)
        queue = []
        for record in records:
            d, p = record.decision, record.proposal
            surfaced = (record.status == "pending" and record.superseded_by is None
                        and d is not None and d.verdict == "accept" and record.gate_class == "L1")
            if not (surfaced or authority.is_waiting(record)):
                continue
            queue.append({
                "proposal_id": record.proposal_id, "service": record.service,
                "summary": record.summary_text,
                "votes": [f"{b.vote} by {b.voter} ({b.session})" for b in record.ballots],
                "constitution_edit": p.amends,
                "class": p.change_class, "gate": record.gate_class, "target": p.target_ref,
                "cause": "surfaced" if surfaced else d.cause, "rationale": d.rationale,
                "scope": p.scope,
                "origin": p.origin.actor, "analyzer": p.analyzer.id, "skill": record.skill,
                "signals": {"counted": len(record.signals), "positive": record.positives,
                            "independent_positive": record.independent_positives},
                "evidence": {"derived_from": len(p.derived_from or ()),
                             "evidence_query": p.evidence_query,
                             "metric": msgspec.to_builtins(p.metric_snapshot)
                             if p.metric_snapshot else None},
                "target_files": p.target_files or [], "valid_to": p.valid_to,
                "waiting_since": d.at,
                "will_run": authority.will_run(p),
                "will_run_digest": authority.will_run_digest(p),
            })
        return sorted(queue, key=lambda q: q["waiting_since"]), source


async def current_records(store: Store, policy: Policy) -> tuple[list, str]:
    """Every proposal's current record: from the state cache when a complete refill marked it
    whole (`Store.filled`), else rebuilt from the audit chains — after a broker restart the
    cache starts empty, and the first records to land in it are not all there is."""
    try:
        await store.bind()
        whole = await store.filled()
    except (BucketNotFoundError, NotFoundError):
        whole = False
    if whole:
        return await store.cached_records(), "cache"
    from improved.core.propose import rebuild_record

    records = []
    for (svc, _), entries in (await store.sequenced_chains()).items():
        if svc in S.MESH_CHAINS:
            continue
        try:
            trailers = [decode_trailer(body) for _, body in entries]
            records.append(rebuild_record(trailers, [seq for seq, _ in entries], policy))
        except (ValueError, KeyError, msgspec.MsgspecError):
            continue  # not replayable: `improved audit verify` names it
    return records, "chains"


async def status_view(url: str | Target) -> dict[str, Any]:
    from improved.core import breaker

    async with deployment(url, bind=False) as store:
        _, body = await store.chain_head(S.autonomy_audit(breaker.AUTONOMY_ID))
        state = breaker.from_trailer(body)
        now = int(time.time() * 1000)
        records = await store.js.stream_info(S.STREAM_RECORDS)
        chains = await store.js.stream_info(S.STREAM_AUDIT)
        return {
            "autonomy": state.switch,
            "breaker": ("open until " + when(state.paused_until)
                        if state.blocks(now) == "circuit_open" else "closed"),
            "autonomous_rollbacks_in_window": len(state.rollbacks),
            "holds_autonomous_applies": state.blocks(now),
            "crisis": state.crisis or None,  # while set, no apply at all (resolve it, signed)
            "trailers": chains.state.messages,
            "retained_records": records.state.messages,
        }


def when(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))
