"""W3C Trace Context's `traceparent` header (https://www.w3.org/TR/trace-context/), read and
written without OpenTelemetry: a proposal, a signal, an ApplyOrder and a measure request may
carry one as a NATS header, so a mesh service on the base install can pass its trace on and
the daemon can read one without the SDK. Whatever does not parse is no trace context at all:
ignored, never an error (a bad header must not cost a proposal).
"""

from __future__ import annotations

import re
from typing import NamedTuple

TRACEPARENT = "traceparent"  # the NATS header's name, as the W3C HTTP header's

# version-trace_id-parent_id-flags, lowercase hex; a later version may append `-<more>`
_FORM = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\Z",
                   re.DOTALL)
MAX_LENGTH = 512  # far above the 55 characters of version 00: anything longer is not one
SAMPLED = 0x01


class TraceParent(NamedTuple):
    """A parsed `traceparent`: the trace, the caller's span in it, and the trace flags."""

    trace_id: str  # 32 lowercase hex, not all zero
    span_id: str  # 16 lowercase hex, not all zero: the parent span
    flags: int = SAMPLED

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)


def parse(header: object) -> TraceParent | None:
    """The trace context a `traceparent` value names, or None when it is none: not a string,
    too long, not `00-<32 hex>-<16 hex>-<2 hex>` in lowercase, an all-zero id, version `ff`,
    or version 00 with anything after the flags. A later version is read by its first four
    fields, as the specification asks, when what follows them starts with `-`."""
    if not isinstance(header, str) or len(header) > MAX_LENGTH:
        return None
    found = _FORM.match(header.strip(" \t"))
    if found is None:
        return None
    version, trace_id, span_id, flags, rest = found.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return TraceParent(trace_id, span_id, int(flags, 16))


def format_traceparent(context: TraceParent) -> str:
    """`context` as a version-00 `traceparent` value."""
    return f"00-{context.trace_id}-{context.span_id}-{context.flags & 0xFF:02x}"


def of_headers(headers: dict[str, str] | None) -> str | None:
    """The raw `traceparent` of a message's headers, unparsed (None when absent): reading one
    key is all a message costs when nothing traces it."""
    return headers.get(TRACEPARENT) if headers else None
