"""Decoding inbound bytes into wire Structs, and the error reply of DESIGN §3.1.

Every way a message can be bad ends as a `WireError(code, message, field)`; nothing else escapes,
so a handler can answer `{"error": {...}}` and go on serving.
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from improved.protocol.model import ErrorBody, ErrorReply, to_json

T = TypeVar("T")

# Error codes a client can branch on (docs/protocol.md lists them with their meaning).
INVALID_JSON = "invalid_json"
INVALID_TYPE = "invalid_type"
INVALID_VALUE = "invalid_value"
MISSING_FIELD = "missing_field"
UNKNOWN_FIELD = "unknown_field"
STATUS_FORBIDDEN = "status_forbidden"
TOO_LARGE = "too_large"
TOO_DEEP = "too_deep"
BODY_COUNT = "body_count"
SUBJECT_MISMATCH = "subject_mismatch"
NOT_FOUND = "not_found"
NO_SURFACE = "no_surface"  # the service advertises `"improve": false`: it takes no proposals
CHAIN_BROKEN = "chain_broken"  # the proposal's chain does not verify: a crisis is open
INTERNAL = "internal"
NOT_ATTESTED = "not_attested"  # a service's report that is not attributable to that service
# a signed proposal that does not verify (docs/protocol.md "Identity"); it changes nothing
BAD_SIGNATURE = "bad_signature"  # no signature, or one that does not match the payload
UNKNOWN_SIGNER = "unknown_signer"  # signed by no key in [trust.signers]
SIGNER_MISMATCH = "signer_mismatch"  # a trusted key, but not an agent of the subject's service

# Refusals of a `schema:` change (SPEC 09 §7.4), each the start of an ApplyResult's or an
# ApplyOutcome's `error` (`<code>: <pointer>: <what changed>`), and of triage's rationale.
SCHEMA_REVERT = "schema_revert"  # no backward-compatible revert travels with the change
SCHEMA_BASE = "schema_base"  # the revert does not restore the schema the owner holds now
SCHEMA_INVALID = "schema_invalid"  # the proposed (or current) content is not a JSON Schema
SCHEMA_BACKWARD = "schema_backward"  # the change only takes away: refused, whoever approved
SCHEMA_BREAKING = "schema_breaking"  # breaking, and not approved by an operator's own act

DERIVED_FIELDS = frozenset({"status", "rec_status"})


class WireError(Exception):
    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field

    def reply(self) -> bytes:
        return to_json(ErrorReply(error=ErrorBody(code=self.code, message=self.message,
                                                  field=self.field)))

    def __repr__(self) -> str:
        return f"WireError({self.code!r}, {self.message!r}, field={self.field!r})"


_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_NAMED = re.compile(r"(missing required|contains unknown) field `(?P<name>[^`]+)`")


def _field(path: str, name: str | None = None) -> str | None:
    """`$.origin` + `actor` → `origin.actor`; the root is None."""
    path = path.lstrip(".")
    if name:
        path = f"{path}.{name}" if path else name
    return path or None


def from_validation(exc: msgspec.ValidationError) -> WireError:
    text = str(exc)
    at = _AT.search(text)
    path = at.group("path") if at else ""
    what = text[: at.start()] if at else text
    named = _NAMED.search(what)
    if named and named.group(1) == "missing required":
        name = named.group("name")
        return WireError(MISSING_FIELD, f"missing required field `{_field(path, name)}`",
                         _field(path, name))
    if named:
        field = _field(path, named.group("name"))
        if named.group("name") in DERIVED_FIELDS and not path:
            return WireError(STATUS_FORBIDDEN, f"`{field}` is derived from the audit chain and "
                             "can never be set by a message", field)
        return WireError(UNKNOWN_FIELD, f"unknown field `{field}`", field)
    code = INVALID_TYPE if what.startswith("Expected `") and ", got `" in what else INVALID_VALUE
    field = _field(path)
    return WireError(code, f"{what}" + (f" at `{field}`" if field else ""), field)


def decode(data: bytes, type_: type[T], limit: int) -> T:
    """JSON bytes → a validated Struct, or a WireError naming the problem."""
    if len(data) > limit:
        raise WireError(TOO_LARGE, f"message is {len(data)} bytes; the limit is {limit}")
    try:
        return msgspec.json.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from None
    except msgspec.DecodeError as exc:
        raise WireError(INVALID_JSON, f"malformed JSON: {exc}") from None
    except RecursionError:
        raise WireError(TOO_DEEP, "message nests too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(INVALID_JSON, f"not valid UTF-8 JSON: {exc}") from None
