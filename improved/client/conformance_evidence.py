"""The conformance kit's probes of what a service emits and takes (SPEC 09 §9): at L1 a sample
proposal checked with the daemon's own decoder and a triage decision it must take; at L4 the
all-or-none window, read from the swaps on record, and the `revert_proposal_id` of every
applied L4 on the audit chains.

Nothing here changes state: the sample is answered to the kit, never published; the decisions
go to the service's conformance subject, not to `improve.triage.<svc>.<id>`; the L4 evidence
is read. What cannot be read (nothing applied yet, a bucket the kit may not read) is reported
as not probed, with why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from improved.client.chains import read_chain
from improved.client.probing import Check, ask, describe_error, error_of, show, unprobed
from improved.client.sdk import MAX_MESSAGE_BYTES
from improved.core import inbound, lkg, propose, trailers
from improved.protocol import subjects as S
from improved.protocol.wire import WireError

PROVENANCE = "Improve-Proposal-Id"  # the header a store tags each write of an apply with
MAX_CHAINS = 200  # audit chains of one service read for the L4 emission check
MAX_REVISIONS = 64  # revisions of the window's key read
EMITS = "emits a valid proposal"


# -- L1: a valid proposal emitted, a triage decision taken -----------------------------------------


def sample_problem(data: bytes, service: str) -> tuple[str | None, str | None]:
    """(why the sample is not a proposal the daemon takes, its id when it is): decoded as the
    daemon decodes `improve.proposals.<svc>` (bare or signed), content-addressed, and carrying
    what its class must (an L4 its `lkg`). Pure."""
    try:
        proposal, _ = inbound.proposal_of(data, service, MAX_MESSAGE_BYTES)
        pid, _ = propose.identify(proposal)
    except WireError as err:
        where = f" at {err.field}" if err.field else ""
        return f"its sample proposal is invalid{where}: {err.code}: {err.message}", None
    except (ValueError, msgspec.MsgspecError) as exc:
        return f"its sample proposal has no content address: {exc}", None
    why = lkg.problem(proposal)
    if why is not None:
        return f"its sample {proposal.change_class} proposal would be rejected invalid: {why}", None
    return None, pid


async def emission(nc: Client, service: str, timeout: float, checks: list[Check]) -> bool:
    """L1: the service emits a valid proposal (its sample) and takes triage decisions."""
    subject = S.conformance_propose(service)
    answer = await ask(nc, subject, {}, timeout)
    name = EMITS
    err = error_of(answer.value) if answer.answered else None
    if not answer.answered:
        why = (f"{answer.problem}: the kit asks a service for a sample of the proposals it "
               "emits there (MeshClient.serve_conformance)")
        if answer.raw:  # not JSON at all: still a sample, and an invalid one
            why = sample_problem(answer.raw, service)[0] or why
        checks.append(Check("L1", name, False, why))
        return False
    if err is not None:
        checks.append(Check("L1", name, False, (
            f"{subject} answered an error instead of a sample: {describe_error(err)}")))
        return False
    problem, pid = sample_problem(answer.raw, service)
    if problem is not None or pid is None:
        checks.append(Check("L1", name, False, problem or "no proposal id"))
        return False
    checks.append(Check("L1", name, True, (
        f"its sample {pid[:12]} decodes as the daemon decodes improve.proposals.{service}")))
    return await _takes_decisions(nc, service, pid, timeout, checks)


def probe_decision(service: str, pid: str, **over: Any) -> dict[str, Any]:
    """A TriageDecision as the daemon retains it on `improve.triage.<svc>.<id>`."""
    return {"proposal_id": pid, "service": service, "verdict": "defer",
            "cause": "awaiting_operator", "gate_class": "L2",
            "rationale": "conformance probe: waits for an operator", "actor": "conformance",
            "at": int(time.time() * 1000), **over}


async def _takes_decisions(nc: Client, service: str, pid: str, timeout: float,
                           checks: list[Check]) -> bool:
    subject = S.conformance_triage(service)
    answer = await ask(nc, subject, probe_decision(service, pid), timeout)
    value = answer.value
    if not answer.answered:
        passed, detail = False, f"{answer.problem}: a triage decision must be taken"
    elif (err := error_of(value)) is not None:
        passed, detail = False, f"a well-formed decision was refused: {describe_error(err)}"
    elif not (isinstance(value, dict) and value.get("taken") is True
              and value.get("proposal_id") == pid and value.get("verdict") == "defer"):
        passed, detail = False, (f"a decision on {pid[:12]} got {show(value)}, not "
                                 "{\"taken\": true, \"proposal_id\", \"verdict\"}")
    else:
        passed, detail = True, f"took a defer decision on {pid[:12]}"
    checks.append(Check("L1", "takes triage decisions", passed, detail))
    if not passed:
        return False
    bad = (("a decision with verdict \"maybe\"", probe_decision(service, pid, verdict="maybe")),
           ("a decision about another service", probe_decision("conformance-other", pid)))
    for what, body in bad:
        answer = await ask(nc, subject, body, timeout)
        err = error_of(answer.value) if answer.answered else None
        if err is None:
            got = answer.problem if not answer.answered else show(answer.value)
            checks.append(Check("L1", "refuses a bad decision", False,
                                f"{what} was not refused with an error reply: {got}"))
            return False
    checks.append(Check("L1", "refuses a bad decision", True, (
        "a decision with an unknown verdict and one about another service were refused")))
    return True


# -- L4: the all-or-none window, and every applied L4's revert_proposal_id ------------------------


@dataclass(frozen=True)
class Revision:
    """One write of the key that holds every artefact's current version."""

    seq: int
    proposal_id: str | None  # the apply that wrote it, when tagged
    value: Any


def window_problem(revisions: list[Revision]) -> tuple[int, str | None]:
    """(how many tagged writes were judged, why the swaps were not all-or-none): every
    revision is one whole version set (a JSON object), and every write of one proposal
    changes the same artefacts — one that swaps some in one write and others in another
    let a reader in between see a mix. Pure."""
    changed: dict[str, tuple[int, frozenset[str]]] = {}
    judged = 0
    previous: Revision | None = None
    for rev in revisions:
        if not isinstance(rev.value, dict):
            return judged, f"revision {rev.seq} is {show(rev.value)}, not one version set"
        if previous is not None and rev.proposal_id is not None:
            assert isinstance(previous.value, dict)
            names = frozenset(k for k in rev.value.keys() | previous.value.keys()
                              if rev.value.get(k) != previous.value.get(k))
            first = changed.setdefault(rev.proposal_id, (rev.seq, names))
            judged += 1
            if first[1] != names:
                return judged, (
                    f"proposal {rev.proposal_id[:12]} changed {sorted(first[1])} in revision "
                    f"{first[0]} and {sorted(names)} in revision {rev.seq}: a reader between "
                    "them saw a mix")
        previous = rev
    return judged, None


async def read_revisions(nc: Client, bucket: str, key: str) -> list[Revision]:
    """The key's revisions still in its bucket (the last MAX_REVISIONS), with their tags."""
    js = nc.jetstream()
    stream, subject = f"KV_{bucket}", f"$KV.{bucket}.{key}"
    out: list[Revision] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return out[-MAX_REVISIONS:]
        try:
            value = msgspec.json.decode(msg.data or b"null")
        except msgspec.DecodeError:
            value = (msg.data or b"").decode(errors="replace")
        out.append(Revision(msg.seq or seq, (msg.headers or {}).get(PROVENANCE), value))
        seq = (msg.seq or seq) + 1


async def atomic_window(nc: Client, service: str, spec: dict[str, Any], timeout: float,
                        checks: list[Check]) -> bool:
    """L4: all or none. The spec says where every artefact's version lives as one value
    (`"window": {"bucket", "key"}`); the swaps on record there are judged."""
    name = "all-or-none window"
    window = spec.get("window")
    if not (isinstance(window, dict) and isinstance(window.get("bucket"), str)
            and isinstance(window.get("key"), str)):
        checks.append(unprobed("L4", name, (
            f"the spec advertises no \"window\" (got {show(window)}): where every artefact's "
            "version is one value; a swap could not be watched")))
        return True
    bucket, key = window["bucket"], window["key"]
    try:
        revisions = await read_revisions(nc, bucket, key)
    except Exception as exc:  # a bucket the kit's user may not read, or none
        checks.append(unprobed("L4", name, f"could not read {bucket}/{key}: {exc or type(exc)}"))
        return True
    judged, problem = window_problem(revisions)
    if problem is not None:
        checks.append(Check("L4", name, False, f"{bucket}/{key}: {problem}"))
        return False
    if judged == 0:
        checks.append(unprobed("L4", name, (
            f"no apply on record in {bucket}/{key} (the kit applies nothing; it judges the "
            "swaps that happened)")))
        return True
    checks.append(Check("L4", name, True, (
        f"{judged} write(s) of applies in {bucket}/{key}, each proposal's artefacts in one")))
    return True


def emitted_problem(chain: list[Any]) -> tuple[bool, str | None]:
    """(whether the chain is an applied L4, why it names no reversal): an L4 whose `applied`
    trailer carries no `revert_proposal_id`. Pure; trailers it cannot read are skipped."""
    pid, l4, applied = None, False, None
    for body in chain:
        try:
            data = trailers.decode_body(body)
        except (msgspec.MsgspecError, ValueError):
            continue
        if isinstance(data, trailers.Registration):
            pid, l4 = body.get("proposal_id"), data.proposal.change_class == "L4"
        elif isinstance(data, trailers.Applied) and data.verdict == "applied":
            applied = data
    if not l4 or applied is None:
        return False, None
    if not applied.revert_proposal_id:
        return True, f"applied L4 {str(pid)[:12]} emitted no revert_proposal_id"
    return True, None


async def reversal_ids(nc: Client, service: str, checks: list[Check]) -> bool:
    """L4: every applied L4 on the service's audit chains emitted its revert_proposal_id."""
    name = "applied L4s emit revert_proposal_id"
    js = nc.jetstream()
    try:
        info = await js.stream_info(S.STREAM_AUDIT, subjects_filter=S.audit(service, "*"))
        subjects = sorted(info.state.subjects or {})[:MAX_CHAINS]
        chains = [await read_chain(js, subject) for subject in subjects]
    except Exception as exc:  # no audit stream, or one the kit's user may not read
        checks.append(unprobed("L4", name, f"could not read the audit chains: {exc or type(exc)}"))
        return True
    applied = 0
    for chain in chains:
        is_l4, problem = emitted_problem(chain)
        if problem is not None:
            checks.append(Check("L4", name, False, problem))
            return False
        applied += is_l4
    if applied == 0:
        checks.append(unprobed("L4", name, (
            f"no applied L4 of {service} on the audit chains (the kit applies nothing)")))
        return True
    checks.append(Check("L4", name, True, (
        f"{applied} applied L4(s) on the chains, each naming its reversal (chains read, not "
        "verified: `improved audit verify` does)")))
    return True
