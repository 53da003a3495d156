"""A skill's transfer bundle: what one deployment's skills store exports and another's imports
and re-verifies (OMS Skill transfer: share the Skill grain, and its dependencies travel too).
Pure: no NATS, no clock.

A bundle is `{"format", "skill": "<name>:<sha256>", "grains": [...], "tools": [...],
"holder"?}`. `grains` is the skill's pure-definition Skill grain first, then its dependency
closure, each `{"address", "grain", "proposal_id", "chain", "seqs"}`: the grain, its content
address, and the audit chain of the proposal that approved and applied it there (every trailer,
with the daemon's signatures, and the stream sequence of each: a commit's trailers share one). `tools` is each Tool definition grain an `allowed_tools` entry names by
address, `{"address", "grain"}`. `holder`, when given, is the exporting holder's competence head
`{"address", "grain"}`, which the importing holder's first grain derives from.

The importer believes none of it as sent (`verified`): every address is recomputed with the
project's OMS encoder, every grain must be a pure definition whose record re-derives the same
address, the closure must be whole, and each chain must verify — hashes, links, and every
trailer signed by a daemon key the importer trusts — register a proposal carrying exactly that
definition, and record it applied and not rolled back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from improved.core import propose
from improved.core.audit import verify_chain
from improved.core.evidence import DaemonWriters
from improved.core.trailers import Applied, RolledBack, decode
from improved.protocol import canonical, wire
from improved.protocol.model import Trailer
from improved_reference.skill_definitions import Refused, definition_record
from improved_reference.skill_grains import (
    bare,
    dependency_addresses,
    grain_problem,
    tool_addresses,
    tool_grain_problem,
)

FORMAT = "improved.skill-bundle/1"


@dataclass(frozen=True)
class Imported:
    """A bundle that verified: the records to store (dependencies first), the Tool grains,
    and the exporting holder's head (address, grain), if it carried one."""

    identity: str
    address: str
    records: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    holder: tuple[str, dict[str, Any]] | None


def entry(address: str, grain: dict[str, Any], proposal_id: str,
          chain: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """One `grains` entry: the chain's trailers and their stream sequences (the trailers of
    one commit share one, and the daemon signed its last)."""
    return {"address": address, "grain": grain, "proposal_id": proposal_id,
            "chain": [body for _, body in chain], "seqs": [seq for seq, _ in chain]}


def approval_problem(proposal_id: str, chain: Any, seqs: Any, identity: str,
                     trust: DaemonWriters) -> str | None:
    """Why `chain` does not prove that the loop approved and applied `identity` as
    `proposal_id`, under a daemon key in `trust`; None when it does."""
    if not isinstance(chain, list) or not chain or not all(isinstance(b, dict) for b in chain):
        return f"no audit chain for {proposal_id[:12]}"
    if not isinstance(seqs, list) or len(seqs) != len(chain) \
            or not all(isinstance(q, int) and not isinstance(q, bool) for q in seqs):
        return f"the chain of {proposal_id[:12]} comes without its stream sequences"
    broken = verify_chain(proposal_id, chain, trust, seqs)
    if broken is not None:
        return f"the audit chain of {proposal_id[:12]} does not verify: {broken}"
    try:
        trailers = [msgspec.convert(body, type=Trailer) for body in chain]
        said = [decode(t) for t in trailers]
        proposal = propose.registration(trailers[0]).proposal
    except (msgspec.MsgspecError, ValueError, wire.WireError) as exc:
        return f"the chain of {proposal_id[:12]} carries no readable proposal: {exc}"
    skill = propose.skill_definition(proposal)
    try:
        carried = canonical.skill_identity(skill) if skill is not None else None
    except canonical.CanonicalError:
        carried = None
    if carried != identity:
        return f"the proposal {proposal_id[:12]} approved {carried}, not {identity}"
    live = False
    for data in said:
        if isinstance(data, Applied) and data.verdict == "applied":
            live = True
        elif isinstance(data, RolledBack) and data.verdict == "rolled_back":
            live = False
    return None if live else f"the chain of {proposal_id[:12]} records no apply that stands"


def _record(item: Any, trust: DaemonWriters) -> tuple[str, dict[str, Any]]:
    """(address, the record to store) of one verified `grains` entry; Refused otherwise."""
    if not isinstance(item, dict) or not isinstance(item.get("address"), str):
        raise Refused("a bundle's grains are {address, grain, proposal_id, chain}")
    address, grain = bare(item["address"]), item.get("grain")
    problem = grain_problem(grain, address, canonical.SKILL)
    if problem is not None:
        raise Refused(f"bundle grain {address[:12]}: {problem}")
    assert isinstance(grain, dict)  # grain_problem
    skill = {k: v for k, v in grain.items() if k != "namespace"}
    try:
        record = definition_record(skill, 0)
    except Refused as exc:
        raise Refused(f"bundle grain {address[:12]} is no pure skill definition: {exc}") \
            from None
    if record["address"] != address:
        raise Refused(f"bundle grain {address[:12]} is not in the namespace of skills")
    pid = item.get("proposal_id")
    identity = f"{record['name']}:{record['sha256']}"
    why = approval_problem(pid, item.get("chain"), item.get("seqs"), identity, trust) \
        if isinstance(pid, str) else "no proposal_id"
    if why is not None:
        raise Refused(f"bundle grain {address[:12]} ({identity}): {why}")
    return address, {**record, "imported": {"proposal_id": pid}}


def _tools(items: Any, needed: set[str]) -> list[dict[str, Any]]:
    """The bundle's Tool grains, each its address's, covering `needed`."""
    held: dict[str, dict[str, Any]] = {}
    for item in items if isinstance(items, list) else ():
        address = bare(str(item.get("address"))) if isinstance(item, dict) else ""
        grain = item.get("grain") if isinstance(item, dict) else None
        problem = tool_grain_problem(grain) or grain_problem(grain, address, canonical.TOOL)
        if problem is not None:
            raise Refused(f"bundle tool {address[:12]}: {problem}")
        assert isinstance(grain, dict)
        held[address] = grain
    missing = sorted(needed - set(held))
    if missing:
        raise Refused(f"the bundle lacks the Tool grain {missing[0]} its skills allow")
    return [held[a] for a in sorted(needed)]


def verified(bundle: Any, trust: DaemonWriters) -> Imported:
    """The bundle as this store may keep it, or Refused naming the first problem (one line)."""
    if not isinstance(bundle, dict) or bundle.get("format") != FORMAT:
        raise Refused(f"not a skill bundle (format {FORMAT})")
    items = bundle.get("grains")
    if not isinstance(items, list) or not items:
        raise Refused("the bundle carries no Skill grain")
    records = dict(_record(item, trust) for item in items)
    root_address = bare(str(items[0].get("address")))
    root = records[root_address]
    identity = f"{root['name']}:{root['sha256']}"
    if bundle.get("skill") != identity:
        raise Refused(f"the bundle says it carries {bundle.get('skill')}, its grain is "
                      f"{identity}")
    needed: set[str] = set()
    order: list[dict[str, Any]] = []
    todo, seen = [root_address], set()
    while todo:
        address = todo.pop()
        if address in seen:
            continue
        if address not in records:
            raise Refused(f"the bundle lacks the dependency {address} of its closure")
        seen.add(address)
        order.append(records[address])
        definition = records[address]["definition"]
        todo.extend(a for _, a in dependency_addresses(definition))
        needed.update(a for _, a in tool_addresses(definition))
    tools = _tools(bundle.get("tools"), needed)
    return Imported(identity, root_address, order[::-1], tools,
                    _holder(bundle.get("holder"), root["sha256"]))


def _holder(item: Any, sha: str) -> tuple[str, dict[str, Any]] | None:
    """The exporting holder's head, its address recomputed and its skill hash the root's."""
    if item is None:
        return None
    address = bare(str(item.get("address"))) if isinstance(item, dict) else ""
    grain = item.get("grain") if isinstance(item, dict) else None
    problem = grain_problem(grain, address, canonical.SKILL)
    if problem is not None:
        raise Refused(f"the bundle's holder grain: {problem}")
    assert isinstance(grain, dict)
    if canonical.skill_hash(grain) != sha or not isinstance(grain.get("holder_did"), str):
        raise Refused("the bundle's holder grain is no held instance of its skill")
    return address, grain
