"""Every NATS subject, stream and bucket name the loop uses, in one place (DESIGN §3.1).

Inbound subjects (requests to the loop) have one token fewer than the outbound, retained record
subjects, so a single-token wildcard keeps the two apart: `improve.proposals.*` is the inbound
stream's filter and `improve.proposals.*.*` the record stream's.
"""

from __future__ import annotations

import hashlib
import re

SERVICE_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}\Z")
ID_RE = re.compile(r"^[0-9a-f]{64}\Z")
SKILL_NAME_RE = SERVICE_RE

# -- inbound: captured by the IMPROVE_IN stream so nothing is lost while no daemon runs ----------
PROPOSALS = "improve.proposals"
TRIAGE = "improve.triage"
APPLIED = "improve.applied"
OUTCOMES = "improve.outcomes"
GRANTS = "improve.grants"
QUORUM = "improve.quorum"
AUDIT = "improve.audit"
REVIEW = "improve.review"  # the operator's queue: one retained entry per open item
DUE = "improve.due"  # learn-back's wake-ups: one retained entry per measurement still to make

INBOUND_FILTERS = (
    f"{PROPOSALS}.*",
    f"{TRIAGE}.*",
    f"{APPLIED}.*",
    f"{OUTCOMES}.*",
    GRANTS,
    QUORUM,
)

# -- outbound records: retained, the latest message per subject is the current state ------------
RECORD_FILTERS = (
    f"{PROPOSALS}.*.*",
    f"{TRIAGE}.*.*",
    f"{APPLIED}.*.*",
    f"{OUTCOMES}.*.*",
    f"{GRANTS}.*.*",
    f"{QUORUM}.*",
    f"{REVIEW}.*.*",
    f"{DUE}.*.*",
)
REVIEW_FILTER = f"{REVIEW}.*.*"
DUE_FILTER = f"{DUE}.*.*"
# The marker a complete refill of the records (and the review index) leaves, in the records
# stream itself, so it is lost with what it vouches for; `_filled` is no service (they start
# [a-z]), and a purge of the review subjects takes it too.
FILLED_MARKER = f"{REVIEW}._filled.records"
AUDIT_FILTER = f"{AUDIT}.*.*"
# The tool runtimes' audit chains (one per runtime, services/improved_reference/tool_runtime.py) live in
# a stream of their own, which no daemon writes or checkpoints (a checkpoint only witnesses each
# chain's last trailer, `runtime_heads:`): a runtime is not one of
# the daemon log's writers, so nothing a runtime (or anyone who may write its subjects) puts
# there can break the daemon's log or open a crisis. `improved audit verify` checks them
# against `[trust.runtimes]`.
TOOLS_AUDIT = "improve.tools.audit"
TOOLS_AUDIT_FILTER = f"{TOOLS_AUDIT}.*"
# The tool runtimes' spent grants and proofs, and their revoked upgrades: marks on streams that
# allow no delete, purge nor roll-up, one message per subject, a second refused, so that no bus
# participant can erase one (as a roll-up purge with a short TTL erases a KV key). Spent marks
# are by act id alone (a grant that names no runtime is spent once for the mesh) and carry a
# TTL; revocations are per runtime and carry none (their stream refuses TTLs, so a forged
# mark that would expire cannot stand in for a revocation).
TOOLS_SPENT = "improve.tools.spent"
TOOLS_SPENT_FILTER = f"{TOOLS_SPENT}.*"
# The spent marks' stream forgets (each mark by its TTL), so it holds a sentinel: written first,
# without a TTL, by whoever makes the stream (or once by `improved provision` into a stream an
# earlier version made). Every limit removes the oldest message first, so while the sentinel is
# there no limit has removed a mark written after it (core/retention.py).
TOOLS_SPENT_SENTINEL = f"{TOOLS_SPENT}._sentinel"
TOOLS_REVOKED = "improve.tools.revoked"
TOOLS_REVOKED_FILTER = f"{TOOLS_REVOKED}.*.*"

# -- streams, consumers and buckets -------------------------------------------------------------
STREAM_INBOUND = "IMPROVE_IN"
STREAM_RECORDS = "IMPROVE_RECORDS"
STREAM_AUDIT = "IMPROVE_AUDIT"
STREAM_REFUSED = "IMPROVED_REFUSED"
STREAM_TOOLS_AUDIT = "IMPROVE_TOOLS_AUDIT"
STREAM_TOOLS_SPENT = "IMPROVE_TOOLS_SPENT"
STREAM_TOOLS_REVOKED = "IMPROVE_TOOLS_REVOKED"
CONSUMER_INBOUND = "improved-loop"
BUCKET_DEDUP = "improved_dedup"  # dedup_key → the newest proposal under it (supersession)
BUCKET_LEDGER = "improved_ledger"  # dedup_key → the operator's rejection (the rejection ledger)
BUCKET_WINDOWS = "improved_windows"  # analyzer, service, target → its window (stage 1, observe)
BUCKET_LEARNED = "improved_learned"  # analyzer id → its accepted/rejected counts (its weight)
BUCKET_TOOLS = "improved_tools"  # L2 acceptances (once also spent marks, revocations)
# Grant acts are chained per skill hash under a token no service can have (services start [a-z]).
GRANT_CHAINS = "_grants"
AUTONOMY_CHAIN = "_autonomy"  # the breaker and the autonomy switch (improved/breaker.py)
CHECKPOINT_CHAIN = "_checkpoints"  # signed checkpoints over the whole log (checkpoint.py)
POLICY_CHAIN = "_policy"  # the effective policy, recorded when it changes (core/policy.py)
TRUST_CHAIN = "_trust"  # the operator and voter keys, recorded when they change (core/evidence.py)
# an agent runtime's tool calls, one chain per runtime (core/tools.py): in the daemon's log only
# for chains written before they moved to STREAM_TOOLS_AUDIT (`tools_audit`)
TOOLS_CHAIN = "_tools"
MESH_CHAINS = frozenset({GRANT_CHAINS, AUTONOMY_CHAIN, CHECKPOINT_CHAIN, POLICY_CHAIN,
                         TRUST_CHAIN, TOOLS_CHAIN})

# Refusals (bad input) are logged here: what was refused and why, never the payload itself.
REFUSED = "improved.refused"
REFUSED_FILTER = f"{REFUSED}.>"

# -- request/reply (core NATS) -----------------------------------------------------------------
SPEC_GET = "improved.spec.get"
# Every service that advertises (`serve_spec`) also answers this broadcast, without a queue
# group, with the same capabilities: how `improved conformance --mesh` finds the mesh.
SPEC_DISCOVER = "improved.spec.discover"
QUEUE_GROUP = "improved"


def message_id(content_id: str, data: bytes) -> str:
    """The `Nats-Msg-Id` of an inbound message: its content address and a digest of its exact
    bytes. JetStream drops a second message under an id it has seen, so an id anyone can
    compute (the proposal id alone) could be squatted with junk to make the real message
    vanish; this one only the same bytes — the same message — can take."""
    return f"{content_id}.{hashlib.sha256(data).hexdigest()[:32]}"


def inbound_proposal(svc: str) -> str:
    return f"{PROPOSALS}.{svc}"


def inbound_review(svc: str) -> str:
    return f"{TRIAGE}.{svc}"


def inbound_applied(svc: str) -> str:
    return f"{APPLIED}.{svc}"


def inbound_outcome(svc: str) -> str:
    return f"{OUTCOMES}.{svc}"


def proposal_state(svc: str, pid: str) -> str:
    return f"{PROPOSALS}.{svc}.{pid}"


def triage_decision(svc: str, pid: str) -> str:
    return f"{TRIAGE}.{svc}.{pid}"


def apply_outcome(svc: str, pid: str) -> str:
    return f"{APPLIED}.{svc}.{pid}"


def learn_back(svc: str, pid: str) -> str:
    return f"{OUTCOMES}.{svc}.{pid}"


def due_entry(svc: str, pid: str) -> str:
    """Retained while applied proposal `pid` awaits its measurement at review_after (an
    output: it says when to look, never what to decide)."""
    return f"{DUE}.{svc}.{pid}"


def review_entry(svc: str, pid: str) -> str:
    """Retained while proposal `pid` is in the operator's queue (an output: it says where to
    look, never what to decide)."""
    return f"{REVIEW}.{svc}.{pid}"


def grant_record(name: str, sha256: str) -> str:
    return f"{GRANTS}.{name}.{sha256}"


def audit(svc: str, pid: str) -> str:
    return f"{AUDIT}.{svc}.{pid}"


def grant_audit(sha256: str) -> str:
    return f"{AUDIT}.{GRANT_CHAINS}.{sha256}"


def autonomy_audit(chain_id: str) -> str:
    return f"{AUDIT}.{AUTONOMY_CHAIN}.{chain_id}"


def checkpoint_audit(chain_id: str) -> str:
    return f"{AUDIT}.{CHECKPOINT_CHAIN}.{chain_id}"


def policy_audit(chain_id: str) -> str:
    return f"{AUDIT}.{POLICY_CHAIN}.{chain_id}"


def trust_audit(chain_id: str) -> str:
    return f"{AUDIT}.{TRUST_CHAIN}.{chain_id}"


def tools_audit(chain_id: str) -> str:
    """A tool runtime's audit chain, on STREAM_TOOLS_AUDIT (not the daemon's log)."""
    return f"{TOOLS_AUDIT}.{chain_id}"


def tools_spent(act: str) -> str:
    """The spent mark of a grant (its act id) or a session proof (its digest)."""
    return f"{TOOLS_SPENT}.{act}"


def tools_revoked(runtime: str, upgrade: str) -> str:
    """The revocation of one of `runtime`'s session upgrades (its act id)."""
    return f"{TOOLS_REVOKED}.{runtime}.{upgrade}"


def legacy_tools_audit(chain_id: str) -> str:
    """Where a runtime's chain was written before it moved: the daemon's log, whose writers
    must then trust the runtime's key as a daemon's."""
    return f"{AUDIT}.{TOOLS_CHAIN}.{chain_id}"


def dedup_key_of(svc: str, dedup: str) -> str:
    return f"{svc}.{dedup}"


def refused(svc: str) -> str:
    return f"{REFUSED}.{svc}"


def propose_request(svc: str) -> str:
    return f"{svc}.improve.propose"


def triage_request(svc: str) -> str:
    return f"{svc}.improve.triage"


def refine_request(svc: str) -> str:
    return f"{svc}.improve.refine"


def apply_request(svc: str) -> str:
    return f"{svc}.improve.apply"


def service_spec(svc: str) -> str:
    return f"{svc}.spec.get"


def conformance_propose(svc: str) -> str:
    """The conformance kit asks a service for a sample proposal (extension, docs/protocol.md):
    the reply is the proposal's bytes exactly as the service publishes its own, checked with
    the daemon's decoder. Nothing is published: the probe changes nothing."""
    return f"{svc}.improve.conformance.propose"


def conformance_triage(svc: str) -> str:
    """The conformance kit hands a service a triage decision as the daemon retains it on
    `improve.triage.<svc>.<id>`; the service takes it (or names what is wrong with it)."""
    return f"{svc}.improve.conformance.triage"


def lkg_request(svc: str) -> str:
    """L4 pre-apply check (extension, docs/protocol.md): the owning service confirms a healthy
    last-known-good for every artefact an L4 proposal touches."""
    return f"{svc}.improve.lkg"


def classify_request(svc: str) -> str:
    """A schema store's class of a pending `schema:` change (extension, docs/protocol.md):
    `{"proposal"}` → `{"class", "reason"}`, read only, for the operator before approving."""
    return f"{svc}.improve.classify"


def measure_request(svc: str) -> str:
    """Learn-back at `metric_snapshot.review_after` (extension, docs/protocol.md): the owning
    service runs the snapshot's query and answers the metric's current value."""
    return f"{svc}.improve.measure"


def skills_get(svc: str) -> str:
    """A skills store's read under a TOFU grant (extension): `{"skill"}` → definition."""
    return f"{svc}.skills.get"


def skills_practice(svc: str) -> str:
    """A skills store counts a proposal's independent outcomes (extension):
    `{"proposal_id"}` → what its verified chain says was practised."""
    return f"{svc}.skills.practice"


def skills_competence(svc: str) -> str:
    """A skills store's competence read (extension): `{"skill", "holder"}` → the chain."""
    return f"{svc}.skills.competence"


def skills_transfer(svc: str) -> str:
    """A skills store's transfer (extension): `{"skill", "from", "to"}` → the new grain."""
    return f"{svc}.skills.transfer"


def skills_tool(svc: str) -> str:
    """A skills store keeps a Tool definition grain under its content address (extension):
    `{"grain"}` → `{"address"}`, what a skill's `allowed_tools` may then name."""
    return f"{svc}.skills.tool"


def skills_export(svc: str) -> str:
    """A skills store's transfer bundle (extension): `{"skill", "holder"?}` → the Skill grain,
    its dependency closure and Tool grains, and the audit chains that approved them."""
    return f"{svc}.skills.export"


def skills_import(svc: str) -> str:
    """A skills store re-verifies and stores a transfer bundle (extension): `{"bundle",
    "holder"?}` → the skill's identity and address here."""
    return f"{svc}.skills.import"


def skills_discover(svc: str) -> str:
    """A skills store's discovery (extension): `{"name"?, "namespace"?, "holder"?,
    "min_proficiency"?}` → the current heads (system_valid_to null), best first."""
    return f"{svc}.skills.discover"


def tools_list(runtime: str) -> str:
    """An agent runtime's tool catalog (SPEC 09 §3.1)."""
    return f"{runtime}.tools.list"


def tools_call(runtime: str) -> str:
    """Invoke one catalogued tool of an agent runtime."""
    return f"{runtime}.tools.call"


def tools_revoke(runtime: str) -> str:
    """An operator's signed revocation of a session upgrade of an agent runtime."""
    return f"{runtime}.tools.revoke"


def quorum_record(pid: str) -> str:
    """Retained, immutable QuorumRecord of one proposal."""
    return f"{QUORUM}.{pid}"


# Wildcards the daemon serves; the service token is the first one.
PROPOSE_REQUESTS = "*.improve.propose"
TRIAGE_REQUESTS = "*.improve.triage"
REFINE_REQUESTS = "*.improve.refine"


def window_key(analyzer_id: str, svc: str, target_ref: str) -> str:
    """KV key of one analyzer's window over one target: `<analyzer id>.<svc>.<first 32 hex of
    SHA-256 of the target_ref>` (a target may hold any character; the digest is KV-safe)."""
    return f"{analyzer_id}.{svc}.{hashlib.sha256(target_ref.encode()).hexdigest()[:32]}"


def filed_under(subject: str) -> str | None:
    """The service a proposal chain's subject `improve.audit.<svc>.<id>` files it under; None
    for a mesh chain (`_grants`, `_autonomy`, …) or anything else."""
    svc = token(subject, 2)
    if token(subject, 1) != "audit" or svc is None or svc in MESH_CHAINS:
        return None
    return svc


def token(subject: str, index: int) -> str | None:
    """The index-th dot-separated token of a subject, or None when it has fewer tokens."""
    parts = subject.split(".")
    return parts[index] if -len(parts) <= index < len(parts) else None
