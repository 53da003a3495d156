"""Stage 3, triage: guards in a fixed order, then the class gate (DESIGN §2, §5).

Order: forbidden target, class, scope, what the class must carry (L4: `lkg`; a constitution
edit: `amends`, a CHANGELOG entry and an operator's origin), the doc allowlist, expiry, the rejection ledger, feedback collapse, class
gate — so the cause of a decision is deterministic. Pure: (record, policy, clock, grant) → TriageDecision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, get_args

import msgspec

from improved.core import gradient, lkg, propose
from improved.core.audit import REASON_LIMIT, Draft, draft_of
from improved.core.guards import (
    forbidden_match,
    on_allowlist,
    self_confirmed,
    touched_paths,
    uncanonical,
)
from improved.core.policy import Policy
from improved.core.record import ProposalRecord
from improved.core.trailers import Decided
from improved.protocol import canonical
from improved.protocol.model import Cause, ChangeClass, Held, Proposal, TriageDecision, Verdict


@dataclass(frozen=True)
class Rejection:
    """An operator's rejection as the rejected proposal's own verified chain records it (the
    ledger entry under the dedup_key only says which chain to read: any bus participant could
    write one). Made by `rejection_of`."""

    proposal_id: str
    dedup_key: str
    principal: str
    reason: str
    evidence: str  # `evidence_digest` of the rejected proposal


def rejection_of(record: ProposalRecord | None) -> Rejection | None:
    """The rejection `record` (rebuilt from its verified chain) carries: its last decision an
    operator's signed reject (a human's, no cause); None for anything else."""
    d = record.decision if record is not None else None
    if record is None or d is None or d.verdict != "reject" or d.cause is not None \
            or record.status != "rejected":
        return None
    return Rejection(record.proposal_id, record.dedup_key, d.actor, d.rationale,
                     evidence_digest(record.proposal))


def decide(record: ProposalRecord, policy: Policy, now: int, grant_active: bool,
           actor: str, rejected: Rejection | None = None,
           held: Held | None = None) -> TriageDecision:
    """`rejected`: the operator's rejection of earlier content under this proposal's
    dedup_key, as its chain records it, if any; `held`: `circuit_open` or `autonomy_off`
    while autonomous applies are held back."""
    p = record.proposal
    scheme = gradient.scheme_of(p.target_ref)

    def decision(verdict: Verdict, cause: Cause | None, rationale: str,
                 gate_class: ChangeClass = p.change_class) -> TriageDecision:
        return TriageDecision(proposal_id=record.proposal_id, service=record.service,
                              verdict=verdict, cause=cause, gate_class=gate_class,
                              rationale=rationale[:REASON_LIMIT], actor=actor, at=now)

    paths = touched_paths(p)
    bad_path = uncanonical(paths)
    if bad_path is not None:
        return decision("reject", "invalid", f"a path this change touches has no canonical "
                        f"form ({bad_path}); it cannot be checked, so it is refused")
    # constitution VII.1: autonomous paths may not propose amendments (an operator's may be
    # prepared here, never applied: it may name the charter)
    autonomous_charter = lkg.is_charter(p) and lkg.autonomous_origin(p)
    charter = lkg.is_charter(p) and lkg.charter_problem(p) is None and not autonomous_charter
    if charter:
        paths = lkg.charter_paths(paths)
    hit = forbidden_match(paths, policy.forbidden)
    if hit is not None:
        return decision("reject", "forbidden_target",
                        f"{hit} is a forbidden target (constitution VI); no class may change it"
                        + (f"; {_autonomous_charter(p)}" if autonomous_charter else ""))
    if not gradient.class_fits(p.change_class, scheme, policy.min_class,
                               policy.fallback_min_class):
        least = gradient.min_class(scheme, policy.min_class, policy.fallback_min_class)
        unlisted = gradient.unlisted(scheme, policy.min_class)
        if unlisted is not None:  # the scheme is the likely mistake, not the class
            return decision("reject", "class_mismatch", f"{unlisted}; an unlisted scheme needs "
                            f"at least {least}: fix the scheme, or propose at {least}")
        if p.change_class == "L3":
            why = "L3 fits skill: targets only"
        else:
            why = f"{p.change_class} is below the minimum {least} for {scheme}: targets"
        return decision("reject", "class_mismatch", f"{why}; re-propose at the right class")
    if not gradient.scope_fits(p.scope, scheme):
        want = "doc (the charter is a document)" if p.scope == "charter" else \
            gradient.implied_scope(scheme)
        return decision("reject", "scope_mismatch",
                        f"scope {p.scope} does not fit {scheme}: targets (expected {want})")
    bad = lkg.problem(p)
    if bad is not None:
        return decision("reject", "invalid", f"{p.change_class} {p.scope} proposal: {bad}")
    if autonomous_charter:
        return decision("reject", "forbidden_target", _autonomous_charter(p))
    if scheme == "doc" and not charter and not on_allowlist(gradient.rest_of(p.target_ref), policy.doc_allowlist):
        return decision("reject", "invalid", f"{p.target_ref} is not on the doc allowlist "
                        "(policy.doc_allowlist); doc: targets must be listed to be edited")
    if propose.future_dated(p, now):
        return decision("reject", "invalid", f"created_at {p.created_at} lies more than "
                        f"{propose.FUTURE_SKEW_MS // 1000} s in the future")
    if p.valid_to is not None and p.valid_to <= now:
        return decision("reject", "expired", f"valid_to {p.valid_to} has passed")
    if (rejected is not None and rejected.proposal_id != record.proposal_id
            and rejected.dedup_key == record.dedup_key
            and rejected.evidence == evidence_digest(p)):
        return decision("reject", "duplicate_rejected",
                        f"{rejected.principal} rejected {rejected.proposal_id} under the same "
                        f"dedup_key on the same evidence: {rejected.reason}")
    if self_confirmed(record.positives, record.independent_positives):
        return decision("defer", "feedback_collapse",
                        f"all {record.positives} positive signals come from the proposer's own "
                        "session; waiting for an independent one")
    return gate(record, grant_active, decision, held, policy.quorum)


def _autonomous_charter(p: Proposal) -> str:
    return (f"a constitution edit from an autonomous origin ({p.origin.actor}): constitution "
            "VII.1 lets only an operator propose one (origin operator:<name>)")


def evidence_digest(proposal: Proposal) -> str:
    """What a rejection was made on; refreshed evidence re-enters review (DESIGN §4)."""
    return canonical.digest({
        "derived_from": proposal.derived_from,
        "signals": msgspec.to_builtins(proposal.signals) if proposal.signals else None,
        "metric_snapshot": msgspec.to_builtins(proposal.metric_snapshot)
        if proposal.metric_snapshot else None,
        "evidence_query": proposal.evidence_query,
    })


class Decide(Protocol):
    """Makes the TriageDecision for one proposal: `decide`'s `decision`."""

    def __call__(self, verdict: Verdict, cause: Cause | None, rationale: str,
                 gate_class: ChangeClass = ...) -> TriageDecision: ...


def gate(record: ProposalRecord, grant_active: bool, decision: Decide,
         held: Held | None = None, quorum: bool = False) -> TriageDecision:
    cls = record.proposal.change_class
    beyond = grant_scope_problem(record.proposal) if cls == "L3" and grant_active else None
    grant_active = grant_active and beyond is None
    if held is not None and (cls == "L0" or (cls == "L3" and grant_active)):
        why = ("autonomy is switched off" if held == "autonomy_off" else
               "the circuit breaker is open after repeated rollbacks of autonomous applies")
        return decision("defer", held, f"{cls} would apply automatically, but {why}")
    if cls == "L0":
        return decision("accept", None, "L0 read-only learning applies automatically")
    if cls == "L1":
        return decision("accept", None, "L1 is surfaced for review and never applied")
    if cls == "L3":
        if grant_active:
            return decision("accept", None, f"an active grant covers {record.skill}")
        if beyond is not None:
            return decision("defer", "no_grant", f"the grant for {record.skill} covers that "
                            f"definition alone, and {beyond}; gated as L2", gate_class="L2")
        return decision("defer", "no_grant",
                        f"no active grant for {record.skill}; gated as L2", gate_class="L2")
    if lkg.is_charter(record.proposal):
        return decision("defer", "awaiting_operator",
                        "a constitution edit is prepared here and committed by an operator by "
                        "hand (SPEC 09 §8, Art. VII); the loop never applies it")
    if cls == "L4" and quorum:
        return decision("defer", "awaiting_quorum",
                        "L4 needs signed approvals from three non-correlated sessions on "
                        "improve.quorum, or a signed operator approval")
    return decision("defer", "awaiting_operator",
                    f"{cls} needs a signed operator approval"
                    + (" per occurrence" if cls == "L4" else ""))


HELD: frozenset[str] = frozenset(get_args(Held))


def grant_scope_problem(proposal: Proposal) -> str | None:
    """What an L3 carries beyond the skill definition its grant hashes (SPEC 09 §4: a grant
    binds `<name>:<sha256>` of the definition), or None when it is exactly that definition,
    targeted at `skill:<its name>`."""
    data = proposal.proposal_data or {}
    skill = data.get("skill")
    if not isinstance(skill, dict):
        return "it carries no skill definition"
    extra = sorted(set(data) - {"skill"})
    if extra:
        return f"proposal_data carries more than the skill ({', '.join(extra)})"
    outside = sorted(set(skill) - set(canonical.SKILL_DEFINITION_FIELDS))
    if outside:
        return f"the skill carries fields outside its hashed definition ({', '.join(outside)})"
    if proposal.target_ref != f"skill:{skill.get('name')}":
        return f"{proposal.target_ref} is not the skill the definition names"
    return None


def held_back(record: ProposalRecord) -> bool:
    """Deferred only because autonomy was held back: worth another look once it is not."""
    d = record.decision
    return (d is not None and d.verdict == "defer" and d.cause in HELD
            and record.status == "pending" and record.superseded_by is None)


def needs_triage(record: ProposalRecord) -> bool:
    """Untriaged, or deferred as self-confirmed and now independently confirmed."""
    d = record.decision
    if record.superseded_by is not None:
        return False
    if d is None:
        return record.status == "pending"
    return (d.verdict == "defer" and d.cause == "feedback_collapse"
            and record.status == "pending"
            and not self_confirmed(record.positives, record.independent_positives))


def transition(record: ProposalRecord, d: TriageDecision) -> Draft:
    """The decision as its trailer, at its gate class; folded, it also voids a dispatch that
    was recorded but never sent (a revoked grant)."""
    return draft_of(Decided(verdict=d.verdict, cause=d.cause), record.stage, d.actor,
                    "rec:system", d.rationale, gate_class=d.gate_class)
