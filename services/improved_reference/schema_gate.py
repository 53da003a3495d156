"""The artefact store's schema discipline (SPEC 09 §7.4, SPEC 08 §7) for `schema:` targets.

Only the owner knows the schema in force, so the class of a change is decided here, at apply
time, against the store's own head — never against a base or a class the proposer claims:
- the change carries its backward-compatible revert, restoring exactly the schema it replaces
  (`schema_revert`, `schema_base` otherwise);
- forward-compatible: applied (the L4 approval per occurrence stays the constitution's gate);
- backward (only takes away): refused whoever approved it (`schema_backward`);
- breaking: applied only under an operator's own signed approval on the chain — a quorum's does
  not do (`schema_breaking`).
The recorded reversal of a schema change this store applied, while the schema is still the one
that change installed, is the sanctioned way back and is not classified.

The class found is recorded on the ledger entry and answered as the ApplyResult's
`schema_class` (forward, breaking or reversal), which the daemon copies onto the `applied`
trailer: the store's claim, for auditors. `<svc>.improve.classify` answers the same
classification, read only, for a pending proposal (`classify`), so an operator sees it before
approving: `reversal` too, for a pending recorded reversal the apply would not classify.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from improved.client import acceptance
from improved.core import schemas
from improved.core.apply import rolls_back
from improved.protocol import wire
from improved.protocol.model import ApplyOrder, ClassifyReply, Proposal
from improved_reference.kv_service import Refused, read_json

if TYPE_CHECKING:
    from improved_reference.artefact_store import ArtefactStore, Change

SMOKE_TEST = "json_schema"


def smoke(data: bytes) -> int:
    """The `json_schema` smoke test: 0 when the content is a JSON Schema document."""
    try:
        schemas.parse(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return 1
    return 0


async def check(store: ArtefactStore, order: ApplyOrder, change: Change,
                manifest: dict[str, str]) -> dict[str, Any] | None:
    """None for a target that is not `schema:`; else the classes to record on the ledger
    entry, or Refused naming the first reason (`<code>: <artefact> at <pointer>: <what>`)."""
    p = order.proposal
    if not schemas.is_schema(p.target_ref):
        return None
    if change.op == "restore" and await _undoes(store, order.proposal, change, manifest):
        return {"class": "reversal"}
    bad = schemas.revert_problem(list(change.set), p.revert)
    if bad is not None:
        raise Refused(f"{wire.SCHEMA_REVERT}: {bad}")
    stale = schemas.base_problem(p.revert or {}, manifest)
    if stale is not None:
        raise Refused(f"{wire.SCHEMA_BASE}: {stale}")
    found = {name: await _classify(store, name, manifest[name], digest, change)
             for name, digest in sorted(change.set.items())}
    for kind, code in (("backward", wire.SCHEMA_BACKWARD), ("breaking", wire.SCHEMA_BREAKING)):
        first = next(((n, c) for n, c in found.items() if c.kind == kind), None)
        if first is None:
            continue
        line = f"{first[0]} at {first[1].line()}"
        if kind == "backward":
            raise Refused(f"{code}: {line}; a change that only takes away is refused whoever "
                          "approved it (SPEC 08 §7 allows no backward migration)")
        not_operator = await acceptance.operator_approved(store.js, order)
        if not_operator is not None:
            raise Refused(f"{code}: {line}; a breaking change needs an operator's own signed "
                          f"approval ({not_operator.removeprefix(acceptance.PREFIX)})")
    breaking = {n: c.line() for n, c in found.items() if c.kind == "breaking"}
    return {"class": "breaking", "reasons": breaking} if breaking else {"class": "forward"}


async def classify(store: ArtefactStore, proposal: Proposal) -> ClassifyReply:
    """The class of the `schema:` change `proposal` asks for, against the schema the store
    holds now, as `check` would find it at apply time (read only: nothing is uploaded or
    written); Refused in one line when there is nothing to classify."""
    if not schemas.is_schema(proposal.target_ref):
        raise Refused(f"{proposal.target_ref[:100]} is not a schema: target; only a schema "
                      "change has a class")
    change = store.parse_change(proposal)
    manifest = await store.manifest()
    if change.op == "restore" and await _undoes(store, proposal, change, manifest):
        names, original = ", ".join(sorted(change.set)), rolls_back(proposal) or ""
        return ClassifyReply(class_="reversal", reason=(
            f"{names}: the recorded reversal of {original[:12]} (it puts back "
            "what that change replaced; not classified, as at apply time)")[:500])
    found = {}
    for name, digest in sorted(change.set.items()):
        head = manifest.get(name)
        if head is None:
            raise Refused(f"artefact {name}: no current schema to classify against")
        found[name] = await _classify(store, name, head, digest, change)
    kind, reason = schemas.overall(found)
    return ClassifyReply(class_=kind, reason=reason[:500])


async def _classify(store: ArtefactStore, name: str, head: str, digest: str,
                    change: Change) -> schemas.Change:
    data = change.blobs.get(name)
    if data is None:
        data = await store.blob(digest)
    try:
        new = schemas.parse((data or b"").decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise Refused(f"{wire.SCHEMA_INVALID}: {name}: the proposed schema is not a JSON "
                      f"Schema ({exc})") from None
    current = await store.blob(head)
    try:
        old = schemas.parse((current or b"").decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return schemas.Change("breaking", "", "the current content is not a JSON Schema, so "
                              "nothing about the change is provable")
    return schemas.classify(old, new)


async def _undoes(store: ArtefactStore, proposal: Proposal, change: Change,
                  manifest: dict[str, str]) -> bool:
    """The restore puts back exactly what a change this store applied replaced, and the schema
    is still the one that change installed: the reversal the original's approval covers."""
    original = rolls_back(proposal)
    if original is None:
        return False
    entry, _ = await read_json(store.ledger, original)
    return (isinstance(entry, dict) and entry.get("revision") is not None
            and entry.get("op") == "swap" and entry.get("prior") == change.set
            and all(manifest.get(n) == d for n, d in entry.get("set", {}).items()))
