"""The signed quorum for L4 (SPEC 09 §6, DESIGN §5.4), off unless `policy.quorum`.

Pure. Three approvals from distinct keys of non-correlated sessions approve; one dissent defers
to an operator (quorum is not majority rule). What never adds up: the same key twice, two keys
of one session, the proposer (its service, its agents, the name its origin declares, its
session), a vote whose reads do not name the digests of what is on the chain — the proposal,
its body, its triage record — and the SPEC version. Every vote leaves a trailer — counted, or refused with
its reason — and the decision is a trailer of its own; the QuorumRecord is then retained, once.
"""

from __future__ import annotations

from improved.core import identity
from improved.core.audit import REASON_LIMIT, Draft, draft_of
from improved.core.authority import Act, refusal, will_run_digest
from improved.core.guards import session_of
from improved.core.record import ProposalRecord
from improved.core.signing import Verified
from improved.core.trailers import Decided, QuorumReached, Voted
from improved.protocol import canonical
from improved.protocol.model import QuorumBallot, QuorumRecord, TriageDecision, Vote

SIZE = 3
REQUIRED_READS = ("proposal", "diff", "triage", "spec")
SPEC_VERSION = "09"  # the SPEC a voter reads the rules in (`spec:09`)


def decision_digest(d: TriageDecision) -> str:
    """The triage record a voter reads, in the part a rebuild from the chain gives back."""
    return canonical.digest({"proposal_id": d.proposal_id, "verdict": d.verdict,
                             "cause": d.cause, "gate_class": d.gate_class,
                             "rationale": d.rationale[:REASON_LIMIT]})


def expected_reads(record: ProposalRecord) -> list[str]:
    """The `read` a vote on `record` must carry: one entry per REQUIRED_READS kind."""
    d = record.decision
    return [f"proposal:{record.proposal_id}", f"diff:{will_run_digest(record.proposal)}",
            f"triage:{decision_digest(d) if d is not None else ''}", f"spec:{SPEC_VERSION}"]


def is_open(record: ProposalRecord) -> bool:
    d = record.decision
    return (record.status == "pending" and record.superseded_by is None and d is not None
            and d.verdict == "defer" and d.cause == "awaiting_quorum")


def unread(vote: Vote, record: ProposalRecord) -> list[str]:
    """What the vote does not show it read (SPEC 09 §6): each REQUIRED_READS kind, named by the
    digest of what is on the chain; a digest of anything else is not a read of this."""
    said = {r.split(":", 1)[0]: r for r in vote.read}
    problems = []
    for expected in expected_reads(record):
        kind = expected.split(":", 1)[0]
        if kind not in said:
            problems.append(kind)
        elif said[kind] != expected:
            problems.append(f"{expected} (it read {said[kind]!r})")
    return problems


def proposer_votes(vote: Vote, record: ProposalRecord) -> bool:
    """The proposer never votes: its service or one of its agents, or the name its origin
    declares, whatever session it writes."""
    origin = record.proposal.origin.actor
    proposer = identity.Proposer(record.service, record.proposal.origin.service)
    return (identity.same_party(vote.voter, proposer)
            or vote.voter == origin.split(":", 1)[0] or vote.voter == origin)


def count(record: ProposalRecord, act: Act, verified: Verified, vote: Vote, sig: str,
          actor: str) -> Draft:
    """A verified vote: counted (a `vote` trailer) or refused with the rule it broke."""

    def refuse(code: str, why: str) -> Draft:
        return refusal(record, act, code, why, actor, verified.keyid)

    if vote.proposal_id != record.proposal_id:
        return refuse("wrong_proposal", f"the vote is for {vote.proposal_id}")
    if not is_open(record):
        d = record.decision
        return refuse("closed", f"no quorum is open (status {record.status}"
                      + (f", triage {d.verdict}/{d.cause}" if d else "") + ")")
    if proposer_votes(vote, record):
        return refuse("proposer", f"{vote.voter} is the proposer ({record.service}, "
                      f"{record.proposal.origin.actor}): it never votes on its own proposal")
    missing = unread(vote, record)
    if missing:
        return refuse("unread", "a voter must have read what is on the chain: "
                      + ", ".join(missing))
    session = session_of(vote.session)
    if session == session_of(record.proposal.origin.actor):
        return refuse("proposer_session", "the proposer's own session never counts")
    if any(b.keyid == verified.keyid for b in record.ballots):
        return refuse("same_key", f"{verified.keyid} has voted already")
    if any(b.session == session for b in record.ballots):
        return refuse("correlated_session", f"session {session} has voted already (with "
                      "another key): correlated votes count once")
    approvals = sum(1 for b in record.ballots if b.vote == "approve") + (vote.vote == "approve")
    reason = (f"{vote.vote} by {vote.voter} (session {session}): {approvals} of {SIZE} "
              "approvals")[:REASON_LIMIT]
    return draft_of(Voted(act=act.digest, act_seq=act.stream_seq, keyid=verified.keyid,
                          session=session, vote=vote.vote, voted_at=vote.at, sig=sig,
                          read=tuple(vote.read)),
                    record.stage, vote.voter, "rec:agent", reason, verified.envelope)


def authority_of(record: ProposalRecord) -> str:
    """The principal an approved quorum's apply runs under (an Actor id)."""
    return f"quorum:{record.proposal_id[:16]}"


def decided(record: ProposalRecord, actor: str) -> Draft | None:
    """One dissent defers to the operator; three approvals approve; else still open."""
    if not is_open(record) or not record.ballots:
        return None
    dissent = [b for b in record.ballots if b.vote == "dissent"]
    approvals = [b for b in record.ballots if b.vote == "approve"]
    voters = ", ".join(b.voter for b in record.ballots)
    if dissent:
        reason = (f"{dissent[0].voter} dissents: deferred to an operator (quorum is not "
                  f"majority rule; voters {voters})")[:REASON_LIMIT]
        return draft_of(Decided(verdict="defer", cause="quorum_dissent"), record.stage, actor,
                        "rec:system", reason)
    if len(approvals) < SIZE:
        return None
    by = authority_of(record)
    reason = f"approved by a quorum of {len(approvals)}: {voters}"[:REASON_LIMIT]
    return draft_of(QuorumReached(authority=by, keyid=tuple(b.keyid for b in approvals)),
                    record.stage, by, "rec:agent", reason)


def outcome_of(record: ProposalRecord) -> str | None:
    """`approved` or `deferred` once the quorum decided; None while open (or never held)."""
    if record.approved_by is not None and record.approved_by == authority_of(record):
        return "approved"
    d = record.decision
    if d is not None and d.cause == "quorum_dissent":
        return "deferred"
    return None


def quorum_record(record: ProposalRecord) -> QuorumRecord | None:
    outcome = outcome_of(record)
    if outcome is None:
        return None
    decision = record.decision
    if decision is None:  # a quorum outcome is always a decision of its own
        raise ValueError(f"{record.proposal_id}: a quorum outcome without a decision")
    votes = [QuorumBallot(voter=b.voter, keyid=b.keyid, session=b.session, vote=b.vote,
                          read=list(b.read), at=b.at, sig=b.sig) for b in record.ballots]
    return QuorumRecord(proposal_id=record.proposal_id, service=record.service, outcome=outcome,
                        approvals=sum(1 for b in record.ballots if b.vote == "approve"),
                        dissents=sum(1 for b in record.ballots if b.vote == "dissent"),
                        votes=votes, at=decision.at)
