"""Commands about one proposal or the queue: propose, show, review, status, skill hash."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from improved.cli import ids, render, verdicts
from improved.cli.audit import chain_trust, settled_anchors
from improved.cli.common import (
    add_connection_args,
    config_of,
    deployment,
    json_object,
    load_signing_key,
    located,
    out,
    read_input,
    request,
    url_of,
)
from improved.cli.errors import REFUSED, USAGE, Failure
from improved.cli.queries import review_read, schema_class, status_view
from improved.cli.verdicts import chain_said, is_sound
from improved.client.config import Config
from improved.client.connection import Target
from improved.client.deployment import Deployment
from improved.client.sdk import signed
from improved.core import audit, authority
from improved.protocol import canonical, wire
from improved.protocol import subjects as S
from improved.protocol.model import TriageRequest, to_json

if TYPE_CHECKING:
    from improved.core.record import ProposalRecord


# the error replies about the proposal's own bytes: a bad input file, exit 2 (errors.py)
MALFORMED = frozenset({wire.INVALID_JSON, wire.INVALID_TYPE, wire.INVALID_VALUE,
                       wire.MISSING_FIELD, wire.UNKNOWN_FIELD, wire.STATUS_FORBIDDEN,
                       wire.TOO_LARGE, wire.TOO_DEEP, wire.BODY_COUNT, wire.SUBJECT_MISMATCH})


def cmd_propose(args: argparse.Namespace) -> int:
    """Propose, then say the triage decision the daemon made in the same request: its cause
    and what follows or what to fix (`--json`: the reply with that decision). Exit 1 when the
    reply is an error, or the proposal was rejected or expired."""
    config = config_of(args)
    data = read_input(args.file, "proposal file")
    doc = json_object(data, args.file, "proposal")
    svc = doc.get("service")
    if not isinstance(svc, str) or not S.SERVICE_RE.match(svc):
        where = "stdin" if args.file == "-" else args.file
        said = "no `service`" if svc is None else f"`service` {svc!r}, not a service name"
        raise Failure(f"{where} has {said}: the proposal names the service that owns its "
                      "target (lowercase letters, digits, _ and -, first a letter)", USAGE)
    if args.key:  # signed: the key's [trust.signers] identity is the verified proposer
        data = signed("proposal", data, load_signing_key(Path(args.key)))
    url = url_of(args, config)
    reply = asyncio.run(request(url, S.propose_request(svc), data, args.timeout))
    if "error" in reply:
        if args.json:
            out(reply)
            return refusal_code(reply)
        err = reply["error"]
        field = f" ({err['field']})" if err.get("field") else ""
        raise Failure(f"refused {err.get('code')}{field}: {err.get('message')}",
                      refusal_code(reply))
    pid, status = reply["proposal_id"], reply["status"]
    chain = asyncio.run(_chain(url, svc, pid))
    target = doc.get("target_ref")
    target = target if isinstance(target, str) else ""
    verdict = verdicts.of_triage(pid, status, chain, target)
    if args.json:
        decision = next((b for b in reversed(chain) if b.get("to_stage") == "triage"), None)
        out({**reply, "decision": None if decision is None else {
            "verdict": decision.get("verdict"), "cause": decision.get("cause"),
            "gate_class": decision.get("gate_class"), "reason": decision.get("reason")},
            "says": verdict.line})
    elif verdict.accepted:
        print(verdict.line)
    else:
        print(f"improved propose: {verdict.line}", file=sys.stderr)
    return verdict.exit_code


def refusal_code(reply: dict[str, Any]) -> int:
    """The exit code of the daemon's error reply to a proposal: 2 when the proposal itself is
    malformed (what `propose` refuses locally too: the file is the problem), else 1."""
    code = reply.get("error", {}).get("code") if isinstance(reply.get("error"), dict) else None
    return USAGE if code in MALFORMED else REFUSED


async def _chain(url: str | Target, svc: str, pid: str) -> list[dict[str, Any]]:
    """The new proposal's chain (its registration and triage: a few direct gets)."""
    async with deployment(url, bind=False) as store:
        return [body for _, body in await store.read_chain(svc, pid)]


@dataclass(frozen=True)
class Shown:
    """What `improved show` read about one proposal: `view`, what `--format json` prints (the
    retained records, what will run, the trailers, whether the chain verifies), and `facts`,
    what the replay of its chain adds for a person (`render.show_text`, the console)."""

    service: str
    proposal_id: str
    view: dict[str, Any]
    facts: dict[str, Any]


async def shown(store: Deployment, text: str, config: Config, readable: bool = True) -> Shown:
    """Read one proposal (its id or a unique prefix) as `improved show` shows it; `readable`:
    for a person, so the proposal it superseded is looked up too (`replaced`)."""
    from improved.client.chain_writer import decode_trailer
    from improved.core import evidence
    from improved.core.policy import Policy
    from improved.core.propose import rebuild_record

    svc, pid = await ids.resolve(store, text)
    view: dict[str, Any] = {}
    for name, subject in (("state", S.proposal_state(svc, pid)),
                          ("decision", S.triage_decision(svc, pid)),
                          ("outcome", S.apply_outcome(svc, pid)),
                          ("learn_back", S.learn_back(svc, pid)),
                          ("quorum", S.quorum_record(pid))):
        data = await store.last(subject)
        view[name] = msgspec.json.decode(data) if data else None
    sequenced = await store.read_chain(svc, pid)
    chain = [body for _, body in sequenced]
    facts: dict[str, Any] = {"proposal_id": pid, "service": svc}
    try:
        record = rebuild_record([decode_trailer(b) for b in chain],
                                [seq for seq, _ in sequenced], Policy())
        p = record.proposal
        view["will_run"] = authority.will_run(p)
        view["will_run_digest"] = authority.will_run_digest(p)
        facts.update(_facts(record))
        view["proposer"] = record.proposer  # the verified signer; null when unsigned
        view["status"] = facts["status"]  # as of now, from the chain: the retained state may lag
    except (ValueError, KeyError, msgspec.MsgspecError) as exc:
        record = None
        view["will_run"] = f"the chain cannot be replayed: {exc}"
    view["trailers"] = chain
    sources, _ = await settled_anchors(store, config, None, None, False,
                                         lambda line: print(line, file=sys.stderr))
    trust = chain_trust((await store.read_audit(evidence.TRUST_ID))[0], set(sources), config)
    view["chain"] = chain_verdict(pid, sequenced, trust, sources, svc)
    facts["verified"] = view["chain"].startswith("VERIFIED")
    if record is not None and not is_sound(view["chain"]):
        record = None  # a broken chain: nothing is looked up on its word
    if record is not None:  # as of now, from the chain: a retained record may lag or be forged
        for name, value in (("decision", record.decision), ("outcome", record.outcome)):
            if value is not None:
                view[name] = msgspec.to_builtins(value)
    if record is not None and readable:
        facts["replaced"] = await replaced(store, svc, record)
        if facts["status"] == "pending":  # what an operator deciding on it should know
            facts["schema_class"] = await schema_class(store.nc, record.proposal,
                                                       trust=config.trust)
    return Shown(svc, pid, view, facts)


def chain_verdict(pid: str, sequenced: list[tuple[int, dict[str, Any]]],
                  trust: audit.Authenticity, sources: Mapping[str, str],
                  service: str | None = None) -> str:
    """Whether one proposal's chain verifies, in the words `improved show` and `improved audit
    verify` share (`verdicts.chain_said`): its hashes and links and the lifecycle they record
    (`audit.verify_chain`), then who wrote each trailer and the signed act under each authority
    trailer (`audit.verify_writers`) against the trusted daemon keys (`sources`: key id →
    where it was found); with none, only what shows without one (UNVERIFIED writers)."""
    chain = [body for _, body in sequenced]
    brk = audit.verify_chain(pid, chain, service=service) or audit.verify_writers(
        pid, chain, trust, [seq for seq, _ in sequenced])
    return chain_said(str(brk) if brk is not None else None, sources)


def _facts(record: ProposalRecord) -> dict[str, Any]:
    """What the replay adds for a person; the status as of now (`record.status_at`: expired
    once `valid_to` passed, whether or not the chain records it yet)."""
    from improved.core.record import status_at

    d, p = record.decision, record.proposal
    return {
        "summary": record.summary_text, "target": p.target_ref, "scope": p.scope,
        "class": p.change_class, "gate": record.gate_class,
        "status": status_at(record, int(time.time() * 1000)), "valid_to": p.valid_to,
        "stage": record.stage, "cause": d.cause if d is not None else None,
        "decision": msgspec.to_builtins(d) if d is not None else None,
        "superseded_by": record.superseded_by, "in_flight": record.in_flight,
        "dedup_key": record.dedup_key, "created_at": p.created_at,
        "proposer": record.proposer, "origin": p.origin.actor,
    }


REPLACED_SCAN = 1000  # retained states of a service read, at most, to find what it replaced
READ_AT_ONCE = 32


async def replaced(store: Deployment, svc: str, record: ProposalRecord
                   ) -> tuple[str, dict[str, Any]] | None:
    """(id, will_run) of the proposal `record` superseded — the newest older content under the
    same dedup_key whose chain says `superseded_by` this one — or None. The retained states of
    the service (a cache) only say where to look; the chain decides. At most REPLACED_SCAN
    states are read: beyond that the body is shown without a diff."""
    from improved.client.chain_writer import decode_trailer
    from improved.core.policy import Policy
    from improved.core.propose import rebuild_record

    listing = await store.js.stream_info(S.STREAM_RECORDS,
                                         subjects_filter=S.proposal_state(svc, "*"))
    subjects = [s for s in (listing.state.subjects or {})
                if S.token(s, 3) != record.proposal_id]
    if not subjects or len(subjects) > REPLACED_SCAN:
        return None
    limit = asyncio.Semaphore(READ_AT_ONCE)

    async def same_key(subject: str) -> tuple[int, str] | None:
        async with limit:
            data = await store.last(subject)
        try:
            state = msgspec.json.decode(data) if data else None
        except msgspec.DecodeError:
            return None
        if not isinstance(state, dict) or state.get("dedup_key") != record.dedup_key:
            return None
        at = state.get("updated_at")
        return (at if isinstance(at, int) else 0), str(S.token(subject, 3))

    found = [f for f in await asyncio.gather(*(same_key(s) for s in subjects)) if f]
    for _, other in sorted(found, reverse=True):
        sequenced = await store.read_chain(svc, other)
        chain = [body for _, body in sequenced]
        if not chain or audit.verify_links(other, chain) is not None:
            continue
        try:
            old = rebuild_record([decode_trailer(b) for b in chain],
                                 [seq for seq, _ in sequenced], Policy())
        except (ValueError, KeyError, msgspec.MsgspecError):
            continue
        if old.superseded_by == record.proposal_id:
            return other, authority.will_run(old.proposal)
    return None


RETRY_GRACE_S = 2.0  # how long `retry` reads the chain after the daemon answered


def cmd_retry(args: argparse.Namespace) -> int:
    """Resume an apply now: a triage request carries the proposal on as far as its gate
    allows (the daemon makes the pass while it answers); then the outcome on its chain."""
    from improved.core import apply as apply_stage

    url = url_of(args, config_of(args))
    svc, record = located(url, args.id)
    pid = record.proposal_id
    if record.status in ("applied", "rolled_back"):
        print(f"{pid} is {record.status} already: nothing to retry")
        return 0
    if not apply_stage.needs_apply(record):
        d = record.decision
        said = f"{d.verdict}/{d.cause}" if d is not None and d.cause else \
            d.verdict if d is not None else "not triaged"
        key = str(d.cause) if d is not None and d.cause else "invalid"
        raise Failure(f"nothing to retry: {pid} is {record.status} ({said}), no apply is due; "
                      + verdicts.TRIAGE_NEXT.get(key, "`improved show {id}` says why")
                      .format(id=pid))
    verdict = asyncio.run(_retry(url, svc, pid, args.timeout))
    return verdicts.conclude(verdict, f"the retry of {pid}", args.timeout,
                             f"improved show {pid}")


async def _retry(url: str | Target, svc: str, pid: str, timeout: float
                 ) -> verdicts.Verdict | None:
    """The daemon makes the pass before it answers the triage request, so what the pass
    wrote is on the chain by then: a short look after the reply, not the whole timeout."""
    from nats.errors import NoRespondersError

    chain = S.audit(svc, pid)
    async with deployment(url, bind=False) as store:
        head, _ = await store.chain_head(chain)
        try:
            reply = msgspec.json.decode((await store.nc.request(
                S.triage_request(svc), to_json(TriageRequest(proposal_id=pid)),
                timeout=timeout)).data)
        except NoRespondersError:
            raise Failure(f"nothing serves {S.triage_request(svc)}: is the daemon running "
                          "(on this server)?") from None
        except TimeoutError:
            return None
        if isinstance(reply, dict) and "error" in reply:
            err = reply["error"]
            raise Failure(f"refused {err.get('code')}: {err.get('message')}")
        found = await verdicts.watch(lambda start: store.read_chain_at(chain, start), head + 1,
                                     lambda seen: verdicts.of_apply(pid, seen),
                                     RETRY_GRACE_S)
        if found is not None:
            return found
        last = await store.last(S.apply_outcome(svc, pid))
        outcome = msgspec.json.decode(last) if last else {}
        error = str(outcome.get("error") or "")
        if error.startswith("unreachable"):  # the order may have reached it: still in flight
            return verdicts.Verdict(False, f"refused: {pid}: its service did not answer "
                                           f"({error}); the order stays in flight and the "
                                           "daemon sends it again on its own", "unreachable")
        return None


def text_wanted(args: argparse.Namespace) -> bool:
    """`--format text|json`, else (`auto`) text on a terminal and JSON otherwise, as `show`
    always printed to a pipe; `--json` is `--format json`."""
    if getattr(args, "json", False):
        return False
    return args.format == "text" or (args.format == "auto" and sys.stdout.isatty())


async def _show(url: str | Target, text: str, config: Config, readable: bool) -> int:
    async with deployment(url) as store:
        seen = await shown(store, text, config, readable)
    if readable:
        sys.stdout.write(render.show_text(seen.view, seen.facts))
    else:
        out(seen.view)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    config = config_of(args)
    return asyncio.run(_show(url_of(args, config), args.id, config, text_wanted(args)))


def cmd_review(args: argparse.Namespace) -> int:
    config = config_of(args)
    queue, found = asyncio.run(review_read(url_of(args, config), config.policy, config))
    if found.source == "chains":
        print(f"improved review: {found.why}", file=sys.stderr)
    if not text_wanted(args):
        out(queue)
        return 0
    sys.stdout.write(render.review_text(queue))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    config = config_of(args)
    out(asyncio.run(status_view(url_of(args, config), config)))
    return 0


def cmd_skill_hash(args: argparse.Namespace) -> int:
    data = read_input(args.file, "skill definition")
    doc: object = json_object(data, args.file, "skill definition")
    if isinstance(doc, dict) and isinstance(doc.get("proposal_data"), dict):
        doc = doc["proposal_data"].get("skill", doc)  # a whole proposal: hash its skill
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        print("improved skill hash: expected a skill definition with a name", file=sys.stderr)
        return 2
    print(canonical.skill_identity(doc))
    return 0


def add_format_args(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--format", choices=("auto", "text", "json"), default=default,
                   help="text: a summary for a person (class, gate, what it waits for, who "
                        "signed, the body as a diff); json: the read model as JSON; auto: "
                        f"text on a terminal, else JSON (default: {default})")
    p.add_argument("--json", action="store_true", help="the same as --format json")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `proposals` commands to the `improved` parser."""
    prop = sub.add_parser(
        "propose", help="submit a proposal (JSON) and say how triage decided it",
        description="Send a Proposal (DESIGN §3.2) to <service>.improve.propose and print, in "
                    "one line, its id, status and the triage decision with its cause and what "
                    "follows or what to fix (--json: the reply {proposal_id, status} with that "
                    "decision), or the error naming the bad field. Exits 1 on an error reply "
                    "and when the proposal is rejected or expired.")
    add_connection_args(prop)
    prop.add_argument("file", metavar="FILE|-", help="the proposal JSON, or - for stdin")
    prop.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (10)")
    prop.add_argument("--key", metavar="FILE",
                      help="sign the proposal with this private key (an agent:<svc>:<name> or "
                           "service:<svc> key in the daemon's [trust.signers]): its identity "
                           "is then the verified proposer; the id stays the proposal's")
    prop.add_argument("--json", action="store_true",
                      help="print the reply and the decision as JSON")
    prop.set_defaults(func=cmd_propose)

    show = sub.add_parser(
        "show", help="show a proposal: state, decision, outcome, trailers",
        description="Print a proposal's retained records (state, triage decision, apply "
                    "outcome, learn-back) and its audit trailers, and whether the chain "
                    "verifies. On a terminal (or with --format text) as a summary for a "
                    "person: id, service, target, class and gate, what it waits for, the "
                    "decision and its cause, who signed, the chain's verdict, what will run "
                    "as a diff against the proposal it superseded (else the body), and the "
                    "trailers; to a pipe (or with --format json) as JSON.")
    add_connection_args(show)
    show.add_argument("id", metavar="ID", type=ids.id_arg,
                      help="the proposal id, or a unique prefix of it (at least 4 hex digits)")
    add_format_args(show, "auto")
    show.set_defaults(func=cmd_show)

    retry = sub.add_parser(
        "retry", help="resume an apply that found its service unreachable, now",
        description="When the owning service does not answer, the daemon retries the apply on "
                    "a slow backoff on its own (apply.retry_max_s). This asks the daemon for "
                    "the proposal's next step now (a triage request on <svc>.improve.triage) "
                    "and waits for the outcome on its chain: applied (exit 0), refused by "
                    "the service or still unreachable (exit 1).")
    add_connection_args(retry)
    retry.add_argument("id", metavar="ID", type=ids.id_arg,
                       help="the proposal id, or a unique prefix of it (at least 4 hex digits)")
    retry.add_argument("--timeout", type=float, default=30.0, metavar="S",
                       help="seconds to wait for the daemon's pass, which may try the service "
                            "apply.attempts times of apply.timeout_s each (30)")
    retry.set_defaults(func=cmd_retry)

    status = sub.add_parser(
        "status", help="autonomy switch, circuit breaker and store size",
        description="Print the autonomy switch and the circuit breaker as the autonomy chain "
                    "records them (constitution IV.5/IV.6: autonomous applies pause after "
                    "repeated rollbacks), and how many trailers and retained records there are.")
    add_connection_args(status)
    status.set_defaults(func=cmd_status)

    review = sub.add_parser(
        "review", help="the queue of proposals waiting for an operator",
        description="List every proposal waiting for an operator (L2/L4 awaiting_operator, L3 "
                    "without a grant) with its rendered summary, class, target, cause, "
                    "evidence and independent-signal counts, oldest first.")
    add_connection_args(review)
    add_format_args(review, "text")
    review.set_defaults(func=cmd_review)

    skill = sub.add_parser("skill", help="skill tools", description="Skill tools.")
    skill_sub = skill.add_subparsers(dest="skill_command", required=True, metavar="ACTION")
    shash = skill_sub.add_parser(
        "hash", help="print a skill's NAME:SHA256 identity",
        description="Print NAME:SHA256, the content identity an L3 grant binds: SHA-256 of "
                    "the canonical MessagePack of the skill's definition fields only. FILE is "
                    "a skill definition, or a proposal carrying one in proposal_data.skill.")
    shash.add_argument("file", metavar="FILE|-")
    shash.set_defaults(func=cmd_skill_hash)
