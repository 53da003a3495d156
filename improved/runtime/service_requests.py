"""The daemon's requests to a proposal's owning service — the ApplyOrder, the LKG check, the
measurement at review_after — each with a timeout and bounded retries. Every answer heard is
evidence (`client.answers`); what counts of them is the core's to say (`core.boundary`), and
what each says is `core.replies`'. All attempts unanswered: ServiceUnreachable, and the
proposal stays retryable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
import structlog
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from improved.client.answers import Answers
from improved.client.config import ApplySettings
from improved.core import boundary, learnback, lkg, replies
from improved.core.record import ProposalRecord
from improved.protocol import subjects as S
from improved.protocol.model import ApplyOrder, ApplyResult, MeasureRequest, to_json
from improved.runtime.telemetry import Tracing

log = structlog.get_logger("improved.engine")

# after a measurement's first attested answer, how long to listen for one that disagrees
CONFLICT_GRACE_S = 0.25

T = TypeVar("T")
A = TypeVar("A")
# Before each attempt of an order: (attempt, whether an earlier one may have been delivered);
# raises to stop the send (GrantRevoked).
Allowed = Callable[[int, bool], Awaitable[None]]


class GrantRevoked(Exception):
    """The grant an L3 auto-apply relies on was revoked before a retry of its order."""


class ServiceUnreachable(Exception):
    """The owning service did not answer the ApplyOrder; the proposal stays retryable.
    `maybe_delivered`: an attempt timed out, so the service may have received the order."""

    record: ProposalRecord | None = None

    def __init__(self, error: str, maybe_delivered: bool = True):
        super().__init__(error)
        self.maybe_delivered = maybe_delivered


class ServiceRequests:
    """Requests to owning services, over `answers`, under the `[apply]` timeout and attempts."""

    def __init__(self, answers: Answers, settings: ApplySettings,
                 tracing: Tracing | None = None):
        self.answers = answers
        self.settings = settings
        self.tracing = tracing or Tracing()

    async def lkg(self, record: ProposalRecord) -> boundary.Evidence[lkg.LkgReport]:
        """SPEC 09 §7.1: ask the owning service for a healthy last-known-good of every
        artefact; the planner turns the answer into the transition."""
        body = to_json(lkg.check_request(record))
        return await self.ask(record, S.lkg_request(record.service), lambda _: body,
                              replies.parse_lkg_reply, self.counting(record.service, lkg.LkgReport))

    async def measure(self, record: ProposalRecord,
                       request: MeasureRequest) -> boundary.Answer[learnback.Reading]:
        """Learn-back at review_after: ask the owning service for the metric (timeout, bounded
        retries while nothing answers). Any answer is final — a value, or an error reply or a
        malformed one as the cause; all attempts unanswered: that, as the cause. What counts
        is `boundary.choose`'s: attested answers, or a Conflict when they disagree."""
        body = to_json(request)

        def chosen(heard: list[boundary.Evidence[learnback.Reading]]
                   ) -> boundary.Answer[learnback.Reading] | None:
            return boundary.choose(heard)

        try:
            return await self.ask(record, S.measure_request(record.service), lambda _: body,
                                   replies.parse_measure_reply, chosen, grace=CONFLICT_GRACE_S)
        except ServiceUnreachable as exc:
            return boundary.Unattested(learnback.Reading(cause=str(exc)), "no answer")

    def counting(self, service: str, of: type[T]
                  ) -> Callable[[list[boundary.Evidence[T]]], boundary.Evidence[T] | None]:
        """What an apply or LKG check takes of the answers heard (`boundary.counting`)."""
        attestable = self.answers.attestable(service)
        return lambda heard: boundary.counting(heard, attestable)

    async def send(self, record: ProposalRecord, order: ApplyOrder,
                    allowed: Allowed | None = None) -> boundary.Evidence[ApplyResult]:
        """One order to the owning service: timeout, bounded retries, then ServiceUnreachable."""
        return await self.ask(
            record, S.apply_request(record.service),
            lambda attempt: to_json(msgspec.structs.replace(order, attempt=attempt)),
            replies.parse_apply_reply, self.counting(record.service, ApplyResult), allowed)

    async def ask(self, record: ProposalRecord, subject: str, body: Callable[[int], bytes],
                   parse: Callable[[bytes], T | None],
                   pick: Callable[[list[boundary.Evidence[T]]], A | None],
                   allowed: Allowed | None = None, grace: float = 0.0) -> A:
        """A request to the owning service with a timeout and bounded retries. Every answer
        heard is evidence (`Answers.ask`); `parse` turns each into a result, or None for an
        error reply ("not now"), and `pick` says which counts, or None (only "not now", or
        nothing attributable where something could be): retried. All attempts so:
        ServiceUnreachable (the proposal stays retryable). Traced, the request is a span
        whose `traceparent` header goes with every attempt."""
        if not self.tracing.on:
            return await self._ask(record, subject, body, parse, pick, allowed, grace, None)
        with self.tracing.request(record, subject) as headers:
            return await self._ask(record, subject, body, parse, pick, allowed, grace, headers)

    async def _ask(self, record: ProposalRecord, subject: str, body: Callable[[int], bytes],
                   parse: Callable[[bytes], T | None],
                   pick: Callable[[list[boundary.Evidence[T]]], A | None],
                   allowed: Allowed | None, grace: float,
                   headers: dict[str, str] | None) -> A:
        settings = self.settings
        last_error = "no attempt"
        maybe_delivered = False
        for attempt in range(1, settings.attempts + 1):
            if allowed is not None:
                await allowed(attempt, maybe_delivered)
            try:
                heard = await self.answers.ask(record.service, subject, body(attempt),
                                               settings.timeout_s, grace, headers)
            except NoRespondersError:
                last_error = f"no service answers {subject}"
            except NatsTimeout:
                last_error = f"{subject} timed out"
                maybe_delivered = True
            else:
                parsed = [e.map(parse) for e in heard]
                picked = pick(boundary.present(parsed))
                if picked is not None:
                    return picked
                last_error, silent = replies.unanswered(subject, heard, parsed)
                maybe_delivered = maybe_delivered or silent
            log.warning("request to the owning service failed", proposal_id=record.proposal_id,
                        subject=subject, attempt=attempt, error=last_error)
            await asyncio.sleep(min(0.1 * 2 ** attempt, 2.0))
        raise ServiceUnreachable(last_error, maybe_delivered)
