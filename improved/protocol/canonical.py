"""OMS canonical encoding, content addresses, dedup keys and skill hashes.

Every identity in the daemon (grain addresses, recommendation dedup keys, skill hashes) is a
SHA-256 over bytes produced here, so the bytes must be exactly the OMS canonical form (OMS §4):
NFC strings, null-omitted maps, keys sorted by UTF-8 bytes, smallest int forms, float64 only.

Hot path: ``normalize`` (pure Python; validation plus NFC/None/tuple rewriting) followed by a
module-level ``msgspec.msgpack.Encoder(order="sorted")``. msgspec 0.23 was checked to emit the
canonical bytes for every normalized value: float64 (0xcb) for every float, the smallest
uint/int form for every int, fixstr/str8/16/32, bin8/16/32, and dict keys in code-point order,
which equals UTF-8 byte order. ``_reference_encode`` is a small pure-Python encoder written from
the spec; the tests assert both agree on arbitrary values and on the OMS vectors V1 and V6, so
a future msgspec change that breaks canonicality fails the suite instead of changing hashes.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
import unicodedata
from collections.abc import Sized
from typing import Any

import msgspec

__all__ = [
    "FACT",
    "FIELD_MAP",
    "INDEX_LAYER_FIELDS",
    "OBSERVATION",
    "RECOMMENDATION",
    "SKILL",
    "SKILL_DEFINITION_FIELDS",
    "TOOL",
    "CanonicalError",
    "GRAIN_ADDRESS_RE",
    "ANALYZER_ID_FORM",
    "analyzer_family",
    "analyzer_id_problem",
    "compact",
    "content_address",
    "dedup_key",
    "digest",
    "encode",
    "grain_blob",
    "normalize",
    "sha256_hex",
    "dependencies_problem",
    "skill_hash",
    "skill_identity",
]

# Header type bytes (OMS §3.1.1). Observation is 0x06 in the spec's type table (0x05 is Tool).
FACT = 0x01
OBSERVATION = 0x06
TOOL = 0x05  # a Tool definition grain, what a Skill's allowed_tools may name by address
SKILL = 0x0B
RECOMMENDATION = 0x0C
_TYPE_BYTES = {"fact": FACT, "observation": OBSERVATION, "tool": TOOL, "skill": SKILL,
               "recommendation": RECOMMENDATION}

_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1
_BOM = "\ufeff"


class CanonicalError(ValueError):
    """A value that has no canonical OMS encoding; ``code`` is the OMS error code."""

    def __init__(self, code: str, message: str, path: str = "$") -> None:
        super().__init__(f"{code} at {path}: {message}")
        self.code = code
        self.message = message
        self.path = path


def _key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if key.isidentifier() else f"{path}[{key!r}]"


def _nfc(s: str, path: str) -> str:
    if type(s) is not str:
        s = str.__str__(s)  # str subclasses (StrEnum) encode as their plain value
    if not s.isascii():
        s = unicodedata.normalize("NFC", s)
        if s.startswith(_BOM):
            raise CanonicalError("ERR_CORRUPT", "string starts with a byte-order mark", path)
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise CanonicalError("ERR_CORRUPT", "string is not valid UTF-8", path) from None
    return s


def normalize(obj: object, *, max_depth: int = 32) -> object:
    """Return a plain copy of ``obj`` in canonical shape, or raise CanonicalError.

    Maps drop None values (absent, per OMS §4.5); None inside lists is kept and encodes as nil.
    """
    return _norm(obj, "$", max_depth)


def _norm(obj: object, path: str, depth: int) -> object:
    if obj is None or obj is True or obj is False:
        return obj
    if isinstance(obj, str):
        return _nfc(obj, path)
    if isinstance(obj, int):
        if not _INT_MIN <= obj <= _INT_MAX:
            raise CanonicalError("ERR_RANGE", f"integer {obj} outside [-2**63, 2**64-1]", path)
        return int(obj)
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise CanonicalError("ERR_FLOAT_INVALID", f"non-finite float {obj!r}", path)
        return float(obj)
    if isinstance(obj, dict | list | tuple):
        if depth <= 0:
            raise CanonicalError("ERR_DEPTH", "nesting exceeds the depth limit", path)
        if isinstance(obj, dict):
            out: dict[str, object] = {}
            for k, v in obj.items():
                if not isinstance(k, str):
                    raise CanonicalError("ERR_TYPE", f"map key {k!r} is not a str", path)
                kpath = _key_path(path, k)
                nk = _nfc(k, kpath)
                if nk in out:
                    raise CanonicalError("ERR_CORRUPT", "duplicate key after NFC", kpath)
                if v is None:
                    out[nk] = None  # reserve the key so a later NFC twin is still detected
                    continue
                out[nk] = _norm(v, kpath, depth - 1)
            return {k: v for k, v in out.items() if v is not None}
        return [_norm(v, f"{path}[{i}]", depth - 1) for i, v in enumerate(obj)]
    if isinstance(obj, bytes | bytearray | memoryview):
        return bytes(obj)
    raise CanonicalError("ERR_TYPE", f"unsupported type {type(obj).__name__}", path)


_ENCODER = msgspec.msgpack.Encoder(order="sorted")


def encode(obj: object) -> bytes:
    """Canonical MessagePack bytes of ``normalize(obj)``.

    Most values (audit trailers above all) are already canonical: ASCII text, no None in maps,
    ints in range, finite floats. Those are encoded as they are, skipping the copy."""
    if _plain(obj, 32):
        return _ENCODER.encode(obj)
    return _ENCODER.encode(normalize(obj))


def _plain(obj: object, depth: int) -> bool:
    """True when normalize(obj) would return an equal value (so it need not run)."""
    # exact type tests, not isinstance: a subclass (a StrEnum, a bool) takes normalize's path
    if type(obj) is str:
        return obj.isascii()
    if type(obj) is int:
        return _INT_MIN <= obj <= _INT_MAX
    if type(obj) is bool:
        return True
    if type(obj) is dict:
        if depth <= 0:
            return False
        for k, v in obj.items():
            if type(k) is not str or not k.isascii():
                return False
            tv = type(v)  # scalars inline: this loop is the audit verifier's hot path
            if tv is str:
                if not v.isascii():
                    return False
            elif tv is int:
                if not _INT_MIN <= v <= _INT_MAX:
                    return False
            elif v is None or not _plain(v, depth - 1):
                return False
        return True
    if type(obj) is list:
        if depth <= 0:
            return False
        for v in obj:
            if type(v) is str:
                if not v.isascii():
                    return False
            elif v is not None and not _plain(v, depth - 1):
                return False
        return True
    if type(obj) is float:
        return math.isfinite(obj)
    return False


def _reference_encode(obj: object) -> bytes:
    """Spec-literal MessagePack encoder for already-normalized values (the msgspec oracle)."""
    if obj is None:
        return b"\xc0"
    if obj is True:
        return b"\xc3"
    if obj is False:
        return b"\xc2"
    if isinstance(obj, int):
        if 0 <= obj <= 0x7F:
            return bytes([obj])
        if -32 <= obj < 0:
            return struct.pack(">b", obj)
        if obj > 0:
            for lim, tag, fmt in ((0xFF, 0xCC, ">B"), (0xFFFF, 0xCD, ">H"),
                                  (0xFFFFFFFF, 0xCE, ">I"), (_INT_MAX, 0xCF, ">Q")):
                if obj <= lim:
                    return bytes([tag]) + struct.pack(fmt, obj)
        for lim, tag, fmt in ((-(2**7), 0xD0, ">b"), (-(2**15), 0xD1, ">h"),
                              (-(2**31), 0xD2, ">i"), (_INT_MIN, 0xD3, ">q")):
            if obj >= lim:
                return bytes([tag]) + struct.pack(fmt, obj)
        raise CanonicalError("ERR_RANGE", f"integer {obj} out of range")
    if isinstance(obj, float):
        return b"\xcb" + struct.pack(">d", obj)
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return _with_len(raw, 0xA0, 31, (0xD9, 0xDA, 0xDB)) + raw
    if isinstance(obj, bytes):
        return _with_len(obj, None, -1, (0xC4, 0xC5, 0xC6)) + obj
    if isinstance(obj, list):
        return _with_len(obj, 0x90, 15, (None, 0xDC, 0xDD)) + b"".join(
            _reference_encode(v) for v in obj)
    if isinstance(obj, dict):
        items = sorted(obj.items(), key=lambda kv: kv[0].encode("utf-8"))
        return _with_len(obj, 0x80, 15, (None, 0xDE, 0xDF)) + b"".join(
            _reference_encode(k) + _reference_encode(v) for k, v in items)
    raise CanonicalError("ERR_TYPE", f"unsupported type {type(obj).__name__}")


def _with_len(seq: Sized, fix: int | None, fix_max: int,
              tags: tuple[int | None, int | None, int | None]) -> bytes:
    n = len(seq)
    if fix is not None and n <= fix_max:
        return bytes([fix | n])
    for tag, lim, fmt in zip(tags, (0xFF, 0xFFFF, 0xFFFFFFFF), (">B", ">H", ">I"), strict=True):
        if tag is not None and n <= lim:
            return bytes([tag]) + struct.pack(fmt, n)
    raise CanonicalError("ERR_RANGE", f"length {n} too large")


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256 (OMS rejects uppercase addresses)."""
    return hashlib.sha256(data).hexdigest()


def digest(obj: object) -> str:
    return sha256_hex(encode(obj))


# Field compaction (OMS §6, App. C). One flat table: no grain type used here has clashing names.
FIELD_MAP: dict[str, str] = {
    # core §6.1
    "type": "t", "subject": "s", "relation": "r", "object": "o", "confidence": "c",
    "source_type": "st", "created_at": "ca", "temporal_type": "tt", "valid_from": "vf",
    "valid_to": "vt", "system_valid_from": "svf", "system_valid_to": "svt", "context": "ctx",
    "superseded_by": "sb", "contradicted": "ct", "importance": "im", "author_did": "adid",
    "namespace": "ns", "user_id": "user", "structural_tags": "tags", "derived_from": "df",
    "consolidation_level": "cl", "success_count": "sc", "failure_count": "fc",
    "provenance_chain": "pc", "origin_did": "odid", "origin_namespace": "ons",
    "content_refs": "cr", "embedding_refs": "er", "related_to": "rt",
    "invalidation_policy": "ip", "invalidation_type": "itype", "invalidation_reason": "ireason",
    "invalidation_initiator": "iinit", "license": "lic", "timestamp_ms": "tms",
    "verification_status": "vstatus", "rec_status": "rstat", "access_count": "ac",
    "last_accessed_at": "laa",
    # observation
    "observer_id": "oid", "observer_type": "otype",
    # skill §6.12
    "name": "skname", "description": "desc", "instructions": "instr", "when_to_use": "wtu",
    "version": "sver", "allowed_tools": "atls", "resources": "res", "dependencies": "deps",
    "input_modalities": "imod", "output_modalities": "omod", "domain": "dom",
    "holder_did": "hdid", "proficiency": "prof", "practice_count": "prcnt",
    "last_practiced_at": "lpa", "strategies": "strat", "transferable": "xfer",
    # recommendation §6.13
    "target_ref": "tref", "analyzer": "anlz", "summary": "summ", "dedup_key": "ddk",
    "proposal_cal": "pcal", "proposal_edit": "pedit", "proposal_data": "pdata",
    "severity": "sev", "metric_snapshot": "msnap", "evidence_query": "evq",
}
_NESTED_MAPS: dict[str, dict[str, str]] = {
    "content_refs": {"uri": "u", "modality": "m", "mime_type": "mt", "size_bytes": "sz",
                     "checksum": "ck", "metadata": "md"},
    "embedding_refs": {"vector_id": "vi", "model": "mo", "dimensions": "dm",
                       "modality_source": "ms", "distance_metric": "di", "chunk_index": "ci",
                       "chunk_text": "ct", "chunk_strategy": "cs", "chunk_overlap": "co"},
    "related_to": {"hash": "h", "relation_type": "rl", "weight": "w"},
}

INDEX_LAYER_FIELDS = frozenset({"superseded_by", "system_valid_to", "verification_status",
                                "rec_status", "access_count", "last_accessed_at"})
_INDEX_LAYER_KEYS = INDEX_LAYER_FIELDS | {FIELD_MAP[f] for f in INDEX_LAYER_FIELDS}


def _compact_map(d: dict[str, Any], table: dict[str, str], path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        short = table.get(k, k)
        if short in out:
            raise CanonicalError("ERR_CORRUPT", f"{k!r} collides with compacted key {short!r}",
                                 _key_path(path, str(k)))
        out[short] = v
    return out


def compact(grain: dict[str, Any]) -> dict[str, Any]:
    """Map full field names to OMS short keys; unknown keys stay verbatim.

    Nested compaction applies only inside content_refs, embedding_refs and related_to (§4.7).
    """
    out = _compact_map(grain, FIELD_MAP, "$")
    for field, table in _NESTED_MAPS.items():
        short = FIELD_MAP[field]
        refs = out.get(short)
        if isinstance(refs, list | tuple):
            out[short] = [_compact_map(r, table, f"$.{field}[{i}]") if isinstance(r, dict) else r
                          for i, r in enumerate(refs)]
    return out


def grain_blob(grain: dict[str, Any], type_byte: int) -> bytes:
    """9-byte OMS header + canonical payload (OMS §3.1, §4.9).

    flags are always 0x00 (unsigned, unencrypted, uncompressed, msgpack, public). ns_hash is the
    first 2 bytes of SHA-256(NFC namespace); the spec leaves the no-namespace case open, and we
    use 0x0000 there. Index-layer fields set to None count as absent (None is omitted anyway).
    """
    for key in _INDEX_LAYER_KEYS & grain.keys():
        if grain[key] is not None:
            raise CanonicalError("ERR_CORRUPT", "index-layer field must not be in the blob",
                                 f"$.{key}")
    if not isinstance(type_byte, int) or isinstance(type_byte, bool) or not 0 <= type_byte <= 255:
        raise CanonicalError("ERR_RANGE", f"type byte {type_byte!r} is not a uint8", "$")
    gtype = grain.get("type")
    if gtype in _TYPE_BYTES and _TYPE_BYTES[gtype] != type_byte:
        raise CanonicalError("ERR_CORRUPT", f"type {gtype!r} does not match byte "
                             f"0x{type_byte:02x}", "$.type")
    ns = grain.get("namespace")
    if ns is None:
        ns_hash = b"\x00\x00"
    elif isinstance(ns, str):
        ns_hash = hashlib.sha256(_nfc(ns, "$.namespace").encode("utf-8")).digest()[:2]
    else:
        raise CanonicalError("ERR_TYPE", "namespace must be a str", "$.namespace")
    created = grain.get("created_at")
    if not isinstance(created, int) or isinstance(created, bool):
        raise CanonicalError("ERR_TYPE", "created_at must be int epoch ms", "$.created_at")
    seconds = created // 1000
    if not 0 <= seconds <= 0xFFFFFFFF:
        raise CanonicalError("ERR_RANGE", f"created_at {created} does not fit uint32 seconds",
                             "$.created_at")
    header = bytes([0x01, 0x00, type_byte]) + ns_hash + struct.pack(">I", seconds)
    return header + encode(compact(grain))


def content_address(grain: dict[str, Any], type_byte: int) -> str:
    return sha256_hex(grain_blob(grain, type_byte))


def analyzer_family(analyzer_id: str) -> str:
    """Strip a trailing numeric ``/<major>`` so a major bump keeps the same dedup_key."""
    head, sep, major = analyzer_id.rpartition("/")
    return head if sep and major.isascii() and major.isdigit() else analyzer_id


# A versioned analyzer id (OMS Recommendation grain: "id is a versioned identifier in the form
# publisher.name/major"): dot-separated segments, at least publisher and name, none empty, then
# the major version as a plain decimal (no sign, no leading zero), so `x.y/1` and `x.y/01` can
# never be two spellings of one analyzer.
ANALYZER_ID_FORM = "publisher.name/major"
_SEGMENT = r"[A-Za-z0-9_-]+"
_ANALYZER_ID_RE = re.compile(rf"^{_SEGMENT}(?:\.{_SEGMENT})+/(?:0|[1-9][0-9]{{0,8}})\Z")


def analyzer_id_problem(analyzer_id: str) -> str | None:
    """Why `analyzer_id` is not a versioned analyzer id (`publisher.name/major`), in one line,
    or None. The family (`analyzer_family`) is what the dedup_key keeps across a major bump,
    so an id without its major, or without a publisher, has no stable family to keep."""
    if _ANALYZER_ID_RE.match(analyzer_id):
        return None
    shown = repr(analyzer_id)[:80]
    return (f"analyzer.id {shown} is not a versioned analyzer id: the form is "
            f"{ANALYZER_ID_FORM} (e.g. acme.tuner/1: publisher and name of letters, digits, "
            "_ and -, separated by dots, then / and the major version), as the OMS "
            "Recommendation grain defines it")


_ACTION_KINDS = frozenset({"cal", "edit", "data"})


def dedup_key(analyzer_id: str, target_ref: str, action_kind: str) -> str:
    """OMS §8.12 rule 5: family is case-folded then NFC; target_ref is NFC only (case kept)."""
    if action_kind not in _ACTION_KINDS:
        raise ValueError(f"action_kind must be one of cal/edit/data, got {action_kind!r}")
    family = unicodedata.normalize("NFC", analyzer_family(analyzer_id).casefold())
    target = unicodedata.normalize("NFC", target_ref)
    return sha256_hex(b"\x00".join(s.encode("utf-8") for s in (family, target, action_kind)))


SKILL_DEFINITION_FIELDS = ("name", "description", "instructions", "when_to_use", "version",
                           "allowed_tools", "resources", "dependencies", "input_modalities",
                           "output_modalities", "domain")


def skill_hash(skill: dict[str, Any]) -> str:
    """Hash of the definition only, so practice (competence, timestamps) never changes it."""
    definition = {k: skill[k] for k in SKILL_DEFINITION_FIELDS if k in skill}
    return digest(compact({"type": "skill", **definition}))


def skill_identity(skill: dict[str, Any]) -> str:
    name = skill.get("name")
    if not isinstance(name, str):
        raise CanonicalError("ERR_TYPE", "skill name must be a str", "$.name")
    return f"{name}:{skill_hash(skill)}"


# A grain's content address as a reference (oms.md §1.2: lowercase hex, 64 characters; uppercase
# MUST be rejected), bare or in the `mg:sha256:` form the Skill grain's examples use.
GRAIN_ADDRESS_RE = re.compile(r"^(?:mg:sha256:)?[0-9a-f]{64}\Z")


def dependencies_problem(skill: dict[str, Any]) -> tuple[str, str] | None:
    """(the field, why) when a skill's `dependencies` are not Skill grain addresses, else None.

    OMS Skill grain: "Each dependencies entry MUST be the content address of a Skill grain" —
    an address, never a name, so acquiring a skill resolves to exactly the grains it names."""
    deps = skill.get("dependencies")
    if deps is None:
        return None
    if not isinstance(deps, list):
        return "dependencies", "dependencies must be a list of Skill grain addresses"
    for i, dep in enumerate(deps):
        if not isinstance(dep, str) or not GRAIN_ADDRESS_RE.match(dep):
            shown = repr(dep)[:80]
            return (f"dependencies[{i}]", f"dependencies[{i}] = {shown} is not a Skill grain's "
                    "content address (mg:sha256:<64 lowercase hex>)")
    return None
