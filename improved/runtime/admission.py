"""What both ways into the daemon share — the inbound consumer and the request/reply
capabilities: a new proposal refused for a surface its service does not advertise, a signal
counted for the proposal it names, and a refused message logged, counted and recorded.
"""

from __future__ import annotations

import time

import structlog

from improved.core import apply as apply_stage
from improved.core import propose
from improved.protocol import subjects as S
from improved.protocol import wire
from improved.protocol.model import (
    Envelope,
    Proposal,
    Refusal,
    Signal,
)
from improved.runtime.engine import Engine, Handled
from improved.runtime.intake import Intake
from improved.runtime.store import Store
from improved.runtime.surfaces import Surfaces

log = structlog.get_logger("improved.daemon")


class ProposalUnknown(Exception):
    """A message names a proposal no chain of its service holds (yet)."""


class Admission:
    """The checks and records both ways in make, over the engine's passes."""

    def __init__(self, store: Store, engine: Engine, intake: Intake, surfaces: Surfaces):
        self.store = store
        self.engine = engine
        self.intake = intake
        self.surfaces = surfaces

    async def check_surface(self, svc: str, pid: str, proposal: Proposal) -> None:
        """WireError `no_surface` for a new proposal of a service that advertises it takes
        none; one already on a chain here is carried on (it was accepted before), and so is
        the reversal of an applied change (a way back is never refused)."""
        if apply_stage.rolls_back(proposal) is not None:
            return
        problem = propose.surface_problem(svc, await self.surfaces.spec(svc))
        if problem is not None and await self.engine.records.service_of(pid) is None:
            raise wire.WireError(wire.NO_SURFACE, problem, "service")

    async def count(self, svc: str, sig: Signal, env: Envelope | None, *,
                     republish: bool = False, fresh: bool = False,
                     dispatch: bool = True) -> Handled:
        """Count a signal that arrived on `svc`'s subject for the proposal it names, whichever
        service that proposal is of (a world signal comes on its emitter's own subject)."""
        owner = await self.engine.records.service_of(sig.proposal_id or "") or svc
        async with self.engine.trust.acting():  # a signed signal's key is checked, then recorded
            emitter, verified = self.engine.trust.emitter_of(svc, sig, env)
            return await self.intake.signal(owner, sig, republish, fresh, dispatch,
                                            emitter=emitter, envelope=verified)

    async def refuse(self, svc: str, subject: str, err: wire.WireError, size: int) -> None:
        log.warning("refused", subject=subject, code=err.code, field=err.field,
                    reason=err.message)
        self.engine.metrics.refused(err.code)
        try:
            await self.store.refuse(svc if S.SERVICE_RE.match(svc) else "_", Refusal(
                subject=subject, code=err.code, field=err.field, message=err.message,
                size=size, at=int(time.time() * 1000)))
        except Exception as exc:  # the refusal log is best effort; the refusal itself stands
            log.warning("could not record a refusal", error=str(exc))
