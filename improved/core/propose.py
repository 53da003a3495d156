"""Stage 2, propose: validate a proposal, compute its id and dedup_key, record it `pending`.

Pure: bytes in, a Proposal or a WireError out; a registered record and its first trailer draft.
"""

from __future__ import annotations

from typing import Any

import msgspec

from improved.core import identity
from improved.core.audit import Draft, draft_of
from improved.core.boundary import Answer, Attested
from improved.core.policy import Policy
from improved.core.record import CountedSignal, ProposalRecord, closed, fold, replay
from improved.core.signing import PAYLOAD_TYPES, ActRefused, TrustStore, Verified
from improved.core.trailers import Registration, Superseded, decode
from improved.protocol import cal, canonical, wire
from improved.protocol.model import (
    DERIVED_FROM_LIMIT,
    DedupHead,
    Envelope,
    ObserverType,
    Proposal,
    Signal,
    Trailer,
)
from improved.protocol.subjects import SKILL_NAME_RE

# Deterministic summary templates (OMS rule 4: never free prose). Unknown ids still render
# deterministically, as the id followed by the sorted arguments.
TEMPLATES: dict[str, str] = {
    "set_config": "set {key} to {value}",
    "adjust_rank": "adjust rank of {item} by {delta}",
    "new_skill": "add skill {name}",
    "refine_skill": "refine skill {name}",
    "edit_doc": "edit {doc}",
    "investigate_regression": "investigate {count} negative {metric} signals on {target}",
    "archive_skill": "archive skill {name} after {count} negative outcomes",
    "rollback": "roll back {proposal_id}",
}


def render_summary(template_id: str, args: dict[str, Any]) -> str:
    template = TEMPLATES.get(template_id)
    if template is not None:
        try:
            return template.format(**args)
        except (KeyError, IndexError, ValueError):
            pass
    rendered = ", ".join(f"{k}={args[k]}" for k in sorted(args))
    return f"{template_id}({rendered})"


def validate(data: bytes, subject_service: str | None, limit: int) -> Proposal:
    """Decode and check a proposal; raise WireError naming the first problem."""
    proposal = wire.decode(data, Proposal, limit)
    bodies = [n for n in ("proposal_cal", "proposal_edit", "proposal_data")
              if getattr(proposal, n) is not None]
    if len(bodies) != 1:
        named = " and ".join(bodies) if bodies else "none"
        raise wire.WireError(wire.BODY_COUNT, "a proposal carries exactly one of proposal_cal, "
                             f"proposal_edit, proposal_data; this one has {named}",
                             bodies[1] if len(bodies) > 1 else "proposal_cal")
    if proposal.derived_from is not None and len(proposal.derived_from) > DERIVED_FROM_LIMIT:
        raise wire.WireError(wire.INVALID_VALUE, f"derived_from holds {len(proposal.derived_from)} "
                             f"entries; improved bounds it at {DERIVED_FROM_LIMIT} (this "
                             "project's rule; OMS recommends at most 64): carry a representative "
                             "set and an evidence_query that regenerates the rest", "derived_from")
    versioned = canonical.analyzer_id_problem(proposal.analyzer.id)
    if versioned is not None:
        raise wire.WireError(wire.INVALID_VALUE, versioned, "analyzer.id")
    proposal = grain_fields_checked(proposal)
    if subject_service is not None and proposal.service != subject_service:
        raise wire.WireError(wire.SUBJECT_MISMATCH, f"service {proposal.service!r} disagrees "
                             f"with the subject's service {subject_service!r}", "service")
    if proposal.proposal_cal is not None:
        check_cal(proposal.proposal_cal, proposal.namespace)
    skill = skill_definition(proposal)
    if skill is not None:
        name = skill.get("name")
        if not isinstance(name, str) or not SKILL_NAME_RE.match(name):
            raise wire.WireError(wire.INVALID_VALUE, "a skill's name must match "
                                 "[a-z][a-z0-9_-]{0,62}", "proposal_data.skill.name")
        deps = canonical.dependencies_problem(skill)
        if deps is not None:
            raise wire.WireError(wire.INVALID_VALUE, deps[1], f"proposal_data.skill.{deps[0]}")
    elif proposal.change_class == "L3" and proposal.target_ref.startswith("skill:"):
        raise wire.WireError(wire.INVALID_VALUE, "an L3 proposal must carry the skill "
                             "definition it re-executes in proposal_data.skill",
                             "proposal_data.skill")
    return proposal


# why a signed proposal is refused: the signature's ActRefused code → the error reply's code
_REFUSED_AS = {"unknown_key": wire.UNKNOWN_SIGNER, "wrong_type": wire.INVALID_VALUE,
               "malformed": wire.INVALID_VALUE}


def verify_signed(signers: TrustStore, env: Envelope, proposal: Proposal) -> Verified:
    """Who verifiably proposed `proposal`, the Proposal the payload of `env` decodes to: a key
    in `[trust.signers]` whose identity is `agent:<svc>:<name>` or `service:<svc>` of the
    proposal's service (the subject's, `validate` checked) signed the payload's exact bytes.
    WireError otherwise: `bad_signature`, `unknown_signer` or `signer_mismatch`."""
    try:
        verified = signers.verify(env, PAYLOAD_TYPES["proposal"])
    except ActRefused as refused:
        code = _REFUSED_AS.get(refused.code, wire.BAD_SIGNATURE)
        field = "payloadType" if refused.code == "wrong_type" else "signatures"
        raise wire.WireError(code, f"signed proposal refused: {refused.reason}", field) from None
    problem = identity.proposer_problem(verified.principal, proposal.service)
    if problem is not None:
        raise wire.WireError(wire.SIGNER_MISMATCH, f"signed proposal refused: {problem}",
                             "signatures")
    return verified


def surface_problem(service: str, spec: Answer[Any] | None) -> str | None:
    """Why proposals for `service` are refused, given what its `spec.get` answered (None: no
    answer), or None. Only an advertised omission refuses (SPEC 09 conformance L0: a service
    that does not participate says so), and only when the answer is the service's own
    (attested, core.boundary) and speaks of that service: silence may be a service that is
    down, and anyone on an open bus could answer first."""
    if not isinstance(spec, Attested) or not isinstance(spec.value, dict):
        return None
    named = spec.value.get("service")
    if spec.value.get("improve") is False and named in (None, service):
        return (f"service {service!r} advertises no improvement surface (its spec.get says "
                '"improve": false): it takes no proposals')
    return None


def grain_fields_checked(proposal: Proposal) -> Proposal:
    """The proposal without the OMS grain fields it may carry as a Recommendation JSON does:
    `type` (already checked to be "recommendation") and `dedup_key`, which must be the computed
    one (OMS rule 5: computed, never author-chosen) — a different key is refused naming it."""
    if proposal.type is None and proposal.dedup_key is None:
        return proposal
    if proposal.dedup_key is not None:
        computed = canonical.dedup_key(proposal.analyzer.id, proposal.target_ref,
                                       proposal.action_kind)
        if proposal.dedup_key != computed:
            raise wire.WireError(wire.INVALID_VALUE, f"dedup_key {proposal.dedup_key!r} is not "
                                 f"the computed one, {computed} (OMS rule 5: sha256 of the "
                                 "analyzer family, target_ref and action kind)", "dedup_key")
    return msgspec.structs.replace(proposal, type=None, dedup_key=None)


def check_cal(text: str, namespace: str | None) -> None:
    """A CAL Tier-1 batch only: ADD / SUPERSEDE / REVERT, never a destructive verb, never a
    status, never a write outside the proposal's own namespace (OMS rules 1, 3, 8, 9)."""
    try:
        batch = cal.parse(text)
    except cal.CalError as exc:
        code = {"E001": wire.TOO_LARGE, "status_forbidden": wire.STATUS_FORBIDDEN}.get(
            exc.code, wire.INVALID_VALUE)
        raise wire.WireError(code, f"proposal_cal is refused ({exc.code}): {exc.message}",
                             "proposal_cal") from None
    outside = sorted(n for n in cal.touches_namespace(batch) if n != namespace)
    if outside:
        raise wire.WireError(wire.INVALID_VALUE, "proposal_cal writes outside the proposal's "
                             f"namespace {namespace!r}: {', '.join(outside)}", "proposal_cal")


def skill_definition(proposal: Proposal) -> dict[str, Any] | None:
    data = proposal.proposal_data
    skill = data.get("skill") if data else None
    return skill if isinstance(skill, dict) else None


def grain_of(proposal: Proposal) -> dict[str, Any]:
    """The proposal as an OMS Recommendation grain: its fields plus type and dedup_key."""
    grain: dict[str, Any] = msgspec.to_builtins(proposal)  # a Struct encodes as a map
    grain["type"] = "recommendation"
    grain["dedup_key"] = canonical.dedup_key(proposal.analyzer.id, proposal.target_ref,
                                             proposal.action_kind)
    return grain


def identify(proposal: Proposal) -> tuple[str, str]:
    """(proposal_id, dedup_key): the content address and the identity across re-proposals."""
    grain = grain_of(proposal)
    try:
        pid = canonical.content_address(grain, canonical.RECOMMENDATION)
    except canonical.CanonicalError as exc:
        field = wire_field(exc.path)
        raise wire.WireError(wire.INVALID_VALUE, f"{exc.message} ({exc.code})"
                             + (f" at `{field}`" if field else ""), field) from None
    return pid, grain["dedup_key"]


_FULL_NAME = {short: full for full, short in canonical.FIELD_MAP.items()}


def wire_field(path: str) -> str | None:
    """The encoder's path over compacted keys (`$.pdata.x`) as the wire field (`proposal_data.x`)."""
    rest = path.removeprefix("$").removeprefix(".")
    if not rest:
        return None
    head, sep, tail = rest.partition(".")
    bracket = head.find("[")
    if bracket > 0:
        head, tail, sep = head[:bracket], head[bracket:] + sep + tail, ""
    return _FULL_NAME.get(head, head) + sep + tail


def count(signal: Signal, digest: str, proposal: Proposal, applied_at: int | None,
          policy: Policy, emitter: str = identity.UNVERIFIED,
          proposer: str | None = None) -> CountedSignal:
    """A signal as counted for `proposal` (signed by `proposer`, None: unsigned), its
    independence decided by `emitter` — the verified identity that sent it — alone; a signal
    inside the proposal is the proposer's."""
    return CountedSignal(
        digest=digest, kind=signal.kind, actor=signal.actor, service=signal.service,
        positive=signal.positive, at=signal.at, name=signal.name, value=signal.value,
        emitter=emitter,
        independent=identity.independent(signal.kind, emitter, proposer_of(proposal, proposer),
                                         signal.at, applied_at, policy.effect_window_ms),
    )


def proposer_of(proposal: Proposal, signer: str | None = None) -> identity.Proposer:
    """Who made `proposal`, as far as it can be told (core/identity.py): `signer` is the
    verified identity that signed it, None when it came unsigned."""
    return identity.Proposer(proposal.service, proposal.origin.service, signer)


def signal_digest(signal: Signal) -> str:
    return canonical.digest(msgspec.to_builtins(signal))


def register(proposal: Proposal, pid: str, dedup: str, policy: Policy, now: int,
             proposer: str | None = None,
             envelope: Envelope | None = None) -> tuple[ProposalRecord, Draft]:
    """A new record, `pending`, and the trailer that registers it. A signed proposal's
    verified `proposer` (`verify_signed`) goes on it as the `proposer:` ref, with the
    `envelope` itself, so the chain alone proves who proposed (core/evidence.py)."""
    skill = skill_definition(proposal)
    signals = tuple(count(s, signal_digest(s), proposal, None, policy)
                    for s in proposal.signals or ())
    summary = render_summary(proposal.summary.template_id, proposal.summary.args)
    record = ProposalRecord(
        proposal_id=pid,
        service=proposal.service,
        dedup_key=dedup,
        proposal=proposal,
        summary_text=summary,
        skill=canonical.skill_identity(skill) if skill is not None else None,
        gate_class=proposal.change_class,
        signals=signals,
        proposer=proposer,
        updated_at=now,
    )
    observer: ObserverType = "rec:agent"  # an origin, signed or not, proves no operator
    draft = draft_of(
        Registration(analyzer=proposal.analyzer.id, dedup_key=dedup, proposal=proposal,
                     proposer=proposer),
        "observe", proposal.origin.actor, observer, f"proposed: {summary}"
        + (f" (signed by {proposer})" if proposer is not None else ""),
        envelope if proposer is not None else None)
    return record, draft


def supersede(record: ProposalRecord, by: str, actor: str) -> Draft | None:
    """Newer content under the same dedup_key: this proposal will never be applied, and an
    approval it had is withdrawn. None when it is already settled or superseded, or its order
    is recorded as dispatched (its outcome decides it)."""
    if (record.superseded_by is not None or record.status not in ("pending", "approved")
            or record.in_flight):
        return None
    return draft_of(Superseded(superseded_by=by), record.stage, actor, "rec:system",
                    f"superseded by {by}: new content under the same dedup_key")


def registration(trailer: Trailer) -> Registration:
    """What a chain's first trailer registers: the proposal itself (its `proposal:` ref) and
    the verified proposer, if it was signed (`proposer:`). The proposer is as good as the
    chain's verification: `improved audit verify` and the daemon check the envelope beside it
    against the trust store (core/evidence.py). ValueError when it registers nothing."""
    data = decode(trailer)
    if not isinstance(data, Registration):
        raise ValueError(f"trailer {trailer.seq} of {trailer.proposal_id} registers no proposal")
    return data


def rebuild_record(trailers: list[Trailer], seqs: list[int], policy: Policy) -> ProposalRecord:
    """Replay a chain from its registration trailer, which carries the proposal itself; the
    proposal must hash to the chain's id, so a chain cannot be rebuilt around other content."""
    first = registration(trailers[0])
    pid, dedup = identify(first.proposal)
    if pid != trailers[0].proposal_id:
        raise ValueError(f"chain {trailers[0].proposal_id}: its registration carries the "
                         f"content of {pid}")
    start, _ = register(first.proposal, pid, dedup, policy, 0, first.proposer)
    return replay(fold(start, trailers[0], seqs[0], first), trailers[1:], seqs[1:])


FUTURE_SKEW_MS = 5 * 60 * 1000  # how far a proposal's created_at may lie ahead of our clock


def future_dated(proposal: Proposal, now: int) -> bool:
    """Dated beyond the clock skew into the future: it may not claim its dedup_key (a
    proposal dated 2096 would otherwise supersede every honest one after it) and is rejected."""
    return proposal.created_at > now + FUTURE_SKEW_MS


def supersedes(head: ProposalRecord | None) -> bool:
    """Whether the newest content under a dedup_key still supersedes older content arriving
    after it: not when it is gone (no record), was rejected, expired, or is itself superseded."""
    return (head is not None and head.superseded_by is None
            and head.status not in ("rejected", "expired"))


def stands_over(head: ProposalRecord | None, proposal: Proposal, pid: str, dedup: str) -> bool:
    """Whether `head`, the record the dedup bucket names under `dedup` as read from its own
    chain, supersedes `proposal` (id `pid`): newer content under the very same dedup_key, by
    the chain's word (the bucket is a cache anyone on the bus could write, so its claims of
    which proposal and how new are not believed), that still supersedes (`supersedes`).
    Registration and review ask the same question."""
    return (head is not None and head.proposal_id != pid and head.dedup_key == dedup
            and (head.proposal.created_at, head.proposal_id) > (proposal.created_at, pid)
            and supersedes(head))


def older_under_key(head: ProposalRecord | None, proposal: Proposal, pid: str,
                    dedup: str) -> bool:
    """Whether `head`, the record the dedup bucket named under `dedup` as read from its own
    chain, is older content under the very same dedup_key than `proposal` (id `pid`), which
    then supersedes it. By the chain's word, as `stands_over`: a head forged in the bucket
    can name no proposal of another key, nor make one look older than it is."""
    return (head is not None and head.proposal_id != pid and head.dedup_key == dedup
            and (head.proposal.created_at, head.proposal_id) < (proposal.created_at, pid))


def head_may_expire(record: ProposalRecord, head: DedupHead | None) -> bool:
    """Whether the dedup head `head`, read under `record`'s dedup_key, may now carry the TTL a
    closed proposal's retained records carry (`records_ttl_days`): it names `record`, and
    `record` is closed (`core.record.closed`: rejected, expired, rolled back, superseded before
    it ran, or applied with nothing left to measure). A head naming another proposal (newer,
    open or not) is never touched by this one's close.

    What the head of a closed proposal P is still read for, and what its absence changes:
    - Claiming the key (`Store.set_dedup_head`) by a newcomer N dated after P: N becomes the
      head and supersedes P, which leaves a closed P alone (`supersede` returns None). With no
      head N claims an empty key: the same decisions, one supersede attempt fewer.
    - The rejection ledger (`duplicate_rejected`): it is read at every registration, not only
      when the key had a head, so an expired head changes nothing there. The ledger itself does
      not expire: an operator's rejection of an idea on given evidence stands until the
      evidence changes, however long that takes; it is written once per operator rejection, so
      it grows with what operators do, not with the traffic.
    - Content dated before P that arrives after it: P supersedes it when P still `supersedes`
      (applied, rolled back: `Engine.standing_head`), and a review of it is refused
      `superseded` whatever P's status (`SignedActs.review`). That is the one decision an expired
      head changes: content dated before P that arrives, or is reviewed, more than
      `records_ttl_days` after P closed is taken as new. Its `created_at` then lies at least that long (less
      `FUTURE_SKEW_MS`) before the moment it is decided on, since P's own `created_at` lies
      before P's close (plus the skew): every proposal decided within `records_ttl_days` of
      its `created_at` is decided exactly as with the head kept. `records_ttl_days = 0` keeps
      every head for good.
    Pure: the caller reads the head and rewrites it compare-and-set (a newer head written
    meanwhile wins, and keeps no TTL); a rewrite that fails leaves the head as it was, kept
    for good as before."""
    return head is not None and head.proposal_id == record.proposal_id and closed(record)
