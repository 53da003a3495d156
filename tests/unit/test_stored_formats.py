"""The values the daemon keeps in its buckets and streams (a dedup head, a rejection-ledger
entry, a refusal, a stream's sentinel) are Structs of the protocol now, and were dicts before:
what is stored stays byte for byte what was stored, and what an earlier version stored still
reads back as the same value. Anything that is no such value reads as none: these buckets are
hints anyone on the bus could write."""

from __future__ import annotations

import msgspec
import pytest

from improved.client.streams import decoded
from improved.protocol.model import DedupHead, LedgerEntry, Refusal, Sentinel, to_json
from improved.runtime.buckets import dedup_head_decoder, ledger_entry_decoder

PID = "ab" * 32

# each Struct as the daemon writes it now, beside the dict an earlier version wrote
STORED = [
    (DedupHead(proposal_id=PID, created_at=1_700_000_000_000),
     {"proposal_id": PID, "created_at": 1_700_000_000_000}),
    (LedgerEntry(proposal_id=PID, principal="operator:alice", reason="not like this",
                 at=1_700_000_000_001, evidence="cd" * 32),
     {"proposal_id": PID, "principal": "operator:alice", "reason": "not like this",
      "at": 1_700_000_000_001, "evidence": "cd" * 32}),
    (Refusal(subject="improve.proposals.svc", code="unknown_field", field="extra",
             message="unknown field `extra`", size=123, at=1_700_000_000_002),
     {"subject": "improve.proposals.svc", "code": "unknown_field", "field": "extra",
      "message": "unknown field `extra`", "size": 123, "at": 1_700_000_000_002}),
    (Refusal(subject="improve.proposals.svc", code="invalid_json", field=None,
             message="not JSON", size=3, at=1_700_000_000_003),
     {"subject": "improve.proposals.svc", "code": "invalid_json", "field": None,
      "message": "not JSON", "size": 3, "at": 1_700_000_000_003}),
    (Sentinel(sentinel="IMPROVE_TOOLS_SPENT", at=1_700_000_000_004),
     {"sentinel": "IMPROVE_TOOLS_SPENT", "at": 1_700_000_000_004}),
]


@pytest.mark.parametrize(("struct", "earlier"), STORED,
                         ids=[type(s).__name__ for s, _ in STORED])
def test_a_stored_value_is_byte_for_byte_what_an_earlier_version_stored(struct, earlier):
    assert to_json(struct) == to_json(earlier)
    assert msgspec.json.decode(to_json(earlier), type=type(struct)) == struct


@pytest.mark.parametrize("value", [
    None, b"", b"not json", b"[]", b'{"proposal_id": 5, "created_at": 1}',
    b'{"proposal_id": "x"}',
])
def test_a_dedup_head_that_is_no_head_reads_as_none(value):
    assert decoded(dedup_head_decoder, value) is None


def test_a_ledger_entry_that_is_no_entry_reads_as_none():
    assert decoded(ledger_entry_decoder, b'{"proposal_id": "x"}') is None
    assert decoded(ledger_entry_decoder, b"\xff") is None
    entry = STORED[1][0]
    assert decoded(ledger_entry_decoder, to_json(entry)) == entry
