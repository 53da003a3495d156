"""What a skill definition is to the reference skills store, and what a `skill:` proposal asks
of it. Pure: no NATS, no clock but `now_ms`.

A skill's identity is `<name>:<sha256>` (`canonical.skill_hash`, definition fields only), never
its bare name; a record is served only while it re-hashes to that identity (`verify`). The
store's storage contract is in `skills_store`'s docstring.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import Proposal
from improved_reference import kv_service
from improved_reference.skill_competence import NAMESPACE
from improved_reference.skill_grains import allowed_tools_problem

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
    tools = allowed_tools_problem(skill)
    if tools is not None:
        raise Refused(tools)
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


def check_holder(holder_did: Any) -> None:
    if not isinstance(holder_did, str) or not holder_did:
        raise Refused("a holder DID is a non-empty string")

