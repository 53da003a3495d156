"""`improved audit export --oms DIR`: the audit chains as OMS grains in files, and their
re-verification.

Each chain whose hashes and links re-derive (and, for a proposal's, whose lifecycle and filing
hold: `audit.verify_chain`) is written as its grains (`core.oms_observation.chain_grains`):
`<content address>.mg`, the grain's exact bytes, and one manifest, `chains.json`, naming each
chain's service, id and grains in order. A broken chain is named and not exported; who wrote
the trailers is `improved audit verify`'s to check (each grain keeps its trailer's `sig`).
`verify(DIR)` reads the files back: each blob re-encodes byte for byte under its address, and
each chain's grains derive from one another and give back trailers that hash and link, so a
grain altered, removed or swapped after the export is named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from improved.core import audit
from improved.core.oms_observation import (
    Grain,
    NotExportable,
    blob_problem,
    chain_grains,
    chain_problems,
    decoded,
)
from improved.protocol import canonical
from improved.protocol import subjects as S

if TYPE_CHECKING:
    from improved.client.deployment import Deployment

MANIFEST = "chains.json"
SUFFIX = ".mg"


@dataclass
class Exported:
    """What an export wrote, and one line for each chain it left out."""

    chains: int = 0
    grains: int = 0
    left_out: list[str] = field(default_factory=list)


def file_of(directory: Path, address: str) -> Path:
    return directory / f"{address}{SUFFIX}"


async def export(store: Deployment, directory: Path) -> Exported:
    """Write every chain of the audit log that verifies to `directory` as OMS grains; OSError
    when the directory cannot be written."""
    return write(directory, await store.sequenced_chains())


def write(directory: Path,
          chains: dict[tuple[str, str], list[tuple[int, dict[str, Any]]]]) -> Exported:
    """Write `chains` ((service token, chain id) → (stream sequence, trailer) in order) that
    verify to `directory` as OMS grains, and the manifest naming them."""
    directory.mkdir(parents=True, exist_ok=True)
    done, manifest = Exported(), []
    for (svc, chain_id), entries in sorted(chains.items()):
        proposal = svc not in S.MESH_CHAINS
        bodies = [body for _, body in entries]
        brk = (audit.verify_chain(chain_id, bodies, service=svc) if proposal
               else audit.verify_links(chain_id, bodies))
        if brk is not None:
            done.left_out.append(f"BROKEN {brk}: not exported (run `improved audit verify`)")
            continue
        try:
            grains = chain_grains(chain_id, svc, entries, proposal)
        except (NotExportable, canonical.CanonicalError) as exc:
            done.left_out.append(f"NOT EXPORTED {chain_id}: {exc}")
            continue
        for g in grains:
            path = file_of(directory, g.address)
            if not path.exists() or path.read_bytes() != g.blob:
                path.write_bytes(g.blob)
        manifest.append({"service": svc, "chain": chain_id, "proposal": proposal,
                         "grains": [g.address for g in grains]})
        done.chains += 1
        done.grains += len(grains)
    (directory / MANIFEST).write_text(json.dumps({"chains": manifest}, indent=1) + "\n")
    return done


def verify(directory: Path) -> list[str]:
    """Every problem of the export in `directory`, one line each; empty when it re-verifies."""
    try:
        listed = json.loads((directory / MANIFEST).read_text())["chains"]
        assert isinstance(listed, list)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as exc:
        return [f"{directory / MANIFEST}: no manifest of an export ({exc})"]
    problems: list[str] = []
    for entry in listed:
        problems += _chain(directory, entry)
    return problems


def _chain(directory: Path, entry: Any) -> list[str]:
    """The problems of one chain the manifest lists."""
    try:
        chain_id, proposal = str(entry["chain"]), bool(entry["proposal"])
        addresses = [str(a) for a in entry["grains"]]
    except (KeyError, TypeError) as exc:
        return [f"{MANIFEST}: an entry that names no chain ({exc})"]
    grains: list[Grain] = []
    for address in addresses:
        try:
            blob = file_of(directory, address).read_bytes()
        except OSError as exc:
            return [f"chain {chain_id}: grain {address} cannot be read ({exc.strerror or exc})"]
        problem = blob_problem(address, blob)
        if problem is not None:
            return [f"chain {chain_id}: grain {address}: {problem}"]
        grains.append(Grain(address, blob, decoded(blob)[1]))
    return [f"chain {chain_id}: {p}" for p in chain_problems(chain_id, grains, proposal)]
