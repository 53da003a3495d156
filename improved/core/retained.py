"""The retained records a proposal's record shows watchers, each on its own subject of the records
stream: its state, its triage decision, its apply outcome and its learn-back summary. Said once,
for the daemon that publishes them after the chain moved (`runtime.publishing`) and for
`improved audit rebuild`, which compares them with the chain's and republishes them. Outputs
only: nothing decides on them.
"""

from __future__ import annotations

import msgspec

from improved.core import learnback
from improved.core.record import ProposalRecord, closed, state_of
from improved.protocol import subjects as S
from improved.protocol.model import ApplyOutcome, LearnBack, ProposalState, TriageDecision

Shown = ProposalState | TriageDecision | ApplyOutcome | LearnBack


def shown(record: ProposalRecord, now: int,
          since: ProposalRecord | None = None) -> list[tuple[str, Shown]]:
    """(subject, record) of each retained record `record` shows, its state's status as of
    `now` (`state_of`); with `since` (the record they were last shown for) the state and only
    those others that changed since. The quorum record is not among them: it is immutable,
    published once (`quorum.quorum_record`)."""
    svc, pid = record.service, record.proposal_id
    out: list[tuple[str, Shown]] = [(S.proposal_state(svc, pid), state_of(record, now))]
    if record.decision is not None and (since is None or record.decision != since.decision):
        out.append((S.triage_decision(svc, pid), record.decision))
    if record.outcome is not None and (since is None or record.outcome != since.outcome):
        out.append((S.apply_outcome(svc, pid), record.outcome))
    if (len(record.signals) > len(record.proposal.signals or ())
            or record.measured is not None) and (
            since is None or record.signals != since.signals
            or record.measured != since.measured):
        out.append((S.learn_back(svc, pid), learnback.summary(record, record.updated_at)))
    return out


def ttl_of(record: ProposalRecord, records_ttl_s: int) -> int | None:
    """The TTL each retained record of `record` carries: `records_ttl_s` once the proposal is
    closed (`closed`; 0 keeps them for good), none while it is open."""
    return records_ttl_s if records_ttl_s and closed(record) else None


def states(record: ProposalRecord, now: int) -> tuple[ProposalState, ProposalState]:
    """The ProposalStates `record` may be showing: as of `now`, and with the chain's own status
    (one shown before `valid_to` passed; the daemon records the expiry at its first pass
    after it)."""
    state = state_of(record, now)
    return state, msgspec.structs.replace(state, status=record.status)
