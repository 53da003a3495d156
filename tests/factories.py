"""Builders for wire messages used across the end-to-end tests."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from improved.protocol import subjects
from improved.protocol.model import (
    ApplyOrder,
    ApplyResult,
    Signal,
    to_json,
)
from improved.testing import rank_proposal, skill_proposal, unique_ms  # noqa: F401


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
