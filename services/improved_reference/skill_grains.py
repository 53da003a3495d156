"""The grains a Skill grain names, as the reference skills store resolves them. Pure: no NATS,
no clock.

OMS's Skill grain is reference-heavy: each `dependencies` entry MUST be the content address of
a Skill grain, each `allowed_tools` entry SHOULD name a Tool definition grain. A reference that
is only well formed binds nothing, so the store resolves them: a dependency to a Skill grain it
holds, an `allowed_tools` address to a Tool definition grain it holds (an entry may also be a
bare tool name, the id the runtime's catalog lists). Every grain is checked by recomputing its
content address with the project's OMS encoder (`canonical.content_address`): what a bucket
holds under an address is believed only when it is the grain of that address.

A Tool definition grain here is `{"type": "tool", "name", "description"?, "version"?,
"created_at", "namespace"?}` (type byte 0x05): the name is the tool's name in a runtime's
catalog.

The heads view (`indexed`) adds the OMS index-layer fields `superseded_by` and
`system_valid_to` to a holder's chain; they are never part of a grain's bytes or address.
"""

from __future__ import annotations

from typing import Any

from improved.core.tools import NAME_RE as TOOL_NAME_RE
from improved.protocol import canonical

MG = "mg:sha256:"
TOOL_FIELDS = ("type", "name", "description", "version", "created_at", "namespace")


def bare(address: str) -> str:
    """The 64 hex digits of a grain address, with or without its `mg:sha256:` prefix."""
    return address.removeprefix(MG)


def is_address(text: Any) -> bool:
    return isinstance(text, str) and canonical.GRAIN_ADDRESS_RE.match(text) is not None


def allowed_tools_problem(skill: dict[str, Any]) -> str | None:
    """Why a definition's `allowed_tools` is not a list of tool names and Tool grain
    addresses, or None. A 64-hex entry is always an address."""
    tools = skill.get("allowed_tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        return "allowed_tools must be a list of tool names or Tool grain addresses"
    for i, entry in enumerate(tools):
        if not (is_address(entry) or (isinstance(entry, str) and TOOL_NAME_RE.match(entry))):
            return (f"allowed_tools[{i}] = {repr(entry)[:80]} is neither a tool name "
                    f"({TOOL_NAME_RE.pattern}) nor a Tool definition grain's content address "
                    "(mg:sha256:<64 lowercase hex>)")
    return None


def tool_addresses(definition: dict[str, Any]) -> list[tuple[int, str]]:
    """(index, bare address) of each `allowed_tools` entry that names a Tool grain."""
    return [(i, bare(e)) for i, e in enumerate(definition.get("allowed_tools") or ())
            if is_address(e)]


def dependency_addresses(definition: dict[str, Any]) -> list[tuple[int, str]]:
    """(index, bare address) of each dependency (its format checked before)."""
    return [(i, bare(e)) for i, e in enumerate(definition.get("dependencies") or ())]


def tool_grain_problem(grain: Any) -> str | None:
    """Why `grain` is not a Tool definition grain with a content address, or None."""
    if not isinstance(grain, dict):
        return "a Tool definition grain is an object"
    unknown = sorted(set(grain) - set(TOOL_FIELDS))
    if unknown:
        return f"unknown Tool grain fields {unknown}; it has {list(TOOL_FIELDS)}"
    if grain.get("type") != "tool":
        return f"a Tool definition grain has type 'tool', not {grain.get('type')!r}"
    name = grain.get("name")
    if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
        return f"the tool's name {name!r} must match {TOOL_NAME_RE.pattern}"
    for field in ("description", "version", "namespace"):
        if grain.get(field) is not None and not isinstance(grain[field], str):
            return f"the Tool grain's {field} must be a string"
    try:
        canonical.content_address(grain, canonical.TOOL)
    except canonical.CanonicalError as exc:
        return f"the Tool grain has no canonical form: {exc}"
    return None


def bound_of(definition: dict[str, Any],
             tools: dict[str, dict[str, Any] | None]) -> frozenset[str] | str:
    """The tool names a skill's calls are bound to: its `allowed_tools` names, and the name of
    each Tool grain it names by address (`tools`: address → the grain held, or None); or why
    there is no bound to enforce (a named Tool grain not held)."""
    names = set()
    for i, entry in enumerate(definition.get("allowed_tools") or ()):
        if not is_address(entry):
            names.add(entry)
            continue
        grain = tools.get(bare(entry))
        if grain is None:
            return (f"allowed_tools[{i}] = {MG}{bare(entry)} names no Tool definition grain "
                    "the skills store holds")
        names.add(grain["name"])
    return frozenset(names)


def grain_problem(grain: Any, address: str, type_byte: int) -> str | None:
    """Why `grain` is not the grain of `address` of that type, or None."""
    if not isinstance(grain, dict):
        return f"what is held as {address[:12]} is no grain"
    try:
        actual = canonical.content_address(grain, type_byte)
    except (canonical.CanonicalError, TypeError) as exc:
        return f"what is held as {address[:12]} has no canonical form: {exc}"
    if actual != bare(address):
        return (f"what is held as {address[:12]} is the grain of {actual[:12]}: it is not the "
                "grain that address names")
    return None


def definition_grain(record: dict[str, Any], namespace: str) -> dict[str, Any]:
    """The pure-definition Skill grain of a stored record: the grain its `address` names."""
    provenance = {k: record[k] for k in ("derived_from", "origin_did", "author_did")
                  if record.get(k) is not None}
    return {"type": "skill", **record["definition"], **provenance,
            "created_at": record["created_at"], "namespace": namespace}


def indexed(chain: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A holder's chain (oldest first) with the OMS index-layer fields: each grain's
    `superseded_by` is the next one's address and its `system_valid_to` the time the next one
    was written; the head has neither (null), which is what selects the current heads."""
    out = []
    for i, grain in enumerate(chain):
        after = chain[i + 1] if i + 1 < len(chain) else None
        out.append({**grain, "address": canonical.content_address(grain, canonical.SKILL),
                    "superseded_by": None if after is None else
                    canonical.content_address(after, canonical.SKILL),
                    "system_valid_to": None if after is None else after["created_at"]})
    return out


def discovery_problem(query: dict[str, Any]) -> tuple[str, str] | None:
    """(field, why) when a discovery query is not `{"name"?, "namespace"?, "holder"?,
    "min_proficiency"?, "history"?}` of the right types, else None."""
    for field in ("name", "namespace", "holder"):
        if field in query and (not isinstance(query[field], str) or not query[field]):
            return field, f"{field} must be a non-empty string"
    floor = query.get("min_proficiency", 0.0)
    if isinstance(floor, bool) or not isinstance(floor, int | float) or not 0 <= floor <= 1:
        return "min_proficiency", "min_proficiency is a number from 0 to 1"
    if not isinstance(query.get("history", False), bool):
        return "history", "history is true or false"
    return None


def matches(grain: dict[str, Any], query: dict[str, Any]) -> bool:
    """Whether a held instance answers a discovery query (OMS: type=skill, by name, namespace,
    holder, proficiency at least)."""
    return (grain.get("type") == "skill"
            and all(query[f] == grain.get(k) for f, k in
                    (("name", "name"), ("namespace", "namespace"), ("holder", "holder_did"))
                    if f in query)
            and float(grain.get("proficiency", 0.0)) >= float(query.get("min_proficiency", 0)))


def best_first(grains: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Proficiency descending, then by name and holder (a stable answer)."""
    return sorted(grains, key=lambda g: (-float(g.get("proficiency", 0.0)), g.get("name", ""),
                                         g.get("holder_did", "")))
