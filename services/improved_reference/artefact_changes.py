"""What a proposal asks of the artefact store, read without I/O: the swap or restore it names
and its `lkg` entries (the contract is in `artefact_store`'s docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict

from improved_reference.artefact_blobs import DIGEST_RE, NAME_RE
from improved_reference.kv_service import Refused

KEY = "manifest"


@dataclass(frozen=True)
class Change:
    op: str  # "swap" | "restore"
    set: dict[str, str]  # name → the digest the manifest will hold
    blobs: dict[str, bytes] = field(default_factory=dict, compare=False)  # swap: new content
    key: str = KEY
    schema: dict[str, Any] | None = field(default=None, compare=False)  # a schema: change's class


class LkgEntry(TypedDict):
    """One entry of a proposal's `lkg`: the digest to check (None: the current one) and the
    smoke test to run on it."""

    digest: str | None
    smoke_test: str


def parse_lkg(lkg: Any) -> dict[str, LkgEntry]:
    """`lkg` entries by artefact name, or Refused (ValueError for the LKG check)."""
    if not isinstance(lkg, list) or not lkg:
        raise Refused("lkg must be a non-empty list of {artefact, digest, smoke_test}")
    out: dict[str, LkgEntry] = {}
    for entry in lkg:
        if not isinstance(entry, dict):
            raise Refused("every lkg entry must be an object {artefact, digest, smoke_test}")
        name, digest, smoke = entry.get("artefact"), entry.get("digest"), entry.get("smoke_test")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise Refused(f"lkg artefact {name!r} must match {NAME_RE.pattern}")
        if digest is not None and (not isinstance(digest, str) or not DIGEST_RE.match(digest)):
            raise Refused(f"lkg digest of {name} must be sha256:<64 lowercase hex>")
        if not isinstance(smoke, str) or not smoke:
            raise Refused(f"lkg entry {name} needs a smoke_test id")
        if name in out:
            raise Refused(f"artefact {name} is listed twice in lkg")
        out[name] = {"digest": digest, "smoke_test": smoke}
    return out


def restore_change(restore: Any, lkg: Any) -> Change:
    """The restore `proposal_data.restore` asks for, checked against `lkg` when given."""
    if not isinstance(restore, dict) or not restore:
        raise Refused('proposal_data.restore must be a non-empty {name: "sha256:<hex>"} object')
    for name, digest in restore.items():
        if not NAME_RE.match(name):
            raise Refused(f"artefact {name!r} must match {NAME_RE.pattern}")
        if not isinstance(digest, str) or not DIGEST_RE.match(digest):
            raise Refused(f"artefact {name}: restore digest must be sha256:<64 lowercase hex>")
    if lkg is not None:
        entries = parse_lkg(lkg)
        if set(entries) != set(restore) or any(entries[n]["digest"] not in (None, restore[n])
                                               for n in restore):
            raise Refused("lkg, when given for a restore, must name the restored artefacts "
                          "with the restored digests")
    return Change(op="restore", set=dict(restore))
