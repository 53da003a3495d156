"""L4 safety (SPEC 09 §7, §8): last-known-good before apply, a reversal generated before apply
that inherits the original's approval, and constitution edits that are prepared, never applied.

Pure. The engine asks the owning service on `<svc>.improve.lkg` whether every artefact the
proposal lists has a healthy last-known-good (smoke test rc 0); this module turns the answer
into a transition: `lkg_verified` (with the validated reversal recorded on the chain, so its id
is known before anything changes) or a failed apply (nothing was sent, nothing changed).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from improved.core import schemas
from improved.core.audit import REASON_LIMIT, Draft, draft_of
from improved.core.guards import EscapingPath, UncanonicalPath, canonical_path
from improved.core.record import ProposalRecord
from improved.core.trailers import Inherited, LkgRefused, LkgVerified
from improved.protocol import wire
from improved.protocol.model import (
    AnalyzerRef,
    Origin,
    Proposal,
    Summary,
)

REVERT_ANALYZER = "improved.revert/1"
# The bound a reversal's own reversal is validated against: a restore of digests, far below
# the daemon's default message limit (256 KiB), whatever the deployment configured.
REVERSAL_MESSAGE_BYTES = 256 * 1024
Digest = Annotated[str, Meta(pattern=r"^sha256:[0-9a-f]{64}\Z")]


class LkgEntry(Struct, forbid_unknown_fields=True, kw_only=True):
    """One artefact an L4 proposal touches: the digest it installs and the smoke test that
    says an artefact is healthy."""

    artefact: Annotated[str, Meta(min_length=1, max_length=256)]
    digest: Digest
    smoke_test: Annotated[str, Meta(min_length=1, max_length=128)]


class LkgArtefact(Struct, kw_only=True):
    """The owning service's answer for one artefact: its current last-known-good."""

    artefact: str
    lkg_digest: str | None = None
    smoke_test: str = ""
    rc: int | None = None


class LkgReport(Struct, kw_only=True):
    """The reply of `<svc>.improve.lkg` (lenient: services may add fields)."""

    ok: bool
    artefacts: list[LkgArtefact] = []
    error: str | None = None


report_decoder = msgspec.json.Decoder(LkgReport)


# -- what an L4 proposal must carry -----------------------------------------------------------


def entries(proposal: Proposal) -> list[LkgEntry]:
    """The proposal's `lkg` list, validated; ValueError says what is wrong."""
    if not proposal.lkg:
        raise ValueError("an L4 proposal lists every artefact it touches in `lkg`, each with "
                         "its digest and smoke test (SPEC 09 §7)")
    try:
        out = msgspec.convert(proposal.lkg, type=list[LkgEntry])
    except msgspec.ValidationError as exc:
        raise ValueError(f"lkg: {exc}") from None
    names = [e.artefact for e in out]
    if len(set(names)) != len(names):
        raise ValueError("lkg: an artefact is listed twice")
    return out


def is_charter(proposal: Proposal) -> bool:
    return proposal.scope == "charter" or proposal.amends is not None


OPERATOR_ORIGIN = "operator:"


def autonomous_origin(proposal: Proposal) -> bool:
    """Whether the proposal declares an autonomous origin — an agent, a runtime, a service —
    rather than an operator (`operator:<principal>`, SPEC 07). Constitution VII.1: autonomous
    paths may not propose amendments. The origin is declared, not verified: it refuses what an
    agent honestly files; what makes an amendment count is still an operator's signed approval."""
    return not proposal.origin.actor.startswith(OPERATOR_ORIGIN)


def needs_lkg(proposal: Proposal) -> bool:
    """L4 changes to artefacts: not reversals (checked when their original was) and not
    constitution edits (never applied by the loop)."""
    return (proposal.change_class == "L4" and not is_charter(proposal)
            and reverts(proposal) is None)


def problem(proposal: Proposal) -> str | None:
    """Why an L4 or charter proposal is malformed for its class, or None."""
    if is_charter(proposal):
        return charter_problem(proposal)
    if needs_lkg(proposal):
        try:
            found = entries(proposal)
        except ValueError as exc:
            return str(exc)
        if schemas.is_schema(proposal.target_ref):
            bad = schemas.revert_problem([e.artefact for e in found], proposal.revert)
            return None if bad is None else f"{wire.SCHEMA_REVERT}: {bad}"
    return None


# -- constitution edits (SPEC 09 §8, constitution VII) ---------------------------------------

CHARTER_FILES = ("_spec/2026-04-20-00-constitution.md", "_spec/CHANGELOG.md")
_CHANGELOG_HEADER = re.compile(r"^\+\+\+ (?:b/)?(\S*CHANGELOG\.md)\s*$")


def charter_problem(proposal: Proposal) -> str | None:
    """A constitution edit is L4, scope charter, carries an Article VII `amends` clause and
    adds a CHANGELOG entry in the same diff."""
    if proposal.scope != "charter":
        return "`amends` belongs to constitution edits, which have scope charter"
    if proposal.change_class != "L4":
        return "a constitution edit is L4"
    if not (proposal.amends or "").strip():
        return "a constitution edit carries an Article VII `amends` clause"
    edit = proposal.proposal_edit
    if edit is None:
        return "a constitution edit is a proposal_edit (a diff an operator commits)"
    if not changelog_entry(edit.diff):
        return "a constitution edit adds a CHANGELOG entry in the same diff"
    return None


def changelog_entry(diff: str) -> bool:
    """The unified diff adds at least one line to a CHANGELOG.md."""
    in_changelog = False
    for line in diff.splitlines():
        if line.startswith("+++ "):
            in_changelog = bool(_CHANGELOG_HEADER.match(line))
        elif line.startswith("--- ") or line.startswith("diff "):
            continue
        elif in_changelog and line.startswith("+") and line[1:].strip():
            return True
    return False


def charter_paths(paths: list[str]) -> list[str]:
    """The paths a valid constitution edit may name although they are forbidden targets: it
    is only prepared, an operator commits it."""
    out = []
    for p in paths:
        try:
            norm = canonical_path(p)
        except (EscapingPath, UncanonicalPath):
            out.append(p)
            continue
        if not any(norm == f.casefold() or norm.endswith("/" + f.casefold())
                   for f in CHARTER_FILES):
            out.append(p)
    return out


# -- the pre-apply check and the reversal -----------------------------------------------------


def needs_check(record: ProposalRecord) -> bool:
    """Approved L4, not checked yet (the check records the reversal)."""
    return (needs_lkg(record.proposal) and record.revert_id is None
            and record.outcome is None and record.status == "approved")


def check_request(record: ProposalRecord) -> dict[str, Any]:
    return {"proposal_id": record.proposal_id,
            "lkg": [msgspec.to_builtins(e) for e in entries(record.proposal)]}


def report_problem(record: ProposalRecord, report: LkgReport) -> str | None:
    """Why the answer does not show a healthy last-known-good of every artefact."""
    if not report.ok:
        bad = [f"{a.artefact} (rc {a.rc})" for a in report.artefacts if a.rc != 0]
        return report.error or ("unhealthy last-known-good: " + ", ".join(bad) if bad
                                else "the service reported no healthy last-known-good")
    wanted = {e.artefact for e in entries(record.proposal)}
    got = {a.artefact: a for a in report.artefacts}
    for name in sorted(wanted):
        a = got.get(name)
        if a is None:
            return f"the service said nothing about {name}"
        if a.rc != 0 or not a.lkg_digest:
            return f"{name}: no healthy last-known-good (rc {a.rc})"
    p = record.proposal
    if schemas.is_schema(p.target_ref) and schemas.revert_problem(sorted(wanted), p.revert) is None:
        # the proposer's base is a claim: the reversal must go back to what the owner holds
        stale = schemas.base_problem(p.revert or {}, {n: a.lkg_digest for n, a in got.items()})
        return None if stale is None else f"{wire.SCHEMA_BASE}: {stale}"
    return None


def reversal(record: ProposalRecord, report: LkgReport) -> Proposal:
    """The reversal, generated before apply: back to every artefact's last-known-good (or the
    proposer's own `revert` body). Content-addressed, so its id is known before the apply."""
    p = record.proposal
    by_name = {a.artefact: a for a in report.artefacts}
    lkg = [{"artefact": e.artefact, "digest": by_name[e.artefact].lkg_digest,
            "smoke_test": e.smoke_test} for e in entries(p)]
    return _restoring(record, lkg, p.revert)


def reversal_of_reversal(record: ProposalRecord, original: ProposalRecord) -> Proposal | None:
    """The way back from a recorded reversal about to run: to what its original installed
    (the original's `lkg` digests), so an applied reversal names its own pre-generated
    reversal as every applied L4 must (SPEC 09 §7.3). None when the original lists no
    artefacts to go back to."""
    try:
        installed = entries(original.proposal)
    except ValueError:
        return None
    lkg = [{"artefact": e.artefact, "digest": e.digest, "smoke_test": e.smoke_test}
           for e in installed]
    return _restoring(record, lkg, None)


def _restoring(record: ProposalRecord, lkg: list[dict[str, Any]], body: Any) -> Proposal:
    """The reversal of `record`: installs the digests `lkg` lists (`body`, else a restore of
    them), under the revert analyzer, derived from `record`'s id, dated by its chain."""
    p = record.proposal
    return Proposal(
        service=p.service, target_ref=p.target_ref, change_class="L4", scope=p.scope,
        origin=Origin(actor="improved", service="improved"),
        analyzer=AnalyzerRef(id=REVERT_ANALYZER),
        summary=Summary(template_id="revert", args={"proposal_id": record.proposal_id}),
        proposal_data=body if body is not None else {
            "restore": {e["artefact"]: e["digest"] for e in lkg}},
        lkg=lkg, derived_from=[f"mg:sha256:{record.proposal_id}"],
        created_at=record.updated_at, namespace=p.namespace,
    )


def reverts(proposal: Proposal) -> str | None:
    """The id of the L4 proposal this one is the recorded reversal of, if it is one."""
    if proposal.analyzer.id != REVERT_ANALYZER:
        return None
    for r in proposal.derived_from or ():
        if r.startswith("mg:sha256:"):
            return r[len("mg:sha256:"):]
    return None


def verified(record: ProposalRecord, report: LkgReport, rev: Proposal, rev_id: str,
             actor: str, answered_by: str | None = None) -> Draft:
    """Every artefact has a healthy last-known-good; the reversal is recorded before apply."""
    lkg = [msgspec.to_builtins(a) for a in report.artefacts]
    return draft_of(LkgVerified(lkg=lkg, revert_proposal_id=rev_id, revert=rev,
                                answered_by=answered_by),
                    record.stage, actor, "rec:system",
                    f"healthy last-known-good for {len(lkg)} artefact(s); reversal {rev_id} "
                    "generated and validated before apply")


def refused(record: ProposalRecord, why: str, by: str,
            answered_by: str | None = None) -> Draft:
    """No healthy last-known-good (or no valid reversal): the apply fails before any order is
    sent, so nothing changed. Final, like a service's refusal."""
    error = f"lkg: {why}"[:REASON_LIMIT]
    return draft_of(LkgRefused(error=error, answered_by=answered_by), record.stage, by,
                    "rec:system", f"refused before apply, nothing changed: {error}"[:REASON_LIMIT])


def inherit(record: ProposalRecord, original: ProposalRecord | None,
            own_reversal: tuple[str, Proposal] | None = None) -> Draft | None:
    """The recorded reversal of an applied L4 proposal runs under the original's approval
    (SPEC 09 §7.3): no second approval. Anything else claiming to be one is gated as usual.
    `own_reversal` (its id and proposal, validated) is the reversal's own way back, recorded
    here before it runs, as `lkg_verified` records an original's."""
    if (original is None or original.revert_id != record.proposal_id
            or original.status != "applied" or original.approved_by is None):
        return None
    by = original.approved_by
    reason = (f"the recorded reversal of {original.proposal_id} inherits its approval by {by} "
              "(SPEC 09 §7)")[:REASON_LIMIT]
    rid, rev = own_reversal if own_reversal is not None else (None, None)
    return draft_of(Inherited(inherits=original.proposal_id, authority=by,
                              revert_proposal_id=rid, revert=rev),
                    record.stage, by, "rec:policy", reason)
