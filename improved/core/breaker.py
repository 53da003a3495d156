"""The circuit breaker of constitution IV.5 and the autonomy switch of IV.6, kept on a chain.

Every rollback of an autonomous apply (L0, or L3 under a grant) is a trailer on one mesh-wide
chain, `improve.audit._autonomy.<AUTONOMY_ID>`, and each trailer carries the whole state after
it: the autonomous rollbacks inside the window, the end of a pause, and the switch. So the
current state is the last trailer, and any reader can re-derive it by replaying the chain.
Pure: (state, event, policy, clock) → state.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, Literal

from improved.core.audit import Draft, draft_of
from improved.core.trailers import AutonomyState, TrailerDataError, body_as
from improved.protocol.model import Envelope, Held, ObserverType

AutonomyVerdict = Literal["rollback", "autonomy_on", "autonomy_off", "crisis", "crisis_resolved"]

AUTONOMY_ID = hashlib.sha256(b"improved autonomy").hexdigest()
DAY_MS = 24 * 3600 * 1000
HOUR_MS = 3600 * 1000


@dataclass(frozen=True)
class Autonomy:
    rollbacks: tuple[int, ...] = ()  # times of autonomous rollbacks inside the window
    paused_until: int = 0
    switch: str = "on"
    crisis: str = ""  # an unresolved crisis (a broken audit log): no apply at all until resolved

    def blocks(self, now: int) -> Held | None:
        """The triage cause that holds autonomous applies back now, if any."""
        if self.switch == "off":
            return "autonomy_off"
        if now < self.paused_until:
            return "circuit_open"
        return None

    def rollbacks_within(self, now: int, window_days: float) -> int:
        """The autonomous rollbacks that still count toward the breaker at `now`: the
        state keeps the window as of its last rollback, and the window moves on."""
        since = now - int(window_days * DAY_MS)
        return sum(1 for t in self.rollbacks if t > since)


def after_rollback(state: Autonomy, at: int, threshold: int, window_days: float,
                   pause_hours: float) -> Autonomy:
    """Count an autonomous rollback; trip the breaker at `threshold` within the window."""
    window = int(window_days * DAY_MS)
    recent = tuple(t for t in state.rollbacks if t > at - window) + (at,)
    paused = state.paused_until
    if len(recent) >= threshold:
        paused = max(paused, at + int(pause_hours * HOUR_MS))
    return dataclasses.replace(state, rollbacks=recent, paused_until=paused)


def switched(state: Autonomy, switch: str) -> Autonomy:
    return dataclasses.replace(state, switch=switch)


def in_crisis(state: Autonomy, crisis: str) -> Autonomy:
    return dataclasses.replace(state, crisis=crisis)


def believed(body: dict[str, Any] | None, seq: int, problem: str | None) -> Autonomy:
    """The state the autonomy chain's head (at stream sequence `seq`) says, believed only when
    it verifies (`problem` None): a head no trusted daemon wrote, or a resolution no operator
    signed, reads as a crisis (`unverified-autonomy-<seq>`) until the log is dealt with. What
    the daemon decides by and what `improved status` shows, alike."""
    try:
        state = from_trailer(body)
    except TrailerDataError:
        if not problem:
            raise
        state = Autonomy()
    if body and problem:
        return in_crisis(state, state.crisis or f"unverified-autonomy-{seq}")
    return state


def resolved(chain: list[dict[str, Any]], crisis: str) -> bool:
    """Whether the autonomy chain (trailer bodies, in order) records `crisis` as resolved."""
    for body in chain:
        try:
            data = body_as(AutonomyState, body)
        except TrailerDataError:
            continue
        if data.verdict == "crisis_resolved" and data.resolved == crisis:
            return True
    return False


@dataclass(frozen=True)
class Marks:
    """What an autonomy trailer names besides the state: the autonomous apply rolled back, or
    a resolution's signed act, its key and the crisis it clears."""

    proposal: str | None = None
    act: str | None = None
    keyid: str | None = None
    resolved: str | None = None


def draft(state: Autonomy, verdict: AutonomyVerdict, actor: str, observer: ObserverType,
          reason: str, marks: Marks | None = None, envelope: Envelope | None = None) -> Draft:
    marks = marks or Marks()
    return draft_of(AutonomyState(
        verdict=verdict, rollbacks=state.rollbacks, paused_until=state.paused_until,
        autonomy=state.switch, crisis=state.crisis, proposal=marks.proposal, act=marks.act,
        keyid=marks.keyid, resolved=marks.resolved),
        "learn-back", actor, observer, reason, envelope)


def from_trailer(body: dict[str, Any] | None) -> Autonomy:
    """The state a trailer of the autonomy chain records (the default for an empty chain);
    TrailerDataError when it records none."""
    if not body:
        return Autonomy()
    data = body_as(AutonomyState, body)
    return Autonomy(rollbacks=data.rollbacks, paused_until=data.paused_until,
                    switch=data.autonomy, crisis=data.crisis)
