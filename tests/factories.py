"""Builders for wire messages used across the end-to-end tests."""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgspec

from improved.protocol import subjects
from improved.protocol.model import (
    AnalyzerRef,
    ApplyOrder,
    ApplyResult,
    Origin,
    Proposal,
    Signal,
    Summary,
    to_json,
)

_clock = itertools.count(1)


def unique_ms() -> int:
    """A creation time unique within the session, so equal-looking proposals differ."""
    return 1_768_471_200_000 + next(_clock)


def rank_proposal(svc: str, key: str = "search.title_boost", value: Any = 1.5,
                  change_class: str = "L0", **over: Any) -> Proposal:
    fields: dict[str, Any] = dict(
        service=svc,
        target_ref=f"rank:{key}",
        change_class=change_class,
        scope="knowledge",
        origin=Origin(actor=f"mcp:{svc}-agent:1", service=svc),
        analyzer=AnalyzerRef(id="acme.tuner/1"),
        summary=Summary(template_id="adjust_rank", args={"item": key, "delta": value}),
        proposal_data={"set": {"key": key, "value": value}},
        created_at=unique_ms(),
    )
    fields.update(over)
    return Proposal(**fields)


def skill_proposal(svc: str, name: str = "summarize", change_class: str = "L2",
                   instructions: str = "Read the text, then write three bullet points.",
                   **over: Any) -> Proposal:
    fields: dict[str, Any] = dict(
        service=svc,
        target_ref=f"skill:{name}",
        change_class=change_class,
        scope="knowledge",
        origin=Origin(actor=f"mcp:{svc}-agent:1", service=svc),
        analyzer=AnalyzerRef(id="acme.skills/1"),
        summary=Summary(template_id="new_skill", args={"name": name}),
        proposal_data={"skill": {"name": name, "description": "summarise a text",
                                 "instructions": instructions}},
        created_at=unique_ms(),
    )
    fields.update(over)
    return Proposal(**fields)


def signal(svc: str, actor: str, positive: bool = True, kind: str = "refine",
           proposal_id: str | None = None, **over: Any) -> Signal:
    return Signal(kind=kind, actor=actor, service=over.pop("service", svc), positive=positive,
                  at=over.pop("at", int(time.time() * 1000)), proposal_id=proposal_id, **over)


def as_result(data: bytes) -> ApplyResult:
    """The reply as an ApplyResult; an error reply ("not now": the daemon would retry) reads
    as a failed one here, with its message."""
    body = msgspec.json.decode(data)
    if isinstance(body.get("error"), dict):
        return ApplyResult(ok=False, error=body["error"]["message"])
    return msgspec.convert(body, type=ApplyResult)


async def send(nc, svc: str, o: ApplyOrder | bytes) -> tuple[ApplyResult, bytes]:
    """One ApplyOrder sent by hand to `<svc>.improve.apply`: (its reply as a result, raw)."""
    body = o if isinstance(o, bytes) else to_json(o)
    reply = await nc.request(subjects.apply_request(svc), body, timeout=5)
    return as_result(reply.data), reply.data


def crash_once_after_the_write(store) -> None:
    """Make a reference store crash once between writing a value and completing its ledger
    entry, as a process dying at the worst moment would."""
    real = store.ledger.update
    calls = 0

    async def crash_once(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("crashed after the write")
        return await real(*args, **kwargs)

    store.ledger.update = crash_once
