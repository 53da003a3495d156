"""Read models of the terminal: what `review` and `status` show, read from the review index,
the retained records and the audit chains. Nothing here changes anything."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from nats.aio.client import Client

from improved.cli.audit import log_trusted
from improved.cli.common import deployment
from improved.client import indexing
from improved.client.answers import Answers
from improved.client.config import Config, Trust
from improved.client.connection import Target
from improved.client.deployment import Deployment
from improved.client.indexing import IndexRead
from improved.client.records import TOMBSTONE_TTL_S
from improved.core import authority, boundary, indexes, queue, schemas
from improved.core.policy import Policy
from improved.core.record import ProposalRecord
from improved.protocol import subjects as S
from improved.protocol.model import ClassifyReply, ClassifyRequest, Proposal, to_json


async def review_queue(url: str | Target, policy: Policy | None = None) -> list[dict[str, Any]]:
    """What `improved review` lists: every proposal in the operator's queue (`queue.queued`:
    waiting for an operator or a quorum, or a surfaced L1), oldest first."""
    listed, _ = await review_view(url, policy or Policy())
    return listed


async def review_view(url: str | Target, policy: Policy,
                      config: Config | None = None) -> tuple[list[dict[str, Any]], str]:
    """The review queue, and where it was read: `index` or `chains`."""
    rows, found = await review_read(url, policy, config)
    return rows, found.source


async def review_read(url: str | Target, policy: Policy, config: Config | None = None,
                      ) -> tuple[list[dict[str, Any]], IndexRead]:
    """The review queue, and how the review index was read (`queued_records`). With
    `config`: its trusted daemon keys and its checkpoint interval, and its trust store,
    whose answers to `<svc>.improve.classify` count as the service's own (its
    `[trust.signers]` and `subjects_bound`)."""
    async with deployment(url, bind=False) as store:
        records, index_read = await queued_records(
            store, policy, await log_trusted(store, config) if config is not None else set(),
            indexes.tombstone_ttl_s(config.checkpoint_interval_s) if config is not None
            else TOMBSTONE_TTL_S)
        answers = asker(store.nc, config.trust if config is not None else None)
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
        return sorted(rows, key=lambda q: q["waiting_since"]), index_read


CLASSIFY_TIMEOUT_S = 2.0  # how long `review` and `show` wait for a schema store's class
SILENT = {"class": "unknown", "reason": "service did not answer"}
classify_reply = msgspec.json.Decoder(ClassifyReply)


def asker(nc: Client, trust: Trust | None) -> Answers:
    """The requests of a read model, each answer judged as the daemon judges its own
    (`core.boundary`), against `trust` (none: nothing is attributable)."""
    trust = trust or Trust()
    signers = trust.signer_store()
    return Answers(nc, lambda: signers, trust.subjects_bound)


async def schema_class(nc: Client, proposal: Proposal, timeout: float = CLASSIFY_TIMEOUT_S,
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


async def queued_records(store: Deployment, policy: Policy, trusted: set[str] | None = None,
                         ttl_s: int = TOMBSTONE_TTL_S) -> tuple[list[ProposalRecord], IndexRead]:
    """The records of the operator's queue, each rebuilt from its chain, and how the review
    index was read. The index only says where to look (anyone who can publish on the records
    stream can write, tombstone or purge an entry): what it lists is listed only when its
    chain says it is queued, and what it omits is found from the chains — when its subjects
    do not hold every member the last checkpoint counted, the chains after the last epoch
    seal are read instead (`client.indexing`). Chains and the checkpoint are believed only
    when written by one of `trusted` (daemon keys), when given; else by hashes and links."""
    now = int(time.time() * 1000)  # as of now: an expired proposal left at its valid_to
    keys = trusted or set()
    counted, why_not = await indexing.last_counted(store, keys)
    found = await indexing.read(store, "review", counted, why_not, indexing.trust_of(keys),
                                policy, now, ttl_s, keys)
    return [r for r in found.members if queue.queued(r, now)], found


async def status_view(url: str | Target, config: Config | None = None) -> dict[str, Any]:
    """The mesh's autonomy state as the daemon decides by it: the autonomy chain's head,
    believed only when a trusted daemon key wrote it and any operator act under it verifies
    (`breaker.believed`: otherwise it reads as a crisis, as the daemon reads it). `verified`
    says which, or that no daemon key is known here, so nothing could be checked."""
    from improved.cli.audit import chain_trust
    from improved.core import breaker, evidence

    config = config or Config()
    async with deployment(url, bind=False) as store:
        seq, body = await store.chain_head(S.autonomy_audit(breaker.AUTONOMY_ID))
        daemons = await log_trusted(store, config)
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
