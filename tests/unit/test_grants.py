"""The one rule of an L3 grant (core.authority.grant_covers), used by the daemon's gate, the
skills store's reads and a service's acceptance check alike."""

from __future__ import annotations

import pytest

from improved.core.authority import grant_covers
from improved.protocol.model import Grant

SKILL = "greet:" + "a" * 64
NOW = 1_700_000_000_000


def grant(**over) -> Grant:
    fields = dict(skill=SKILL, active=True, principal="operator:alice", reason="ok", at=NOW - 5)
    fields.update(over)
    return Grant(**fields)


@pytest.mark.parametrize(("g", "identity", "covers"), [
    (grant(), SKILL, True),
    (grant(expires_at=NOW + 1), SKILL, True),
    (grant(expires_at=NOW), SKILL, False),  # lapses at its expiry instant
    (grant(active=False), SKILL, False),  # revoked
    (grant(), "greet:" + "b" * 64, False),  # another hash of the same name
    (grant(), "greet", False),  # never by name
], ids=["active", "not yet expired", "expired", "revoked", "other hash", "bare name"])
def test_a_grant_covers_exactly_its_hash_while_active_and_unexpired(g, identity, covers):
    assert grant_covers(g, identity, NOW) is covers
