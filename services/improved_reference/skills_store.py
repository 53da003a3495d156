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
import asyncio
import re
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from improved.client import chains
from improved.core.evidence import DaemonWriters
from improved.protocol import canonical, wire
from improved.protocol import subjects as S
from improved.protocol.model import (
    ApplyOrder,
    ApplyResult,
    ErrorBody,
    ErrorReply,
    Proposal,
    Signal,
    to_json,
)
from improved_reference import kv_service
from improved_reference.kv_service import ROUNDS, KVService, read_json
from improved_reference.skill_competence import (
    NAMESPACE,
    NotPractice,
    Practice,
    address_of,
    already_counted,
    competence_grain,
    next_proficiency,
    practice_on_chain,
    with_counted,
)

log = structlog.get_logger("improved_reference.skills_store")

IDENTITY_RE = re.compile(r"^([a-z][a-z0-9_-]{0,62}):([0-9a-f]{64})$")
DEFINITION_FIELDS = canonical.SKILL_DEFINITION_FIELDS
TEXT_FIELDS = ("name", "description", "instructions", "when_to_use", "version", "domain")
LIST_FIELDS = ("allowed_tools", "resources", "dependencies", "input_modalities",
               "output_modalities")
PROVENANCE_FIELDS = ("derived_from", "origin_did", "author_did")
COMPETENCE_FIELDS = ("holder_did", "proficiency", "practice_count", "last_practiced_at",
                     "strategies", "transferable")


class Refused(kv_service.Refused, ValueError):
    """Well formed, but this store will not do it; the text says why."""


class GrantMismatch(LookupError):
    """A skill asked for under a grant it does not match: no record for exactly that hash, an
    altered record, a retracted one, or no active grant. There is never a fallback by name."""


class NoGrant(GrantMismatch):
    """No active, unexpired grant record covers exactly the identity asked for."""


class NotStored(GrantMismatch):
    """Nothing is stored under exactly the identity (never stored, or retracted)."""


class CorruptRecord(ValueError):
    """A competence grain that no longer matches its content address or its skill hash."""


class NoCompetence(LookupError):
    """The holder has no competence record for the skill."""


@dataclass(frozen=True)
class Change:
    op: str  # "put" | "retract" | "keep"
    name: str
    sha: str
    record: dict[str, Any] | None = None  # put: the record to store

    @property
    def key(self) -> str:
        return f"{self.name}.{self.sha}"

    @property
    def identity(self) -> str:
        return f"{self.name}:{self.sha}"


def bucket_names(service: str) -> tuple[str, str, str]:
    """(definitions, competence, ledger): `skills_<svc>`, `skillcomp_<svc>`,
    `skillapplies_<svc>`, `-` made `_` (the ranking store's `applies_` stays distinct)."""
    token = service.replace("-", "_")
    return f"skills_{token}", f"skillcomp_{token}", f"skillapplies_{token}"


def split_identity(identity: str) -> tuple[str, str]:
    match = IDENTITY_RE.match(identity) if isinstance(identity, str) else None
    if match is None:
        raise GrantMismatch(f"{identity!r} is not a skill identity <name>:<sha256>")
    return match.group(1), match.group(2)


def now_ms() -> int:
    return int(time.time() * 1000)


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


# -- definitions (pure) -------------------------------------------------------------------------


def definition_of(skill: dict[str, Any]) -> dict[str, Any]:
    return {k: skill[k] for k in DEFINITION_FIELDS if k in skill}


def definition_record(skill: Any, created_at: int) -> dict[str, Any]:
    """The record to store for `skill`, or Refused naming the first problem. Pure.

    Competence fields are refused rather than dropped: they belong to competence records, and a
    definition that silently lost them would surprise its author."""
    if not isinstance(skill, dict):
        raise Refused(f"a skill definition is an object, not {type(skill).__name__}")
    competence = sorted(set(skill) & set(COMPETENCE_FIELDS))
    if competence:
        raise Refused(f"competence fields {competence} do not belong in a definition")
    unknown = sorted(set(skill) - set(DEFINITION_FIELDS) - set(PROVENANCE_FIELDS)
                     - {"type", "created_at"})
    if unknown:
        raise Refused(f"unknown skill fields {unknown}; a definition has "
                      f"{list(DEFINITION_FIELDS)} plus provenance {list(PROVENANCE_FIELDS)}")
    if skill.get("type", "skill") != "skill":
        raise Refused(f"type must be 'skill', not {skill['type']!r}")
    name = skill.get("name")
    if not isinstance(name, str) or not S.SKILL_NAME_RE.match(name):
        raise Refused(f"skill name {name!r} must match {S.SKILL_NAME_RE.pattern}")
    if not isinstance(skill.get("description"), str) or not skill["description"]:
        raise Refused("a skill needs a non-empty description (OMS: name and description)")
    for field in TEXT_FIELDS + ("origin_did", "author_did"):
        if skill.get(field) is not None and not isinstance(skill[field], str):
            raise Refused(f"{field} must be a string")
    for field in LIST_FIELDS + ("derived_from",):
        value = skill.get(field)
        if value is not None and not (isinstance(value, list)
                                      and all(isinstance(v, str) for v in value)):
            raise Refused(f"{field} must be a list of strings")
    deps = canonical.dependencies_problem(skill)
    if deps is not None:
        raise Refused(deps[1])
    created = skill.get("created_at", created_at)
    if not isinstance(created, int) or isinstance(created, bool) or not 0 <= created < 2**53:
        raise Refused("created_at must be integer epoch milliseconds")
    definition = _drop_none(definition_of(skill))
    provenance = _drop_none({k: skill.get(k) for k in PROVENANCE_FIELDS})
    try:
        sha = canonical.skill_hash(definition)
        address = canonical.content_address(
            {"type": "skill", **definition, **provenance, "created_at": created,
             "namespace": NAMESPACE}, canonical.SKILL)
    except canonical.CanonicalError as exc:
        raise Refused(f"the definition has no canonical form: {exc}") from None
    return {"name": name, "sha256": sha, "definition": definition, "created_at": created,
            "address": address, **provenance}


def restorable(record: dict[str, Any]) -> dict[str, Any]:
    """The skill dict that recreates `record` exactly (a retraction's inverse)."""
    return {**record["definition"], "created_at": record["created_at"],
            **{k: record[k] for k in PROVENANCE_FIELDS if k in record}}


def verify(record: dict[str, Any] | None, name: str, sha: str) -> str | None:
    """Why `record` may not be served as `<name>:<sha>`, or None when it may."""
    if record is None:
        return f"no stored skill {name}:{sha} (never stored, or retracted); no fallback by name"
    definition = record.get("definition")
    if not isinstance(definition, dict):
        return f"the stored record for {name}:{sha} is unreadable"
    if record.get("sha256") != sha:
        return f"the stored record carries hash {record.get('sha256')!r}, not the granted {sha}"
    try:
        actual = canonical.skill_hash(definition)
    except canonical.CanonicalError:
        return f"the stored definition for {name}:{sha} has no canonical form"
    if actual != sha:
        return (f"the stored definition hashes to {actual}, not the granted {sha}: "
                "it was altered after it was stored")
    if definition.get("name") != name:
        return f"the stored definition is named {definition.get('name')!r}, not {name!r}"
    return None


def parse_change(proposal: Proposal, pid: str | None = None) -> Change:
    """The one change a proposal asks of this store, or Refused naming what is wrong. Pure."""
    if proposal.proposal_cal is not None or proposal.proposal_edit is not None:
        raise Refused("this store applies proposal_data only, not proposal_cal or proposal_edit")
    scheme, _, target = proposal.target_ref.partition(":")
    if scheme != "skill":
        raise Refused(f"unsupported target scheme {scheme + ':'!r}; this store applies "
                      "skill:<name> targets")
    if not S.SKILL_NAME_RE.match(target):
        raise Refused(f"target skill name {target!r} must match {S.SKILL_NAME_RE.pattern}")
    data = proposal.proposal_data
    if data is None:
        raise Refused('proposal_data is missing; expected {"skill": definition}')
    if set(data) in ({"retract"}, {"keep"}):
        op = next(iter(data))
        try:
            name, sha = split_identity(data[op])
        except GrantMismatch as exc:
            raise Refused(f"{op}: {exc}") from None
        if name != target:
            raise Refused(f"{op} names skill {name!r}, not the target's {target!r}")
        return Change(op=op, name=name, sha=sha)
    if "skill" not in data or not set(data) <= {"skill", "refines"}:
        raise Refused('proposal_data must be {"skill": definition} (optionally with "refines", '
                      f'or {{"retract": identity}} or {{"keep": identity}}); got keys '
                      f'{sorted(data)}')
    record = definition_record(data["skill"], proposal.created_at)
    if record["name"] != target:
        raise Refused(f"skill name {record['name']!r} does not match the target's name "
                      f"{target!r}")
    refines = data.get("refines")
    if refines is not None:
        match = IDENTITY_RE.match(refines) if isinstance(refines, str) else None
        if match is None or match.group(1) != target:
            raise Refused(f"refines must be an identity {target}:<sha256>, not {refines!r}")
        record["refines"] = refines
    if pid is not None:
        record["proposal_id"] = pid
    return Change(op="put", name=target, sha=record["sha256"], record=record)


# -- competence (pure) --------------------------------------------------------------------------


def _error(code: str, message: str, field: str | None = None) -> ErrorReply:
    return ErrorReply(error=ErrorBody(code=code, message=message[:500], field=field))


def _request(data: bytes, required: tuple[str, ...],
             optional: tuple[str, ...] = ()) -> dict[str, Any] | ErrorReply:
    """A request's JSON object with exactly `required` (strings) and any of `optional`."""
    try:
        body = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError) as exc:
        return _error(wire.INVALID_VALUE, f"not a JSON object: {exc}")
    shape = "{" + ", ".join([f'"{k}"' for k in required] + [f'"{k}"?' for k in optional]) + "}"
    if not isinstance(body, dict) or not set(required) <= set(body) <= {*required, *optional}:
        return _error(wire.INVALID_VALUE, f"the request is {shape}")
    for key in required:
        if not isinstance(body[key], str) or not body[key]:
            return _error(wire.INVALID_VALUE, f"{key} must be a non-empty string", key)
    return body


def _check_holder(holder_did: Any) -> None:
    if not isinstance(holder_did, str) or not holder_did:
        raise Refused("a holder DID is a non-empty string")


class SkillsStore(KVService[Change]):
    """Definitions in KV `skills_<svc>`, competence in `skillcomp_<svc>`, the apply ledger in
    `skillapplies_<svc>` (layout in the module doc)."""

    KIND = "skills store"
    VALUES = "definitions"
    comp: KeyValue  # competence grains and chain heads, once `open`

    def __init__(self, nc: Client, service: str, verify_acceptance: bool = False):
        self.defs_bucket, self.comp_bucket, ledger_bucket = bucket_names(service)
        super().__init__(nc, service, self.defs_bucket, ledger_bucket, verify_acceptance)
        self.defs_stream = self.stream
        # daemon key ids whose signatures a chain must carry before practice on it counts
        # (`--trust-daemon`); empty: hashes and links only, the writers trusted to the bus
        self.daemons: frozenset[str] = frozenset()
        self._tasks: set[asyncio.Task[None]] = set()
        self._waking: dict[str, bool] = {}  # proposal id → woken again while being counted

    async def start(self) -> None:
        await self.open()
        # the requests are served before the capabilities that advertise them
        for subject, answer in ((S.skills_get(self.service), self.answer_get),
                                (S.skills_practice(self.service), self.answer_practice),
                                (S.skills_competence(self.service), self.answer_competence),
                                (S.skills_transfer(self.service), self.answer_transfer)):
            self._subs.append(await self.nc.subscribe(subject, queue=self.service,
                                                      cb=self._responder(subject, answer)))
        # the daemon's learn-back records say when a chain has new outcomes (only where to
        # look: the chain is read and verified before anything is counted)
        self._subs.append(await self.nc.subscribe(S.learn_back(self.service, "*"),
                                                  queue=self.service, cb=self._on_learn_back))
        await self._serve()

    async def stop(self) -> None:
        await super().stop()
        tasks, self._tasks = self._tasks, set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def open(self) -> None:
        self.comp = await self._bucket(self.comp_bucket, 1,
                                       "skills store: competence grains and chain heads")
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
        """Store a definition under its hash (a no-op when it is already there); its identity."""
        record = definition_record(definition, now_ms())
        change = Change(op="put", name=record["name"], sha=record["sha256"], record=record)
        await self._store(change.key, lambda current: None if verify(
            current, change.name, change.sha) is None else to_json(record))
        return change.identity

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

    # -- the read under a grant, over NATS -----------------------------------------------------

    async def answer_get(self, data: bytes) -> dict[str, Any] | ErrorReply:
        """One `<svc>.skills.get` request's bytes → its reply (no exceptions escape)."""
        body = _request(data, ("skill",))
        if isinstance(body, ErrorReply):
            return body
        identity = body["skill"]
        match = IDENTITY_RE.match(identity)
        if match is None:
            return _error(wire.INVALID_VALUE, f"{identity!r} is not a skill identity "
                          "<name>:<sha256>", "skill")
        try:
            definition = await self.get_granted(match.group(1), match.group(2))
        except NoGrant as exc:
            return _error("no_grant", str(exc), "skill")
        except NotStored as exc:
            return _error(wire.NOT_FOUND, str(exc), "skill")
        except GrantMismatch as exc:
            return _error("grant_mismatch", str(exc), "skill")
        except Exception as exc:  # the store briefly unreachable: "not now", never a definition
            return self._unavailable("skills.get", exc)
        return {"skill": identity, "definition": definition}

    def _responder(self, subject: str, answer: Callable[[bytes], Awaitable[Any]]
                   ) -> Callable[[Msg], Awaitable[None]]:
        """A subscription callback: every request gets `answer`'s reply, nothing escapes."""

        async def respond(msg: Msg) -> None:
            reply = await answer(msg.data)
            if not msg.reply:
                return
            try:
                await msg.respond(to_json(reply))
            except Exception as exc:
                self.log.warning("could not answer", subject=subject, error=str(exc))

        return respond

    # -- competence over NATS ------------------------------------------------------------------

    async def answer_practice(self, data: bytes) -> dict[str, Any] | ErrorReply:
        """`<svc>.skills.practice` `{"proposal_id"}`: count the chain's new outcomes."""
        body = _request(data, ("proposal_id",))
        if isinstance(body, ErrorReply):
            return body
        try:
            practice, written = await self.practise_proposal(body["proposal_id"])
            head = await self.competence(practice.identity, practice.holder)
        except NotPractice as exc:
            return _error("not_practice", str(exc), "proposal_id")
        except Exception as exc:  # the store briefly unreachable: "not now"
            return self._unavailable("skills.practice", exc)
        return {"proposal_id": practice.proposal_id, "skill": practice.identity,
                "holder": practice.holder, "outcomes": len(practice.outcomes),
                "counted_now": len(written), "competence": head}

    async def answer_competence(self, data: bytes) -> dict[str, Any] | ErrorReply:
        """`<svc>.skills.competence` `{"skill", "holder", "history"?}`: the head grain and, when
        asked, the newest `history` grains of the holder's chain (oldest first)."""
        body = _request(data, ("skill", "holder"), ("history",))
        if isinstance(body, ErrorReply):
            return body
        limit = body.get("history", 0)
        if not isinstance(limit, int) or isinstance(limit, bool) or not 0 <= limit <= 256:
            return _error(wire.INVALID_VALUE, "history is an integer from 0 to 256", "history")
        try:
            head = await self.competence(body["skill"], body["holder"])
            history = await self.competence_history(body["skill"], body["holder"], limit) \
                if limit else []
        except GrantMismatch as exc:
            return _error(wire.INVALID_VALUE, str(exc), "skill")
        except Exception as exc:
            return self._unavailable("skills.competence", exc)
        return {"skill": body["skill"], "holder": body["holder"], "competence": head,
                "history": history}

    async def answer_transfer(self, data: bytes) -> dict[str, Any] | ErrorReply:
        """`<svc>.skills.transfer` `{"skill", "from", "to"}`: the recipe, not the track record."""
        body = _request(data, ("skill", "from", "to"))
        if isinstance(body, ErrorReply):
            return body
        try:
            grain = await self.transfer(body["skill"], body["from"], body["to"], now_ms())
        except NoCompetence as exc:
            return _error(wire.NOT_FOUND, str(exc), "from")
        except Refused as exc:
            return _error("refused", str(exc))
        except GrantMismatch as exc:
            return _error(wire.NOT_FOUND if isinstance(exc, NotStored) else wire.INVALID_VALUE,
                          str(exc), "skill")
        except Exception as exc:
            return self._unavailable("skills.transfer", exc)
        return {"skill": body["skill"], "holder": body["to"], "address": address_of(grain),
                "grain": grain}

    def _unavailable(self, what: str, exc: Exception) -> ErrorReply:
        self.log.warning(f"{what} failed", service=self.service, error=repr(exc))
        return _error("unavailable", f"failed for now: {type(exc).__name__}: {exc}")

    async def _on_learn_back(self, msg: Msg) -> None:
        pid = S.token(msg.subject, 3)
        if pid is None or not S.ID_RE.match(pid):
            return
        if pid in self._waking:
            self._waking[pid] = True  # count again once the running pass ends
            return
        self._waking[pid] = False
        task = asyncio.get_running_loop().create_task(self._wake(pid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wake(self, pid: str) -> None:
        try:
            while True:
                try:
                    await self.practise_proposal(pid)
                except NotPractice as exc:
                    self.log.debug("no practice to count", proposal_id=pid, why=str(exc))
                except Exception as exc:  # asked again by the next record, or by a request
                    self.log.warning("counting practice failed", proposal_id=pid,
                                     error=repr(exc))
                if not self._waking.get(pid):
                    return
                self._waking[pid] = False
        finally:
            self._waking.pop(pid, None)

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

    # -- competence ----------------------------------------------------------------------------

    @staticmethod
    def _head_key(name: str, sha: str, holder_did: str) -> str:
        return f"head.{name}.{sha}.{canonical.sha256_hex(holder_did.encode())}"

    async def _head(self, key: str) -> tuple[dict[str, Any] | None, int]:
        return await read_json(self.comp, key)

    async def _load(self, address: str, sha: str) -> dict[str, Any] | None:
        """The grain at `address`, checked against its address and skill hash; None if absent."""
        try:
            entry = await self.comp.get(f"rec.{address}")
        except KeyNotFoundError:
            return None
        try:
            grain = msgspec.json.decode(entry.value or b"", type=dict[str, Any])
            intact = address_of(grain) == address and canonical.skill_hash(grain) == sha
        except (msgspec.MsgspecError, canonical.CanonicalError, AttributeError, TypeError):
            intact = False
        if not intact:
            raise CorruptRecord(f"competence grain {address} does not match its address or "
                                "its skill hash")
        return grain

    async def _put_grain(self, grain: dict[str, Any]) -> str:
        """Store an immutable grain under its own address (twice is harmless); the address."""
        address = address_of(grain)
        try:
            await self.comp.create(f"rec.{address}", to_json(grain))
        except KeyWrongLastSequenceError:
            pass  # the same content, already there
        return address

    async def _advance(self, key: str, sha: str,
                       make: Callable[[dict[str, Any] | None, str | None],
                                      dict[str, Any] | None],
                       counted: tuple[str, int] | None = None) -> dict[str, Any] | None:
        """Write `make(head grain, head address)` and move the head to it, compare-and-set.
        With `counted` = (proposal id, chain position), the head records that outcome in the
        same write, and an outcome it already records is not counted again (None)."""
        for _ in range(ROUNDS):
            head, rev = await self._head(key)
            if counted is not None and already_counted(head, *counted):
                return None
            prev_address = head["address"] if head else None
            prev = await self._load(prev_address, sha) if prev_address else None
            grain = make(prev, prev_address)
            if grain is None:
                return None
            address = await self._put_grain(grain)
            value: dict[str, Any] = {"address": address, "practice_count": grain["practice_count"]}
            if counted is not None:
                value["counted"] = with_counted(head, *counted)
            elif head is not None and head.get("counted"):
                value["counted"] = head["counted"]
            body = to_json(value)
            try:
                if rev == 0:
                    await self.comp.create(key, body)
                else:
                    await self.comp.update(key, body, last=rev)
            except KeyWrongLastSequenceError:
                continue
            return grain
        raise RuntimeError(f"the competence head {key} kept changing ({ROUNDS} attempts)")

    async def practice(self, identity: str, holder_did: str, signal: Signal, independent: bool,
                       at: int) -> dict[str, Any] | None:
        """Record one outcome of `holder_did` practising `identity` as a new head grain.

        A self-signal (not independent) returns None and writes nothing; an independent one,
        positive or negative, supersedes (rules in the module doc). The caller vouches for
        `independent`; over the bus, `practise_proposal` reads it from the verified chain."""
        _check_holder(holder_did)
        name, _ = split_identity(identity)
        if signal.target_ref is not None and signal.target_ref != f"skill:{name}":
            raise Refused(f"the signal is about {signal.target_ref}, not skill:{name}")
        if not independent:
            return None
        return await self._practise(identity, holder_did, signal.positive, at)

    async def _practise(self, identity: str, holder_did: str, positive: bool, at: int,
                        counted: tuple[str, int] | None = None) -> dict[str, Any] | None:
        name, sha = split_identity(identity)
        record = await self.record(identity)
        definition = definition_of(record["definition"])

        def make(prev: dict[str, Any] | None, prev_address: str | None) -> dict[str, Any]:
            p = prev["proficiency"] if prev else 0.0
            return competence_grain(
                definition, holder_did=holder_did,
                proficiency=next_proficiency(p, positive),
                practice_count=(prev["practice_count"] if prev else 0) + 1,
                created_at=at, last_practiced_at=at,
                derived_from=[prev_address or record["address"]],
                origin_did=prev.get("origin_did") if prev else None)

        grain = await self._advance(self._head_key(name, sha, holder_did), sha, make, counted)
        if grain is not None:
            log.info("practised", service=self.service, skill=identity, holder=holder_did,
                     positive=positive, practice_count=grain["practice_count"],
                     proficiency=grain["proficiency"])
        return grain

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
            grain = await self._practise(practice.identity, practice.holder, outcome.positive,
                                         outcome.at, (proposal_id, outcome.seq))
            if grain is not None:
                written.append(grain)
        return practice, written

    async def competence(self, identity: str, holder_did: str) -> dict[str, Any] | None:
        """The holder's current competence grain (the chain's head), or None."""
        name, sha = split_identity(identity)
        head, _ = await self._head(self._head_key(name, sha, holder_did))
        return await self._load(head["address"], sha) if head else None

    async def competence_history(self, identity: str, holder_did: str,
                                 limit: int | None = None) -> list[dict[str, Any]]:
        """The holder's chain, oldest first, head last (at most `limit` newest grains). It ends
        where `derived_from` leaves the holder: at the definition, or a transfer's source."""
        name, sha = split_identity(identity)
        head, _ = await self._head(self._head_key(name, sha, holder_did))
        chain: list[dict[str, Any]] = []
        address = head["address"] if head else None
        while address and (limit is None or len(chain) < limit):
            grain = await self._load(address, sha)
            if grain is None or grain.get("holder_did") != holder_did:
                break
            chain.append(grain)
            address = (grain.get("derived_from") or [None])[0]
        chain.reverse()
        return chain

    async def transfer(self, identity: str, from_holder: str, to_holder: str,
                       at: int) -> dict[str, Any]:
        """Give `to_holder` the recipe, not the track record (OMS transfer): a first grain with
        the source's definition, derived_from the source grain, origin_did the first holder,
        proficiency and practice_count 0. Repeating the same transfer returns the same grain."""
        _check_holder(from_holder)
        _check_holder(to_holder)
        if from_holder == to_holder:
            raise Refused("a holder cannot transfer a skill to itself")
        name, sha = split_identity(identity)
        await self.record(identity)  # only a servable definition is handed on
        src_head, _ = await self._head(self._head_key(name, sha, from_holder))
        source = await self._load(src_head["address"], sha) if src_head else None
        if source is None or src_head is None:
            raise NoCompetence(f"{from_holder} holds no competence record for {identity}")
        grain = competence_grain(
            definition_of(source), holder_did=to_holder, proficiency=0.0, practice_count=0,
            created_at=at, derived_from=[src_head["address"]],
            origin_did=source.get("origin_did") or from_holder)
        address = await self._put_grain(grain)
        key = self._head_key(name, sha, to_holder)
        try:
            await self.comp.create(key, to_json({"address": address, "practice_count": 0}))
        except KeyWrongLastSequenceError:
            head, _ = await self._head(key)
            if not head or head["address"] != address:
                raise Refused(f"{to_holder} already holds {identity}; it practises its own "
                              "chain") from None
        log.info("transferred", service=self.service, skill=identity, to_holder=to_holder)
        return grain


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
