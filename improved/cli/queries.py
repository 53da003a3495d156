"""Read models of the terminal: what `review` and `status` show, read from the review index,
the retained records and the audit chains. Nothing here changes anything."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from nats.js.errors import NotFoundError

from improved.cli.common import deployment
from improved.core import authority, boundary, queue, schemas
from improved.core.policy import Policy
from improved.core.propose import rebuild_record
from improved.core.record import ProposalRecord
from improved.protocol import subjects as S
from improved.protocol.model import ClassifyReply, ClassifyRequest, Proposal, to_json
from improved.runtime.answers import Answers
from improved.runtime.bus import Target
from improved.runtime.config import Config, Trust
from improved.runtime.store import Store, decode_trailer


async def review_queue(url: str | Target, policy: Policy | None = None) -> list[dict[str, Any]]:
    """What `improved review` lists: every proposal in the operator's queue (`queue.queued`:
    waiting for an operator or a quorum, or a surfaced L1), oldest first."""
    listed, _ = await review_view(url, policy or Policy())
    return listed


async def review_view(url: str | Target, policy: Policy, trust: Trust | None = None,
                      ) -> tuple[list[dict[str, Any]], str]:
    """The review queue, and where it was read: `index` or `chains`. `trust`: whose answers
    to `<svc>.improve.classify` count as the service's own (its `[trust.signers]` and
    `subjects_bound`)."""
    async with deployment(url, bind=False) as store:
        records, source = await queued_records(store, policy)
        answers = asker(store.nc, trust)
        try:
            classes = await asyncio.gather(*(schema_class(store.nc, r.proposal, answers=answers)
                                             for r in records))
        finally:
            await answers.close()
        rows = []
        for record, found in zip(records, classes, strict=True):
            d, p = record.decision, record.proposal
            assert d is not None  # queued: deferred or accepted, so decided
            rows.append({
                "proposal_id": record.proposal_id, "service": record.service,
                "summary": record.summary_text,
                "votes": [f"{b.vote} by {b.voter} ({b.session})" for b in record.ballots],
                "constitution_edit": p.amends,
                "class": p.change_class, "gate": record.gate_class, "target": p.target_ref,
                "cause": "surfaced" if queue.surfaced(record) else d.cause,
                "rationale": d.rationale, "scope": p.scope,
                "origin": p.origin.actor, "analyzer": p.analyzer.id, "skill": record.skill,
                "proposer": record.proposer,  # the verified signer; None when unsigned
                "signals": {"counted": len(record.signals), "positive": record.positives,
                            "independent_positive": record.independent_positives},
                "evidence": {"derived_from": len(p.derived_from or ()),
                             "evidence_query": p.evidence_query,
                             "metric": msgspec.to_builtins(p.metric_snapshot)
                             if p.metric_snapshot else None},
                "target_files": p.target_files or [], "valid_to": p.valid_to,
                "waiting_since": d.at,
                "will_run": authority.will_run(p),
                "will_run_digest": authority.will_run_digest(p),
                "schema_class": found,
            })
        return sorted(rows, key=lambda q: q["waiting_since"]), source


CLASSIFY_TIMEOUT_S = 2.0  # how long `review` and `show` wait for a schema store's class
SILENT = {"class": "unknown", "reason": "service did not answer"}
classify_reply = msgspec.json.Decoder(ClassifyReply)


def asker(nc: Any, trust: Trust | None) -> Answers:
    """The requests of a read model, each answer judged as the daemon judges its own
    (`core.boundary`), against `trust` (none: nothing is attributable)."""
    trust = trust or Trust()
    signers = trust.signer_store()
    return Answers(nc, lambda: signers, trust.subjects_bound)


async def schema_class(nc: Any, proposal: Proposal, timeout: float = CLASSIFY_TIMEOUT_S,
                       trust: Trust | None = None, answers: Answers | None = None,
                       ) -> dict[str, str] | None:
    """What the owning schema store says of a `schema:` proposal (`<svc>.improve.classify`):
    `{"class", "reason"}`, class `unknown` when it does not answer in time or answers anything
    but a classification (`classified`); None for a proposal that is no schema change. The
    store's claim, shown to the operator; nothing decides on it. Who said it
    (`core.boundary`): an answer attributable to the service carries `by`; where the service
    could be attributed but no answer was its own, the class is `unknown`; where nothing it
    says could be (no key trusted for it, no bound subjects), its answer is shown with
    `unverified` saying so."""
    from nats.errors import Error as NatsError

    if not schemas.is_schema(proposal.target_ref):
        return None
    own = answers is None
    answers = answers or asker(nc, trust)
    svc = proposal.service
    try:
        heard = await answers.ask(svc, S.classify_request(svc),
                                  to_json(ClassifyRequest(proposal=proposal)), timeout)
    except (NatsError, TimeoutError):  # no responders, no answer in time, connection gone
        return dict(SILENT)
    finally:
        if own:
            await answers.close()
    chosen = boundary.choose(heard)
    if isinstance(chosen, boundary.Conflict):
        return {"class": "unknown", "reason": f"{chosen.attribution} disagree"}
    if isinstance(chosen, boundary.Attested):
        return {**classified(chosen.value), "by": chosen.by}
    if chosen is None or answers.attestable(svc):
        why = chosen.why if chosen is not None else "no answer"
        return {"class": "unknown", "reason": f"no answer attributable to service:{svc} "
                                              f"({why})"}
    return {**classified(chosen.value), "unverified": chosen.why}


def classified(data: bytes) -> dict[str, str]:
    """A classify reply as `{"class", "reason"}`: the store's class and reason; for its error
    reply, class `unknown` and its message; for anything else, `unknown` and one line saying
    so. Never raises."""
    try:
        found = classify_reply.decode(data)
    except msgspec.MsgspecError as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    else:
        return {"class": found.class_, "reason": found.reason}
    try:
        error = msgspec.json.decode(data).get("error")
    except (msgspec.MsgspecError, AttributeError):
        error = None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return {"class": "unknown", "reason": f"the service could not classify it: "
                                              f"{error['message'][:500]}"}
    return {"class": "unknown", "reason": f"the service's answer is not a classification "
                                          f"({why[:200]})"}


REBUILD_AT_ONCE = 32  # chains read at a time for the items the index lists


async def queued_records(store: Store, policy: Policy) -> tuple[list[ProposalRecord], str]:
    """The records of the operator's queue, each rebuilt from its chain, and where the list
    came from. From the review index when the daemon marked it whole (`Store.filled`): it
    says where to look, in O(open items), and only what its chain says is queued is listed
    (anyone who can publish on the records stream could write an entry). Else — while the
    daemon refills lost records (memory storage across a broker restart, a purge, an
    upgrade) — from every chain."""
    now = int(time.time() * 1000)  # as of now: an expired proposal left at its valid_to
    try:
        whole = await store.filled()
    except NotFoundError:
        whole = False
    if not whole:
        return [r for r in await _every_record(store, policy) if queue.queued(r, now)], "chains"
    limit = asyncio.Semaphore(REBUILD_AT_ONCE)

    async def rebuilt(svc: str, pid: str) -> ProposalRecord | None:
        async with limit:
            chain = await store.read_chain(svc, pid)
        return _replayed(chain, policy)

    entries = await store.read_index()
    records = await asyncio.gather(*(rebuilt(e.service, e.proposal_id) for e in entries))
    return [r for r in records if r is not None and queue.queued(r, now)], "index"


async def _every_record(store: Store, policy: Policy) -> list[ProposalRecord]:
    """Every proposal's record, rebuilt from the whole audit log."""
    records = []
    for (svc, _), entries in (await store.sequenced_chains()).items():
        if svc not in S.MESH_CHAINS and (record := _replayed(entries, policy)) is not None:
            records.append(record)
    return records


def _replayed(chain: list[tuple[int, dict]], policy: Policy) -> ProposalRecord | None:
    """A record from its chain as (stream sequence, body) pairs; None when there is none or it
    is not replayable (`improved audit verify` names it)."""
    if not chain:
        return None
    try:
        trailers = [decode_trailer(body) for _, body in chain]
        return rebuild_record(trailers, [seq for seq, _ in chain], policy)
    except (ValueError, KeyError, msgspec.MsgspecError):
        return None


async def status_view(url: str | Target, config: Config | None = None) -> dict[str, Any]:
    """The mesh's autonomy state as the daemon decides by it: the autonomy chain's head,
    believed only when a trusted daemon key wrote it and any operator act under it verifies
    (`breaker.believed`: otherwise it reads as a crisis, as the daemon reads it). `verified`
    says which, or that no daemon key is known here, so nothing could be checked."""
    from improved.cli.audit import chain_trust, trusted_daemons
    from improved.core import breaker, evidence

    config = config or Config()
    async with deployment(url, bind=False) as store:
        seq, body = await store.chain_head(S.autonomy_audit(breaker.AUTONOMY_ID))
        daemons = trusted_daemons(config)
        problem = None
        if body and daemons:
            trust = chain_trust((await store.read_audit(evidence.TRUST_ID))[0], daemons,
                                config)
            problem = trust.problem(body, breaker.AUTONOMY_ID, seq, trust.start())
        state = breaker.believed(body, seq, problem)
        verified = ("nothing recorded yet" if not body else
                    f"not verified: no daemon key here ({NO_KEY_HINT})" if not daemons else
                    f"BROKEN: {problem}" if problem else "verified")
        now = int(time.time() * 1000)
        records = await store.js.stream_info(S.STREAM_RECORDS)
        chains = await store.js.stream_info(S.STREAM_AUDIT)
        return {
            "autonomy_chain": verified,
            "autonomy": state.switch,
            "breaker": ("open until " + when(state.paused_until)
                        if state.blocks(now) == "circuit_open" else "closed"),
            "autonomous_rollbacks_in_window": len(state.rollbacks),
            "holds_autonomous_applies": state.blocks(now),
            "crisis": state.crisis or None,  # while set, no apply at all (resolve it, signed)
            "trailers": chains.state.messages,
            "retained_records": records.state.messages,
        }


NO_KEY_HINT = ("name the daemons' checkpoint keys in [trust] daemons, or run where the "
               "daemon's data directory is")


def when(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))
