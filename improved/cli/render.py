"""What `improved review` and `improved show` print for a person, and what the console shows:
pure functions from the read models (`queries.review_view`'s rows, `proposals.shown`'s view)
to lines of text. Nothing here reads the bus.

Every field a proposal, a trailer or a signed act carries was written by a bus participant, so
none is trusted to be printable: `clean` turns control characters (an escape sequence that
would repaint the operator's terminal, a carriage return that would hide the rest of a line)
into visible `\\x..` escapes before anything is printed. The HTML console escapes the same
fields for HTML (`improved.cli.console`)."""

from __future__ import annotations

import difflib
import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from improved.core.trailers import (
    Approved,
    AutonomyState,
    Decided,
    Dispatched,
    GrantAct,
    Inherited,
    QuorumReached,
    Refused,
    Rejected,
    RollbackAsked,
    TrailerData,
    TrailerDataError,
    Voted,
    decode_body,
    verdict_of,
)

SHORT = 12  # digits of an id shown where the full id is not needed (the demo's 12)

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def clean(value: object, keep_newlines: bool = False) -> str:
    """`value` as text with every control character (and bidirectional override) shown as an
    escape: nothing a bus participant wrote can move the cursor, clear the screen or reorder
    what the operator reads. Newlines are escaped too unless `keep_newlines` (a body)."""
    text = value if isinstance(value, str) else str(value)
    if not keep_newlines:
        text = text.replace("\n", "\\n")
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def short(pid: str) -> str:
    return pid[:SHORT]


def stamp(ms: object) -> str:
    """A time in milliseconds as UTC, to the second; what is not a time as it is."""
    if not isinstance(ms, int | float) or isinstance(ms, bool):
        return clean(ms)
    try:
        return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ms / 1000))
    except (OverflowError, OSError, ValueError):
        return clean(ms)


# What a proposal waits for, by the cause its triage gave (`decide:` names the commands).
WAITS_FOR: dict[str, str] = {
    "awaiting_operator": "an operator's signed approval",
    "no_grant": "an operator's signed approval, or an L3 grant of its skill hash",
    "awaiting_quorum": "three signed quorum votes, or an operator",
    "quorum_dissent": "an operator (a quorum voter dissented)",
    "surfaced": "nothing: L1 is surfaced only, never applied",
    "feedback_collapse": "an independent positive signal (every positive one is the "
                         "proposer's own)",
    "circuit_open": "the circuit breaker to close (`improved status`)",
    "autonomy_off": "autonomy to be switched on (`improved status`)",
}

SETTLED: dict[str, str] = {
    "applied": "nothing: applied",
    "rolled_back": "nothing: rolled back",
    "rejected": "nothing: rejected",
    "expired": "nothing: expired",
    "approved": "its apply (approved)",
}


def waits_for(status: str | None, cause: str | None, in_flight: bool = False,
              superseded: bool = False) -> str:
    """What the proposal's gate waits for now, in words."""
    if superseded and status in ("pending", "approved"):
        return "nothing: superseded by newer content under the same dedup_key"
    if in_flight:
        return "the outcome of its apply (dispatched to its service)"
    if status in SETTLED:
        return SETTLED[str(status)]
    if cause in WAITS_FOR:
        return WAITS_FOR[str(cause)]
    if status == "pending" and cause is None:
        return "its apply (accepted)"
    return f"{clean(cause or status or 'its triage')}"


# -- the body ----------------------------------------------------------------------------------


def body_text(run: Mapping[str, Any]) -> list[str]:
    """The body of `authority.will_run` as lines: the CAL, the edit's own diff, or the data as
    sorted, indented JSON (so two bodies diff line by line)."""
    if run.get("cal") is not None:
        return str(run["cal"]).splitlines()
    edit = run.get("edit")
    if isinstance(edit, Mapping):
        return str(edit.get("diff", "")).splitlines()
    if run.get("data") is not None:
        return json.dumps(run["data"], indent=2, sort_keys=True, ensure_ascii=False).splitlines()
    return []


def body_kind(run: Mapping[str, Any]) -> str:
    if run.get("cal") is not None:
        return "CAL"
    edit = run.get("edit")
    if isinstance(edit, Mapping):
        return (f"edit ({clean(edit.get('format'))}) against base "
                f"{clean(edit.get('base_digest'))}, its own diff")
    return "data"


def body_diff(before: Mapping[str, Any], after: Mapping[str, Any], before_name: str,
              after_name: str) -> list[str]:
    """The unified diff of two bodies (`authority.will_run`), or one line when they agree."""
    lines = list(difflib.unified_diff(body_text(before), body_text(after), before_name,
                                      after_name, lineterm=""))
    return lines or ["(the same body)"]


def body_lines(run: Mapping[str, Any], digest: str | None,
               replaced: tuple[str, Mapping[str, Any]] | None = None, pid: str = "") -> list[str]:
    """What an approval lets run, for a person: the body as a unified diff against the body of
    the proposal it replaced (`replaced`: its id and its will_run) when that is known, else the
    body itself (an edit's body is a diff already); then every artefact an L4 installs (the
    digest of the new content: the last-known-good is the owning service's to confirm at the
    pre-apply check) and the reversal it runs later under the same approval."""
    head = f"will run (digest {digest}):" if digest else "will run:"
    lines = [head]
    if replaced is not None:
        old_id, old = replaced
        lines.append(f"  {body_kind(run)}, as a diff against {short(old_id)}, which it "
                     "superseded:")
        lines += [f"    {clean(ln)}" for ln in body_diff(old, run, f"{short(old_id)}",
                                                         f"{short(pid) or 'this'}")]
    else:
        lines.append(f"  {body_kind(run)}:")
        lines += [f"    {clean(ln)}" for ln in body_text(run)] or ["    (empty)"]
    for entry in run.get("lkg") or ():
        if isinstance(entry, Mapping):
            lines.append(f"  artefact {clean(entry.get('artefact'))}: installs digest "
                         f"{clean(entry.get('digest'))}, smoke test "
                         f"{clean(entry.get('smoke_test'))}")
    if run.get("lkg") is not None:
        revert = run.get("revert")
        lines.append("  reversal, run later under this approval: "
                     + (clean(json.dumps(revert, sort_keys=True)) + " (the proposer's own)"
                        if revert is not None else
                        "restore every artefact above to its last-known-good, as the owning "
                        "service confirms it before the apply"))
    return lines


def schema_line(found: object) -> str | None:
    """The class the owning schema store gave a pending `schema:` change, as one line (its
    claim, shown before an operator approves): `schema class: <class> (<reason>)`; None for a
    proposal that is no schema change."""
    if not isinstance(found, Mapping):
        return None
    line = f"schema class: {clean(found.get('class'))} ({clean(found.get('reason'))})"
    if found.get("unverified"):
        line += f"; unverified: {clean(found.get('unverified'))}"
    return line


def proposer_text(proposer: object, origin_actor: object, verified: bool = True) -> str:
    """Who proposed, as the chain says: the verified signer of a signed proposal
    (`agent:svc:a (signed)`), else `unsigned` with the origin the sender declared, which proves
    nothing. `verified`: the chain's signatures were checked; otherwise the signer is only
    the chain's word."""
    if proposer:
        return f"{clean(proposer)} (signed" + ("" if verified else
                                                  "; the chain is not verified") + ")"
    return f"unsigned (origin.actor {clean(origin_actor)}, declared)"


# -- who signed --------------------------------------------------------------------------------

def keyids(body: Mapping[str, Any]) -> list[str]:
    env = body.get("envelope")
    sigs = env.get("signatures") if isinstance(env, Mapping) else None
    return [clean(s.get("keyid")) for s in sigs or () if isinstance(s, Mapping)]


def signed(trailers: Iterable[Mapping[str, Any]]) -> list[str]:
    """Who signed what on the chain, in order: every operator's or voter's act (with the key
    it was signed with), every refusal of one, and the authority each apply ran under."""
    lines = []
    for body in trailers:
        data = _data(body)
        if data is None:
            continue
        by, at = clean(body.get("actor")), stamp(body.get("at"))
        keys = keyids(body)
        key = f" (key {', '.join(k[:24] for k in keys)})" if keys else ""
        match data:
            case Refused(code=code):
                lines.append(f"refused act {clean(code)} at {at}{key}: "
                             f"{clean(body.get('reason', ''))}")
            case Voted(vote=vote, session=session):
                lines.append(f"{clean(vote or 'vote')} vote by {by} (session "
                             f"{clean(session or '?')}) at {at}{key}")
            case QuorumReached(authority=under) | Inherited(authority=under):
                lines.append(f"{verdict_of(data)}: approved under {clean(under or by)} at {at}")
            case Approved() | Rejected() | Decided() | RollbackAsked() | GrantAct() \
                    | AutonomyState() if _operators(data, body, keys):
                lines.append(f"{verdict_of(data)} by {by} at {at}{key}")
            case Dispatched(dispatch=dispatch, authority=str(under)):
                what = "rollback" if dispatch == "rollback" else "apply"
                lines.append(f"{what} dispatched under {clean(under)} at {at}")
    return lines


def _operators(data: TrailerData, body: Mapping[str, Any], keys: list[str]) -> bool:
    """An act an operator signed (or one claiming to be): a triage decision or an autonomy
    trailer only when it is a rejection or a crisis resolution."""
    if isinstance(data, Decided) and data.verdict != "reject":
        return False
    if isinstance(data, AutonomyState) and data.verdict != "crisis_resolved":
        return False
    return bool(keys) or str(body.get("actor", "")).startswith("operator:")


def _data(body: object) -> TrailerData | None:
    """What a raw trailer body says, or None when it is no trailer this version reads."""
    if not isinstance(body, Mapping):
        return None
    try:
        return decode_body(body)
    except TrailerDataError:
        return None


# -- the terminal views ------------------------------------------------------------------------


def review_text(rows: Sequence[Mapping[str, Any]]) -> str:
    """`improved review` for a person: each item's id, service, class and gate, what it waits
    for and why, its summary, target, evidence, what will run, and how to decide."""
    if not rows:
        return "nothing waits for an operator\n"
    out: list[str] = [f"{len(rows)} waiting for an operator, oldest first\n"]
    for q in rows:
        pid = str(q["proposal_id"])
        s, ev = q["signals"], q["evidence"]
        out.append(f"{pid}  {clean(q['service'])}  {q['class']} gated {q['gate']} "
                   f"({clean(q['cause'])})")
        out.append(f"  {clean(q['summary'])}")
        out.append(f"  target {clean(q['target'])}  scope {q['scope']}"
                   + (f"  skill {clean(q['skill'])}" if q.get("skill") else ""))
        schema = schema_line(q.get("schema_class"))
        if schema is not None:
            out.append(f"  {schema}")
        out.append(f"  waits for {waits_for('pending', q['cause'])}, since "
                   f"{stamp(q['waiting_since'])}")
        out.append(f"  why waiting: {clean(q['rationale'])}")
        out.append(f"  from {clean(q['origin'])} via {clean(q['analyzer'])}")
        out.append(f"  proposer: {proposer_text(q.get('proposer'), q['origin'])}")
        out.append(f"  signals: {s['counted']} counted, {s['positive']} positive, "
                   f"{s['independent_positive']} independent positive")
        if ev["derived_from"] or ev["evidence_query"] or ev["metric"]:
            out.append(f"  evidence: {ev['derived_from']} grains"
                       + (f", query {clean(ev['evidence_query'])}" if ev["evidence_query"]
                          else "")
                       + (f", metric {clean(json.dumps(ev['metric'], sort_keys=True))}"
                          if ev["metric"] else ""))
        if q["target_files"]:
            out.append(f"  files: {', '.join(clean(f) for f in q['target_files'])}")
        out += [f"  {line}" for line in body_lines(q["will_run"], q["will_run_digest"],
                                                    pid=pid)]
        if q["votes"]:
            out.append(f"  quorum votes: {'; '.join(clean(v) for v in q['votes'])}")
        if q["constitution_edit"]:
            out.append(f"  constitution edit amending {clean(q['constitution_edit'])}: "
                       "approving it marks it ready; you commit the diff by hand")
        if q["cause"] == "surfaced":
            out.append(f"  surfaced only (L1 is never applied): improved reject {pid} "
                       "--reason '…' teaches its analyzer; re-propose at L2 to act on it\n")
        else:
            out.append(f"  decide: improved approve {pid} --reason '…'   "
                       f"| improved reject {pid} --reason '…'\n")
    return "\n".join(out)


def timeline(trailers: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The chain's trailers in order, each as what a person reads: position, stage, verdict
    and cause, actor, time, hash (full) and reason."""
    rows = []
    for body in trailers:
        if not isinstance(body, Mapping):
            rows.append({"seq": "?", "stage": "?", "verdict": "not a trailer", "actor": "",
                         "at": "", "hash": "", "reason": clean(body)})
            continue
        verdict = body.get("verdict") or ""
        cause = body.get("cause")
        rows.append({
            "seq": clean(body.get("seq")),
            "stage": f"{clean(body.get('from_stage'))} → {clean(body.get('to_stage'))}",
            "verdict": clean(f"{verdict}/{cause}" if cause else verdict),
            "actor": clean(body.get("actor", "")),
            "at": stamp(body.get("at")),
            "hash": clean(body.get("hash", "")),
            "reason": clean(body.get("reason", "")),
        })
    return rows


def waiting(facts: Mapping[str, Any]) -> tuple[str | None, str | None, bool, bool]:
    """`waits_for`'s arguments from `proposals.Shown.facts`."""
    return (facts.get("status"), facts.get("cause"), bool(facts.get("in_flight")),
            bool(facts.get("superseded_by")))


def show_text(view: Mapping[str, Any], facts: Mapping[str, Any]) -> str:
    """`improved show` for a person. `view` is what `--format json` prints; `facts` what the
    chain's replay adds (`proposals.Shown.facts`): id, service, class, gate, status, target,
    summary, cause, rationale, the replaced proposal's body."""
    pid = str(facts["proposal_id"])
    out = [f"{short(pid)}  {clean(facts.get('service'))}  {clean(facts.get('summary'))}",
           f"  id        {pid}",
           f"  target    {clean(facts.get('target'))}  scope {clean(facts.get('scope'))}",
           f"  class     {clean(facts.get('class'))}, gated {clean(facts.get('gate'))}",
           "  proposer: " + proposer_text(facts.get("proposer"), facts.get("origin"),
                                          bool(facts.get("verified"))),
           f"  state     {clean(facts.get('status'))} at stage {clean(facts.get('stage'))}"
           + (f", superseded by {short(str(facts['superseded_by']))}"
              if facts.get("superseded_by") else "")
           + (f", valid to {stamp(facts['valid_to'])}" if facts.get("valid_to") else ""),
           f"  waits for {waits_for(*waiting(facts))}"]
    schema = schema_line(facts.get("schema_class"))
    if schema is not None:
        out.insert(4, f"  {schema}")  # after the class line
    decision = view.get("decision") or facts.get("decision")
    if isinstance(decision, Mapping):
        said = decision.get("verdict")
        if decision.get("cause"):
            said = f"{said}/{decision.get('cause')}"
        out.append(f"  decision  {clean(said)} by {clean(decision.get('actor'))} at "
                   f"{stamp(decision.get('at'))}: {clean(decision.get('rationale'))}")
    outcome = view.get("outcome")
    if isinstance(outcome, Mapping):
        out.append(f"  outcome   {'applied' if outcome.get('ok') else 'failed'} under "
                   f"{clean(outcome.get('authority'))} at {stamp(outcome.get('at'))}"
                   + (f", schema class {clean(outcome['schema_class'])} (the service's claim)"
                      if outcome.get("schema_class") else "")
                   + (f": {clean(outcome.get('error'))}" if outcome.get("error") else ""))
    learn = view.get("learn_back")
    if isinstance(learn, Mapping):
        out.append(f"  learn-back {clean(learn.get('verdict'))}: "
                   f"{clean(learn.get('signals_counted'))} signals, "
                   f"{clean(learn.get('independent'))} independent")
        if learn.get("measured"):  # asked at review_after: held, regressed or unmeasured
            value = learn.get("value")
            out.append(f"  measured  {clean(learn.get('measured'))}: {clean(learn.get('metric'))} "
                       + (f"{clean(value)} " if value is not None else "no value ")
                       + f"against baseline {clean(learn.get('baseline'))}")
    who = signed(view.get("trailers") or ())
    out.append("  signed    " + ("\n            ".join(who) if who else "no signed act yet"))
    out.append(f"  chain     {clean(view.get('chain'))}")
    run = view.get("will_run")
    if isinstance(run, Mapping):
        out += [f"  {line}" for line in body_lines(run, view.get("will_run_digest"),
                                                    facts.get("replaced"), pid)]
    else:
        out.append(f"  will run: {clean(run)}")
    out.append("  trailers:")
    for row in timeline(view.get("trailers") or ()):
        out.append(f"    {row['seq']:>3}  {row['stage']:<22} {row['verdict']:<28} "
                   f"{row['actor']:<28} {row['at']}  {row['hash'][:16]}")
    return "\n".join(out) + "\n"
