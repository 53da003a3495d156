"""The reference skills store: SPEC 09 §4's storage contract over NATS KV.

A skill's identity is `<name>:<sha256>` (`canonical.skill_hash`, definition fields only), never
its bare name. This store keeps each definition under that hash, applies `skill:` proposals
exactly once, returns a definition only under a grant for exactly its hash (re-hashing what it
stored, so an altered record is refused, not served), and records each holder's competence as an
OMS supersession chain (oms.md §5.3): proficiency never changes in place.

Storage layout (`<svc>` with `-` made `_`):
- KV `skills_<svc>` (history 64): key `<name>.<sha256>` → the definition record
  `{name, sha256, definition, created_at, address, derived_from?, origin_did?, author_did?,
  refines?, proposal_id?}`, where `address` is the OMS content address of the definition as a
  Skill grain (type 0x0B). Written once; a retraction is a KV delete marker, and the history keeps
  the record for audit. Changed exactly once per proposal by the ledger protocol of
  `services.kv_service`; a key already in the asked state is adopted, not written again.
- KV `skillapplies_<svc>` (history 1): the apply ledger, one entry per proposal id.
- KV `skillcomp_<svc>` (history 1): `rec.<address>` → one competence grain, immutable and keyed
  by its own content address; `head.<name>.<sha256>.<holder>` → `{address, practice_count}`, the
  holder's current grain (`<holder>` is the SHA-256 hex of the holder DID: DIDs carry `:`, which
  KV keys cannot). The head moves by compare-and-set, so concurrent practice makes a chain, never a
  fork; a grain that lost the race stays behind unreferenced. The history is the walk back along
  `derived_from[0]` from the head while the grain is this holder's.

Competence rules (the pure ones in `skill_competence`):
- Only an independent outcome counts (SPEC 09 §5): a self-signal returns None and writes nothing,
  whatever its sign. Over the bus the outcomes are read from the verified audit chain of an
  applied skill proposal (`practise_proposal`): `<svc>.skills.practice` `{"proposal_id"}`, or
  woken by the daemon's learn-back record `improve.outcomes.<svc>.<id>` (a wake-up only), each
  outcome counted once through the head's `counted` map; the holder is a signed proposal's
  verified proposer, else `service:<svc>/<origin.actor>` (`skill_competence.holder_on_chain`). `<svc>.skills.competence` and `<svc>.skills.transfer` read and hand on a
  holder's chain (docs/protocol.md "Skill competence").
- An independent positive outcome moves proficiency toward 1.0, a negative one toward 0.0, as an
  exponential moving average with weight `ALPHA` (p + α(1-p), or p(1-α)). Both are practice, so
  both supersede the head with `practice_count + 1`: OMS records every change in proficiency as
  a supersession, decay included.
- A holder's first grain starts from proficiency 0.0 and derives from the definition's address.
- Transfer writes the new holder's first grain: the same definition, `derived_from` the source
  grain, `origin_did` the first holder (kept across hops), proficiency and practice_count reset.

Read under a grant (request/reply, queue group = the service): `<svc>.skills.get` with
`{"skill": "<name>:<sha256>"}` answers `{"skill": identity, "definition": {...}}` only while the
daemon's grant record for exactly that identity is active and the stored record re-hashes to it;
otherwise `{"error": {"code", "message", "field"?}}` with code `invalid_value` (not an identity),
`no_grant` (no active grant), `not_found` (granted, but not stored) or `grant_mismatch` (the
stored record no longer matches the granted hash).

Accepted proposal_data, target `skill:<name>`: `{"skill": definition}` (optionally with
`"refines": "<name>:<sha256>"`), and `{"retract": "<name>:<sha256>"}` so that the inverse this
store hands out can itself be applied; a retraction's inverse restores the same record. A put
that found exactly that definition stored already (an L3 re-execution of what an L2 stored)
changed nothing, so its inverse is `{"keep": "<name>:<sha256>"}`, which changes nothing either:
undoing a re-execution never retracts what an earlier proposal stored.
"""


from __future__ import annotations

import argparse
import re
import sys
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client

from improved.client import chains
from improved.core.evidence import DaemonWriters
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import ApplyOrder, ApplyResult, Proposal, Signal, to_json
from improved_reference import kv_service
from improved_reference.competence_chains import CompetenceChains
from improved_reference.kv_service import KVService
from improved_reference.skill_bundles import FORMAT as BUNDLE_FORMAT
from improved_reference.skill_bundles import entry as bundle_entry
from improved_reference.skill_bundles import verified as bundle_verified
from improved_reference.skill_competence import (
    NAMESPACE,
    NotPractice,
    Practice,
    address_of,
    practice_on_chain,
)
from improved_reference.skill_definitions import (
    DEFINITION_FIELDS,
    Change,
    GrantMismatch,
    NoCompetence,
    NoGrant,
    NotStored,
    Refused,
    bucket_names,
    check_holder,
    definition_of,
    definition_record,
    now_ms,
    parse_change,
    restorable,
    split_identity,
    verify,
)
from improved_reference.skill_grains import (
    MG,
    best_first,
    definition_grain,
    dependency_addresses,
    indexed,
    matches,
    tool_addresses,
    tool_grain_problem,
)
from improved_reference.skill_requests import SkillRequests

__all__ = ["GrantMismatch", "NoCompetence", "NoGrant", "NotStored", "Refused", "SkillsStore",
           "bucket_names", "main", "run"]

log = structlog.get_logger("improved_reference.skills_store")


class SkillsStore(KVService[Change]):
    """Definitions in KV `skills_<svc>`, competence in `skillcomp_<svc>`, the apply ledger in
    `skillapplies_<svc>` (layout in the module doc)."""

    KIND = "skills store"
    VALUES = "definitions"
    competence_chains: CompetenceChains  # KV `skillcomp_<svc>`, once `open`

    def __init__(self, nc: Client, service: str, verify_acceptance: bool = False):
        self.defs_bucket, self.comp_bucket, ledger_bucket = bucket_names(service)
        super().__init__(nc, service, self.defs_bucket, ledger_bucket, verify_acceptance)
        self.defs_stream = self.stream
        # daemon key ids whose signatures a chain must carry before practice on it counts
        # (`--trust-daemon`); empty: hashes and links only, the writers trusted to the bus
        self.daemons: frozenset[str] = frozenset()
        self.requests = SkillRequests(self)

    async def start(self) -> None:
        await self.open()
        await self.requests.subscribe()  # served before the capabilities that advertise them
        await self._serve()

    async def stop(self) -> None:
        await super().stop()
        await self.requests.stop()

    async def open(self) -> None:
        comp = await self._bucket(self.comp_bucket, 1,
                                  "skills store: competence grains and chain heads")
        self.competence_chains = CompetenceChains(comp, self.record, self.service, log)
        await super().open()

    def capabilities(self) -> dict[str, Any]:
        return {
            **self.surface(),
            "schemes": ["skill:"],
            "proposal_data": ['{"skill": definition, "refines"?: identity}',
                              '{"retract": identity}'],
            "identity": "<name>:<sha256>",
            "get": S.skills_get(self.service),
            "practice": S.skills_practice(self.service),
            "competence": S.skills_competence(self.service),
            "transfer": S.skills_transfer(self.service),
            "tool": S.skills_tool(self.service),
            "export": S.skills_export(self.service),
            "import": S.skills_import(self.service),
            "discover": S.skills_discover(self.service),
            "buckets": {"definitions": self.defs_bucket, "competence": self.comp_bucket,
                        "ledger": self.ledger_bucket},
        }

    # -- definitions ---------------------------------------------------------------------------

    @staticmethod
    def _decode(data: bytes) -> dict[str, Any]:
        """An unreadable record comes back as `{}`, which fails verification."""
        record = KVService._decode(data)
        return record if isinstance(record, dict) else {}

    async def put_definition(self, definition: dict[str, Any]) -> str:
        """Store a definition under its hash (a no-op when it is already there); its identity.
        Its references must resolve first (`check_references`)."""
        record = definition_record(definition, now_ms())
        await self.check_references(record["definition"])
        await self.hold_definition(record)
        change = Change(op="put", name=record["name"], sha=record["sha256"], record=record)
        await self._store(change.key, lambda current: None if verify(
            current, change.name, change.sha) is None else to_json(record))
        return change.identity

    async def hold_definition(self, record: dict[str, Any]) -> str:
        """Keep the record's pure-definition Skill grain at `rec.<address>`, where a
        dependency resolves to it."""
        return await self.competence_chains.hold(
            "rec", definition_grain(record, NAMESPACE), canonical.SKILL)

    async def put_tool(self, grain: Any) -> str:
        """Keep a Tool definition grain under its content address; the address (mg:sha256:).
        Anyone may: the address binds the content, and only an approved skill names it."""
        problem = tool_grain_problem(grain)
        if problem is not None:
            raise Refused(problem)
        return MG + await self.competence_chains.hold("tool", grain, canonical.TOOL)

    async def check_references(self, definition: dict[str, Any]) -> None:
        """Refused, in one line, unless every dependency is a Skill grain and every
        `allowed_tools` address a Tool definition grain this store holds."""
        chains_ = self.competence_chains
        for i, address in dependency_addresses(definition):
            if await chains_.held("rec", address, canonical.SKILL) is None:
                raise Refused(
                    f"dependencies[{i}] = {MG}{address} names no Skill grain this store "
                    "holds: a dependency is the content address of a stored Skill grain "
                    "(mg:sha256:<64 hex>, a stored skill's `address`), not a <name>:<sha256> "
                    "skill hash")
        for i, address in tool_addresses(definition):
            if await chains_.held("tool", address, canonical.TOOL) is None:
                raise Refused(
                    f"allowed_tools[{i}] = {MG}{address} names no Tool definition grain this "
                    f"store holds; keep it first on {S.skills_tool(self.service)}")

    async def _prepare_change(self, order: ApplyOrder) -> Change:
        """`_change`, and for a put not yet applied its references resolved."""
        change = await super()._prepare_change(order)
        if change.op == "put" and change.record is not None \
                and not await self._applied(order.proposal_id):
            await self.check_references(change.record["definition"])
        return change

    async def _keep(self, record: dict[str, Any]) -> None:
        """Store `record` under its hash, unless that definition is stored already."""
        name, sha = record["name"], record["sha256"]
        await self._store(f"{name}.{sha}", lambda current: None if verify(
            current, name, sha) is None else to_json(record))

    async def record(self, identity: str) -> dict[str, Any]:
        """The stored record of exactly `identity`, verified against its hash; GrantMismatch
        otherwise."""
        name, sha = split_identity(identity)
        current, _ = await self._current(f"{name}.{sha}")
        reason = verify(current, name, sha)
        if reason is not None:
            raise (NotStored if current is None else GrantMismatch)(reason)
        record: dict[str, Any] = current  # verified: a record of that definition
        return record

    async def get_by_identity(self, identity: str) -> dict[str, Any]:
        """The definition stored as exactly `identity` (re-hashed on every read)."""
        return definition_of((await self.record(identity))["definition"])

    async def get(self, name: str, grant: str | None = None) -> dict[str, Any]:
        """The definition of `name` under `grant` = `<name>:<sha256>`, and only that one."""
        if grant is None:
            raise GrantMismatch(f"no grant given for {name!r}: a skill is returned only under "
                                "<name>:<sha256>, never looked up by name")
        granted, _ = split_identity(grant)
        if granted != name:
            raise GrantMismatch(f"the grant {grant} is for skill {granted!r}, not {name!r}")
        return await self.get_by_identity(grant)

    async def check_grant_active(self, identity: str, now: int | None = None) -> bool:
        """The grant of exactly `identity` is active and unexpired on its verified grant chain
        (the daemon's retained Grant record is an output anyone could publish)."""
        return await chains.grant_active(self.js, identity, now_ms() if now is None else now)

    async def get_granted(self, name: str, sha: str) -> dict[str, Any]:
        """Like `get`, and only while an active grant record covers `<name>:<sha>`."""
        identity = f"{name}:{sha}"
        if not await self.check_grant_active(identity):
            raise NoGrant(f"no active grant for {identity}")
        return await self.get(name, identity)

    async def refine(self, identity: str, changes: dict[str, Any], *, service: str,
                     origin_actor: str, analyzer_id: str, created_at: int) -> Proposal:
        """The L2 proposal of the definition with `changes` (None removes a field). Its hash is
        new, so no grant on `identity` covers it: it re-enters at L2 (SPEC 09 §4)."""
        old = await self.get_by_identity(identity)
        unknown = sorted(set(changes) - set(DEFINITION_FIELDS))
        if unknown:
            raise Refused(f"a refinement changes definition fields only, not {unknown}")
        if "name" in changes and changes["name"] != old["name"]:
            raise Refused("a refinement keeps the skill's name; a new name is a new skill")
        new = {**old}
        for field, value in changes.items():
            if value is None:
                new.pop(field, None)
            else:
                new[field] = value
        record = definition_record(new, created_at)
        if record["sha256"] == split_identity(identity)[1]:
            raise Refused(f"the changes leave {identity} as it is (same hash)")
        body = {
            "service": service, "target_ref": f"skill:{old['name']}", "change_class": "L2",
            "scope": "knowledge", "origin": {"actor": origin_actor, "service": service},
            "analyzer": {"id": analyzer_id},
            "summary": {"template_id": "refine_skill", "args": {"name": old["name"]}},
            "proposal_data": {"skill": record["definition"], "refines": identity},
            "created_at": created_at,
        }
        try:
            return msgspec.convert(body, type=Proposal)
        except msgspec.ValidationError as exc:
            raise Refused(f"the refinement is not a valid proposal: {exc}") from None

    # -- applying (the protocol is kv_service's) -----------------------------------------------

    def _change(self, order: ApplyOrder) -> Change:
        return parse_change(order.proposal, order.proposal_id)

    def _new_entry(self, change: Change, current: dict[str, Any] | None,
                   cur_rev: int) -> dict[str, Any]:
        if change.op == "retract" and current is None:
            raise Refused(f"{change.identity} is not stored (never, or already retracted)")
        # a put of a definition already stored changes nothing, so its undo must not either
        existed = change.op == "put" and verify(current, change.name, change.sha) is None
        return {"op": change.op, "key": change.key, "identity": change.identity,
                "record": change.record, "prior": current if change.op == "retract" else None,
                "prior_rev": cur_rev, "revision": None, "existed": existed}

    async def _write(self, pid: str, entry: dict[str, Any], current: dict[str, Any] | None,
                     cur_rev: int) -> int:
        """Make the key what the entry asks; a key already in that state is adopted unwritten
        (content addressing makes a second copy of the same definition pointless)."""
        if entry["op"] == "keep":
            return cur_rev
        if entry["op"] == "put":
            await self.hold_definition(entry["record"])
            if verify(current, *split_identity(entry["identity"])) is None:
                return cur_rev
            return await self._publish(entry["key"], to_json(entry["record"]), cur_rev, pid)
        if current is None:
            return cur_rev
        return await self._publish(entry["key"], b"", cur_rev, pid, delete=True)

    def _result(self, entry: dict[str, Any]) -> ApplyResult:
        """The one result of a completed entry: the same every time it is asked for."""
        identity = entry["identity"]
        if entry["op"] == "put" and not entry.get("existed"):
            inverse: dict[str, Any] = {"retract": identity}
        elif entry["op"] in ("put", "keep"):  # it found the definition stored: nothing to undo
            inverse = {"keep": identity}
        else:
            inverse = {"skill": restorable(entry["prior"])}
        return ApplyResult(ok=True, applied_id=identity, inverse=inverse, rollbackable=True)

    # -- competence (the chains are CompetenceChains') -----------------------------------------

    async def practice(self, identity: str, holder_did: str, signal: Signal, independent: bool,
                       at: int) -> dict[str, Any] | None:
        """Record one outcome of `holder_did` practising `identity` as a new head grain.

        A self-signal (not independent) returns None and writes nothing; an independent one,
        positive or negative, supersedes (rules in the module doc). The caller vouches for
        `independent`; over the bus, `practise_proposal` reads it from the verified chain."""
        check_holder(holder_did)
        name, _ = split_identity(identity)
        if signal.target_ref is not None and signal.target_ref != f"skill:{name}":
            raise Refused(f"the signal is about {signal.target_ref}, not skill:{name}")
        if not independent:
            return None
        return await self.competence_chains.practise(identity, holder_did, signal.positive, at)

    async def practise_proposal(self, proposal_id: str) -> tuple[Practice, list[dict[str, Any]]]:
        """Count, once each, the independent outcomes the verified chain of `proposal_id`
        records after its apply (skill_competence.practice_on_chain); (what the chain says,
        the grains written now). NotPractice when the chain records no practice of a skill
        stored here; asking again, or for a chain read before, writes nothing new."""
        if not S.ID_RE.match(proposal_id):
            raise NotPractice(f"{proposal_id!r} is not a proposal id")
        chain = await chains.read_sequenced(self.js, S.audit(self.service, proposal_id))
        trust = DaemonWriters(self.daemons) if self.daemons else None
        practice = practice_on_chain(proposal_id, [body for _, body in chain], self.service,
                                     trust, [seq for seq, _ in chain])
        try:
            await self.record(practice.identity)
        except GrantMismatch as exc:
            raise NotPractice(f"{practice.identity} is not stored here: {exc}") from None
        written = []
        for outcome in practice.outcomes:
            grain = await self.competence_chains.practise(
                practice.identity, practice.holder, outcome.positive, outcome.at,
                (proposal_id, outcome.seq))
            if grain is not None:
                written.append(grain)
        return practice, written

    async def competence(self, identity: str, holder_did: str) -> dict[str, Any] | None:
        """The holder's current competence grain (the chain's head), or None."""
        return await self.competence_chains.current(identity, holder_did)

    async def competence_history(self, identity: str, holder_did: str,
                                 limit: int | None = None) -> list[dict[str, Any]]:
        """The holder's chain, oldest first, head last (`CompetenceChains.history`)."""
        return await self.competence_chains.history(identity, holder_did, limit)

    async def discover(self, query: dict[str, Any]) -> list[dict[str, Any]]:
        """The current heads (OMS: `system_valid_to` null) that answer `query`
        (`skill_grains.matches`), best first; with `"history": true`, every grain of each
        matching holder's chain too, oldest first, each with `superseded_by` and
        `system_valid_to` (`skill_grains.indexed`)."""
        heads = {canonical.content_address(h, canonical.SKILL): (identity, h)
                 for identity, h in await self.competence_chains.heads() if matches(h, query)}
        found: list[dict[str, Any]] = []
        for head in best_first([h for _, h in heads.values()]):
            identity = heads[canonical.content_address(head, canonical.SKILL)][0]
            chain = await self.competence_history(identity, head["holder_did"]) \
                if query.get("history") else [head]
            found.extend({**g, "skill": identity} for g in indexed(chain))
        return found

    # -- transfer bundles (skill_bundles) -------------------------------------------------------

    async def export(self, identity: str, holder: str | None = None) -> dict[str, Any]:
        """The transfer bundle of `identity` (`skill_bundles`): its grain and dependency
        closure, each with the audit chain that approved it here, the Tool grains they name,
        and `holder`'s competence head when given. Refused when a grain of the closure was not
        stored by an approved proposal (nothing would prove its approval elsewhere)."""
        grains, tools, todo, seen = [], [], [identity], set()
        while todo:
            current = todo.pop(0)
            record = await self.record(current)
            if record["address"] in seen:
                continue
            seen.add(record["address"])
            pid = record.get("proposal_id")
            if not isinstance(pid, str):
                raise Refused(f"{current} was not stored by an approved proposal here: no "
                              "chain proves its approval")
            chain = await chains.read_sequenced(self.js, S.audit(self.service, pid))
            grains.append(bundle_entry(record["address"], definition_grain(record, NAMESPACE),
                                       pid, chain))
            for _, address in dependency_addresses(record["definition"]):
                grain = await self.competence_chains.held("rec", address, canonical.SKILL)
                if grain is None:
                    raise Refused(f"the dependency {address} of {current} is not held here")
                todo.append(canonical.skill_identity(grain))
            for _, address in tool_addresses(record["definition"]):
                tool = await self.competence_chains.held("tool", address, canonical.TOOL)
                if tool is None:
                    raise Refused(f"the Tool grain {address} of {current} is not held here")
                tools.append({"address": MG + address, "grain": tool})
        bundle: dict[str, Any] = {"format": BUNDLE_FORMAT, "skill": identity, "grains": grains,
                                  "tools": tools}
        if holder is not None:
            head = await self.competence(identity, holder)
            if head is None:
                raise NoCompetence(f"{holder} holds no competence record for {identity}")
            bundle["holder"] = {"address": MG + address_of(head), "grain": head}
        return bundle

    async def import_bundle(self, bundle: Any, holder: str | None = None,
                            at: int | None = None) -> dict[str, Any]:
        """Re-verify a bundle another deployment exported (`skill_bundles.verified`, against
        the daemon keys this store trusts) and keep it: its Tool grains, its Skill grains and
        their records; with `holder`, that holder's first grain (the recipe, not the track
        record). Refused in one line, and nothing kept, when it does not verify."""
        if not self.daemons:
            raise Refused("this store trusts no daemon key (--trust-daemon), so it cannot "
                          "check a bundle's approvals")
        imported = bundle_verified(bundle, DaemonWriters(self.daemons))
        for tool in imported.tools:
            await self.competence_chains.hold("tool", tool, canonical.TOOL)
        for record in imported.records:
            await self.hold_definition(record)
        for record in imported.records:
            await self._keep(record)
        reply: dict[str, Any] = {"skill": imported.identity, "address": MG + imported.address}
        if holder is not None:
            source = imported.holder
            grain = await self.competence_chains.acquire(
                imported.identity, holder, source[0] if source else imported.address,
                source[1].get("origin_did") or source[1]["holder_did"] if source else None,
                now_ms() if at is None else at)
            reply.update(holder=holder, grain=grain)
        return reply

    async def transfer(self, identity: str, from_holder: str, to_holder: str,
                       at: int) -> dict[str, Any]:
        """Give `to_holder` the recipe, not the track record (`CompetenceChains.transfer`)."""
        return await self.competence_chains.transfer(identity, from_holder, to_holder, at)


async def run(url: str, service: str) -> int:
    return await kv_service.run(SkillsStore, url, service)


KEYID_RE = re.compile(r"^ed25519:[0-9a-f]{64}\Z")
DESCRIPTION = (
    "Reference mesh service: stores skill definitions bound to their <name>:<sha256>, applies "
    "skill: proposals ordered by improved exactly once, serves a definition only under a grant "
    "for exactly its hash, and keeps each holder's competence as an OMS supersession chain fed "
    "by the independent outcomes on the proposals' audit chains.")


def main(argv: list[str] | None = None) -> int:
    p = kv_service.parser("improved_reference.skills_store", DESCRIPTION)
    p.add_argument("--trust-daemon", action="append", default=[], metavar="KEYID",
                   help="count practice only from chains every trailer of which this daemon "
                        "key signed (ed25519:<hex>, as `improved keys show` prints it; "
                        "repeatable); without it, hashes and links are checked and the "
                        "writers are trusted to the bus permissions")

    def setup(args: argparse.Namespace) -> kv_service.Setup | None:
        bad = [k for k in args.trust_daemon if not KEYID_RE.match(k)]
        if bad:
            p.error(f"--trust-daemon {bad[0]!r} is not a key id ed25519:<64 hex>")
        if not args.trust_daemon:
            return None

        async def trust(store: kv_service.KVService[Any]) -> list[str]:
            assert isinstance(store, SkillsStore)
            store.daemons = frozenset(args.trust_daemon)
            return [f"practice counted only from chains signed by {len(store.daemons)} "
                    "trusted daemon key(s)"]

        return trust

    return kv_service.main(SkillsStore, argv, "improved_reference.skills_store", DESCRIPTION,
                           p, setup)


if __name__ == "__main__":
    sys.exit(main())
