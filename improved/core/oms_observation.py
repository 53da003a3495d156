"""The audit chains as OMS Observation grains, so an OMS tool can read the loop's history.

OMS records each lifecycle transition of a Recommendation as one audit Observation grain
(OMS §8.12.1, §8.6): the acting principal in `observer_id`, its class in `observer_type`, the
reason in `object`, and `derived_from` holding the recommendation's content address and the
previous audit grain's. A trailer says all of that already; this module maps one onto the
other, both ways, without loss (docs/protocol.md, "Audit trailers as OMS Observation grains"):

- the grain's fields: `type` "observation", `observer_id` = `actor`, `observer_type`,
  `object` = `reason`, `created_at` = `at`, `subject` = the chain id, `relation` =
  `rec:<verdict>` (or `rec:<to_stage>` for a trailer without a verdict), `namespace`, and
  `derived_from`;
- every other field of the trailer (`seq`, `prev`, `hash`, `sig`, `refs`, …) in `context`,
  OMS's string→string map, as its JSON text, so `trailer_of` gives back the trailer whose hash
  the chain links, and the daemon's signature over it can still be checked;
- what the export knows beside the trailer in `context` under `@` keys (`@service`, the
  subject's service token, and `@stream_seq`, the message's stream sequence).

Each grain is canonical OMS bytes (`canonical.grain_blob`, type byte 0x06) named by its
content address; `blob_problem` re-encodes a blob and `chain_problems` re-walks a chain, so a
grain altered after the export is named. Pure: the files are the shell's
(`improved.client.oms_export`).
"""

from __future__ import annotations

import hmac
import json
import struct
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from improved.core import propose
from improved.core.audit import trailer_hash
from improved.protocol import canonical
from improved.protocol.model import Trailer

# OMS rule 7: a recommendation's queue, and so its audit grains, in their own namespace
PROPOSAL_NAMESPACE: Final = "agent:recommendations"
MESH_NAMESPACE: Final = "improved:audit"  # the mesh chains' (trust, policy, grants, …)
# trailer field → Observation field; everything else goes into `context` as JSON text
_MAPPED: Final = {"actor": "observer_id", "observer_type": "observer_type", "reason": "object",
                  "at": "created_at", "proposal_id": "subject"}
_UNMAPPED: Final = {grain: trailer for trailer, grain in _MAPPED.items()}
_EXPORT_KEYS: Final = ("@service", "@stream_seq")
_HEADER = struct.Struct(">BBBHI")
_FULL_NAME: Final = {short: full for full, short in canonical.FIELD_MAP.items()}


class NotExportable(ValueError):
    """A trailer this module cannot map without loss (the text says which and why)."""


@dataclass(frozen=True, slots=True)
class Grain:
    """One grain: its content address, its blob (header and canonical payload) and its fields
    by their full names."""

    address: str
    blob: bytes
    fields: dict[str, Any]


def grain(fields: dict[str, Any], type_byte: int) -> Grain:
    blob = canonical.grain_blob(fields, type_byte)
    return Grain(canonical.sha256_hex(blob), blob, fields)


def observation(body: dict[str, Any], service: str, stream_seq: int, namespace: str,
                derived_from: list[str]) -> Grain:
    """The audit Observation grain of one trailer `body` (as read off the stream)."""
    for key, want in (("actor", str), ("observer_type", str), ("reason", str),
                      ("at", int), ("proposal_id", str)):
        if not isinstance(body.get(key), want) or isinstance(body.get(key), bool):
            raise NotExportable(f"its `{key}` is not a {want.__name__}")
    if any(k.startswith("@") for k in body):
        raise NotExportable("a field of it starts with @")
    verdict = body.get("verdict") or body.get("to_stage")
    # ASCII JSON text survives OMS's NFC normalisation as it is; so does a mapped string that
    # is already NFC, and one that is not is kept exactly in context too (`trailer_of` prefers it)
    context = {k: json.dumps(v, ensure_ascii=True, separators=(",", ":"))
               for k, v in body.items()
               if k not in _MAPPED or (isinstance(v, str) and _nfc_changes(v))}
    context.update({"@service": service, "@stream_seq": str(stream_seq)})
    fields: dict[str, Any] = {_MAPPED[k]: body[k] for k in _MAPPED}
    fields.update(type="observation", relation=f"rec:{verdict}", namespace=namespace,
                  context=context, derived_from=derived_from or None)
    return grain(fields, canonical.OBSERVATION)


def _nfc_changes(text: str) -> bool:
    return not text.isascii() and canonical.normalize(text) != text


def trailer_of(fields: dict[str, Any]) -> dict[str, Any]:
    """The trailer an Observation grain (full names) was made from, as it was on the stream."""
    context = fields.get("context")
    if not isinstance(context, dict):
        raise NotExportable("the grain has no context")
    body = {_UNMAPPED[k]: fields[k] for k in _UNMAPPED if k in fields}
    for key, text in context.items():
        if not key.startswith("@"):
            body[key] = json.loads(text)
    return body


def recommendation(first: dict[str, Any], chain_id: str) -> Grain:
    """The Recommendation grain a proposal chain's registration trailer carries; its content
    address is the proposal id, so it must be `chain_id`."""
    try:
        registered = propose.registration(msgspec.convert(first, Trailer)).proposal
    except (ValueError, msgspec.MsgspecError) as exc:
        raise NotExportable(f"its first trailer registers no proposal: {exc}") from None
    rec = grain(propose.grain_of(registered), canonical.RECOMMENDATION)
    if rec.address != chain_id:
        raise NotExportable(f"its registration carries the content of {rec.address}")
    return rec


def chain_grains(chain_id: str, service: str, entries: list[tuple[int, dict[str, Any]]],
                 proposal: bool) -> list[Grain]:
    """A chain's grains, in order: for a proposal's chain its Recommendation grain first, then
    one Observation per trailer, each derived from the recommendation and its predecessor."""
    head = [recommendation(entries[0][1], chain_id)] if proposal else []
    out = list(head)
    namespace = PROPOSAL_NAMESPACE if proposal else MESH_NAMESPACE
    for seq, body in entries:
        links = [g.address for g in head]
        if len(out) > len(head):
            links.append(out[-1].address)
        out.append(observation(body, service, seq, namespace, links))
    return out


# -- reading back ------------------------------------------------------------------------------


def decoded(blob: bytes) -> tuple[int, dict[str, Any]]:
    """(type byte, fields by their full names) of a blob; ValueError when it is none."""
    if len(blob) < 10:
        raise ValueError(f"{len(blob)} bytes: shorter than an OMS grain (ERR_TOO_SHORT)")
    version, _flags, type_byte, _ns, _seconds = _HEADER.unpack(blob[:9])
    if version != 0x01:
        raise ValueError(f"version byte {version:#04x} (ERR_VERSION)")
    try:
        payload = msgspec.msgpack.decode(blob[9:])
    except msgspec.MsgspecError as exc:
        raise ValueError(f"the payload is no MessagePack: {exc} (ERR_CORRUPT)") from None
    if not isinstance(payload, dict):
        raise ValueError("the payload is not a map (ERR_NOT_MAP)")
    return type_byte, {(_FULL_NAME[k] if k in _FULL_NAME else k): v for k, v in payload.items()}


def blob_problem(address: str, blob: bytes) -> str | None:
    """Why `blob` is not the canonical OMS grain named `address`, or None: its SHA-256 is the
    address, and decoding then encoding it with this project's encoder gives the same bytes."""
    if not hmac.compare_digest(canonical.sha256_hex(blob), address):
        return f"its content address is {canonical.sha256_hex(blob)}, not {address}"
    try:
        type_byte, fields = decoded(blob)
        again = canonical.grain_blob(fields, type_byte)
    except (ValueError, TypeError) as exc:
        return f"it does not decode: {exc}"
    return None if again == blob else "it is not in canonical form: re-encoded, its bytes differ"


def chain_problems(chain_id: str, grains: list[Grain], proposal: bool) -> list[str]:
    """What does not hold of one exported chain: the recommendation heads a proposal's chain
    under its id; each Observation derives from the recommendation and its predecessor, and
    gives back a trailer whose hash re-derives and links to the one before."""
    problems: list[str] = []
    head: list[str] = []
    if proposal:
        if not grains or grains[0].fields.get("type") != "recommendation":
            return ["no Recommendation grain heads it"]
        if grains[0].address != chain_id:
            problems.append(f"its Recommendation grain is {grains[0].address}")
        head = [grains[0].address]
    prev_grain: str | None = None
    prev_hash = chain_id
    for at, g in enumerate(grains[len(head):]):
        want = head + ([prev_grain] if prev_grain else [])
        if (g.fields.get("derived_from") or []) != want:
            problems.append(f"observation {at}: derived_from {g.fields.get('derived_from')} "
                            f"is not {want}")
        try:
            body = trailer_of(g.fields)
        except (NotExportable, ValueError) as exc:
            problems.append(f"observation {at}: {exc}")
            break
        if body.get("hash") != trailer_hash(body):
            problems.append(f"observation {at}: its trailer's hash does not re-derive")
        if body.get("prev") != prev_hash or body.get("proposal_id") != chain_id:
            problems.append(f"observation {at}: its trailer does not link to the one before")
        prev_grain, prev_hash = g.address, str(body.get("hash"))
    return problems
