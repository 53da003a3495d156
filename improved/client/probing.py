"""What the conformance kit's probes share: a check's verdict, and asking a live service over
NATS without ever raising (no responders, a timeout, a reply that is not JSON are answers
too: the kit reports them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.errors import NoRespondersError

from improved.protocol.model import to_json

SHOWN = 200  # characters of a reply quoted in a detail


@dataclass(frozen=True)
class Check:
    """One thing the kit looked at. `probed` False: it could not look (the detail says why);
    such a check neither passes nor fails its level."""

    level: str
    name: str
    passed: bool
    detail: str
    probed: bool = True

    @property
    def failed(self) -> bool:
        return self.probed and not self.passed


def unprobed(level: str, name: str, why: str) -> Check:
    return Check(level, name, False, why, probed=False)


@dataclass(frozen=True)
class Answer:
    value: Any = None  # the decoded JSON reply
    problem: str | None = None  # why there is none: no responders, a timeout, not JSON
    raw: bytes = b""  # the reply's bytes as they came

    @property
    def answered(self) -> bool:
        return self.problem is None


async def ask(nc: Client, subject: str, body: Any, timeout: float) -> Answer:
    """Request `subject` with `body` (JSON) and decode the reply; never raises."""
    try:
        msg = await nc.request(subject, to_json(body), timeout=timeout)
    except NoRespondersError:
        return Answer(problem=f"no answer on {subject} (no responders)")
    except TimeoutError:
        return Answer(problem=f"no answer on {subject} within {timeout:g}s")
    try:
        return Answer(value=msgspec.json.decode(msg.data), raw=msg.data)
    except msgspec.DecodeError:
        return Answer(problem=f"{subject} answered non-JSON: {show(msg.data)}", raw=msg.data)


def show(value: Any) -> str:
    """A reply (bytes or a value) as at most SHOWN characters of text, for a detail."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else \
        to_json(value).decode(errors="replace")
    return text if len(text) <= SHOWN else text[:SHOWN] + "…"


def error_of(reply: Any) -> dict[str, Any] | None:
    """The inner object of an error reply `{"error": {...}}`, else None."""
    inner = reply.get("error") if isinstance(reply, dict) else None
    return inner if isinstance(inner, dict) else None


def describe_error(err: dict[str, Any]) -> str:
    field = err.get("field")
    return f"{err.get('code')}: {err.get('message')}" + (f" (field {field})" if field else "")
