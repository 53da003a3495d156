"""Streams that must not forget (`improved.core.retention`): what a stream's info must show for
a runtime to rely on the marks it holds, and a runtime that refuses what relies on a ledger
that cannot vouch for them. The same over a real nats-server, with the attacks, is in
tests/integration/test_tool_ledger.py."""

from __future__ import annotations

import pytest

from improved.core import retention
from improved.core.retention import Known, Seen
from improved.core.tools import (
    LEDGER_STREAMS,
    Decision,
    Ledgered,
    LedgerUntrusted,
    call_draft,
    ledger_draft,
    ledger_of,
    recorded_ledger,
    upgrade_id,
)
from improved.core.trailers import decode
from improved.protocol import subjects as S
from improved_reference.tool_gate import ProcessLedger
from tests.keys import ALICE
from tests.tool_surfaces import ARGS, NOW, gate, grant, proof, runtime, upgrade

MADE = "2026-01-15T10:00:00.123456+00:00"


def seen(first: int, last: int, messages: int, *, created: str = MADE,
         differs: tuple[str, ...] = ()) -> Seen:
    return Seen("S", created, first, last, messages, differs)


KEEPS = Known("S", "keeps", MADE, 0)
EXPIRES = Known("S", "expires", MADE, 1)


def test_a_stream_that_keeps_everything_vouches_while_it_holds_all_it_was_given():
    assert retention.problem(KEEPS, seen(0, 0, 0)) is None  # made, nothing written yet
    assert retention.problem(KEEPS, seen(1, 7, 7)) is None
    # one removed anywhere: the oldest (a limit), one inside (a per-subject limit), all
    for state in (seen(2, 7, 6), seen(1, 7, 6), seen(8, 7, 0)):
        found = retention.problem(KEEPS, state)
        assert found is not None and "were removed since it was trusted" in found, state
    assert "holds 6 of the 7 messages written to it: 1 were" in retention.problem(
        KEEPS, seen(1, 7, 6))


def test_a_loss_an_operator_accepted_is_not_named_again_and_a_new_one_is():
    known = retention.accepted("keeps", seen(1, 7, 6))
    assert known.mark == 1 and retention.problem(known, seen(1, 9, 8)) is None
    assert retention.problem(known, seen(1, 9, 7)) is not None


def test_a_stream_whose_messages_expire_vouches_while_it_holds_its_sentinel():
    assert retention.problem(EXPIRES, seen(1, 9, 3)) is None  # marks gone by their TTLs
    later = Known("S", "expires", MADE, 5)  # a sentinel written into an older stream
    assert retention.problem(later, seen(3, 9, 5)) is None  # marks before it still leaving
    assert retention.problem(later, seen(5, 9, 2)) is None
    for state, now in ((seen(2, 9, 3), "its first message is now 2"),
                       (seen(10, 9, 0), "it holds nothing")):
        assert retention.problem(EXPIRES, state) == (
            f"stream S no longer holds its sentinel (sequence 1; {now}): a limit removed "
            "its oldest messages, so what it held after the sentinel may be gone")


def test_another_incarnation_is_named_first_then_a_setting_that_removes_messages():
    again = seen(1, 1, 1, created="2026-01-15T11:00:00+00:00", differs=("max_age",))
    for known in (KEEPS, EXPIRES):
        found = retention.problem(known, again)
        assert found.startswith("stream S is not the one this runtime knows: it was made at "
                                "2026-01-15T11:00:00+00:00, the one known was made at "
                                f"{MADE}"), found
        assert retention.problem(known, seen(1, 1, 1, differs=("max_age", "discard"))) == (
            "stream S differs from what it must be (max_age, discard): set that way it "
            "removes messages, so it cannot vouch for what it holds")


def test_what_a_runtime_trusts_reads_back_from_its_refs():
    known = {S.STREAM_TOOLS_SPENT: Known(S.STREAM_TOOLS_SPENT, "expires", MADE, 1),
             S.STREAM_TOOLS_REVOKED: Known(S.STREAM_TOOLS_REVOKED, "keeps", MADE, 0),
             S.STREAM_TOOLS_AUDIT: Known(S.STREAM_TOOLS_AUDIT, "keeps", MADE, 2)}
    draft = ledger_draft("rt", known, "seen")
    assert draft.refs == ("runtime:rt", f"spent_stream:{MADE} sentinel=1",
                          f"revoked_stream:{MADE} lost=0", f"audit_stream:{MADE} lost=2")
    assert recorded_ledger(decode(draft)) == recorded_ledger(ledger_of(known)) == known
    # a ref of another kind, or none, names nothing
    assert recorded_ledger(Ledgered(spent_stream=f"{MADE} lost=0", revoked_stream="x",
                                    audit_stream=f"{MADE} lost=two")) == {}
    assert set(LEDGER_STREAMS) == set(known)


def test_every_trailer_names_the_streams_its_runtime_trusts():
    known = {S.STREAM_TOOLS_SPENT: Known(S.STREAM_TOOLS_SPENT, "expires", MADE, 1)}
    draft = ledger_draft("agent", known, "seen for the first time")
    assert draft.verdict == "ledger" and draft.actor == "agent"
    assert draft.refs == ("runtime:agent", f"spent_stream:{MADE} sentinel=1")
    assert draft.reason == "runtime agent trusts its ledger: seen for the first time"
    _, kit = runtime()
    decision = Decision("read", {}, kit["read"][0], via="mounted")
    assert f"spent_stream:{MADE} sentinel=1" in call_draft("agent", decision, known).refs
    assert not any(r.startswith("spent_stream:") for r in call_draft("agent", decision).refs)


class Untrusted(ProcessLedger):
    """A ledger that cannot vouch for what it kept (`spend`, `revoked`, or both)."""

    def __init__(self, spend: bool = True, revoked: bool = True):
        super().__init__()
        self.fail_spend, self.fail_revoked = spend, revoked

    async def spend(self, act: str, until: int, now: int) -> bool:
        if self.fail_spend:
            raise LedgerUntrusted("stream IMPROVE_TOOLS_SPENT was made again")
        return await super().spend(act, until, now)

    async def revoked(self, upgrade: str) -> bool:
        if self.fail_revoked:
            raise LedgerUntrusted("stream IMPROVE_TOOLS_REVOKED lost 1")
        return await super().revoked(upgrade)


@pytest.mark.parametrize("spend, revoked, reason", [
    (True, True, "stream IMPROVE_TOOLS_REVOKED lost 1"),  # the upgrade's revocation first
    (True, False, "stream IMPROVE_TOOLS_SPENT was made again"),  # then the proof's spend
])
async def test_an_upgraded_call_on_a_ledger_that_cannot_vouch_is_refused(spend, revoked,
                                                                         reason):
    rt, kit = gate(ledger=Untrusted(spend, revoked))
    env = upgrade(now=NOW)
    reply = await rt.invoke("deploy", ARGS, None, NOW, session="s-1", upgrade=env,
                            proof=proof(env, "deploy", ARGS, now=NOW))
    assert reply["refused"] == {"reason": "ledger_untrusted", "required": "L4",
                                "detail": reason}
    assert kit["deploy"][1].calls == []


async def test_a_granted_call_on_a_ledger_that_cannot_vouch_is_refused_and_spends_nothing():
    ledger = Untrusted()
    rt, kit = gate(ledger=ledger)
    reply = await rt.invoke("deploy", ARGS, grant(kit["deploy"][0], now=NOW), NOW)
    assert reply["refused"]["reason"] == "ledger_untrusted"
    assert kit["deploy"][1].calls == [] and ledger.spent == {}
    assert (await rt.invoke("read", ARGS, None, NOW))["ok"] is True  # relies on no mark


async def test_an_upgrade_the_ledger_cannot_clear_falls_back_to_a_grant_sent_alongside():
    """Only the revocations cannot vouch: a grant sent with the upgrade relies on the spent
    marks alone, and runs once."""
    rt, kit = gate(ledger=Untrusted(spend=False, revoked=True))
    env = upgrade(now=NOW)
    request = dict(session="s-1", upgrade=env, proof=proof(env, "deploy", ARGS, now=NOW))
    assert (await rt.invoke("deploy", ARGS, grant(kit["deploy"][0], now=NOW), NOW,
                            **request))["granted_by"] == ALICE[0]
    assert kit["deploy"][1].calls == [ARGS]
    assert upgrade_id(env) not in rt.ledger.revocations
