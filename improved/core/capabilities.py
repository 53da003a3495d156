"""What the daemon advertises on `improved.spec.get` (SPEC 07 §5 / SPEC 09 §9): the one place
its capabilities are written down, so the reply and the docs cannot drift apart."""

from __future__ import annotations

from typing import Any

from improved.core.signing import PAYLOAD_TYPES
from improved.protocol import subjects as S


def capabilities(quorum: bool = False) -> dict[str, Any]:
    """What `improved.spec.get` advertises (SPEC 07 §5 / SPEC 09 §9)."""
    return {
        "service": "improved",
        "spec": "cosmix SPEC 09 self-improve",
        "capabilities": {
            "<svc>.improve.propose": "Proposal, or a DSSE envelope of it signed by "
                                     "agent:<svc>:<name> or service:<svc> (payloadType "
                                     f"{PAYLOAD_TYPES['proposal']}) "
                                     "-> {proposal_id, status}",
            "<svc>.improve.triage": "{proposal_id} -> TriageDecision (idempotent)",
            "<svc>.improve.refine": "Signal -> {proposal_id, counted, independent}",
        },
        "topics": {
            "inbound": list(S.INBOUND_FILTERS),
            "retained": list(S.RECORD_FILTERS),
            "audit": S.AUDIT_FILTER,
        },
        "classes": ["L0", "L1", "L2", "L3", "L4"],
        "signed_acts": ["review", "grant", "vote", "crisis"],
        "quorum": quorum,
        "l4": {"lkg": "<svc>.improve.lkg", "revert_proposal_id": True,
               "constitution_edits": "prepared, never applied"},
    }
