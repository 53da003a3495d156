"""Schema changes end to end through the real bus (SPEC 09 §7.4): the daemon, the reference
artefact store owning a JSON Schema, and signed operator acts. Forward-compatible applies on
its approval, backward is refused, breaking waits for the operator, a change without its
revert — or with a revert to a schema the owner does not hold — never reaches the store, and a
quorum cannot wave a breaking change through. The class the store found is on the `applied`
trailer and in the ApplyOutcome, and an operator sees it in `improved review` and `show` before
approving."""

from __future__ import annotations

import asyncio
import json

import pytest

from improved.client.sdk import MeshClient
from improved.core import authority
from improved.core.signing import PAYLOAD_TYPES, sign
from improved.protocol import subjects as S
from improved.protocol.model import Proposal, Review, Summary, to_json
from tests.bus import eventually, outcome, publish, quorum_reads, started, trailers
from tests.cli import improved
from tests.factories import now_ms, sha, swap, vote
from tests.keys import ALICE

pytestmark = pytest.mark.asyncio(loop_scope="session")

ORDERS = {"type": "object", "properties": {"sku": {"type": "string"},
                                           "qty": {"type": "integer", "maximum": 100}},
          "required": ["sku"], "additionalProperties": False}


def text(schema: dict) -> str:
    return json.dumps(schema, sort_keys=True)


def with_qty(**qty) -> dict:
    return {**ORDERS, "properties": {**ORDERS["properties"], "qty": qty}}


def schema_change(svc: str, schema: dict, base: dict | None = ORDERS, **over) -> Proposal:
    """`orders` made `schema`, with the revert that restores `base` (None: no revert)."""
    p = swap(svc, {"orders": text(schema)}, smoke={"orders": "json_schema"})
    revert = None if base is None else {"restore": {"orders": sha(text(base))}}
    fields = {"target_ref": f"schema:{svc}", "revert": revert, **over}
    return Proposal(**{**{f: getattr(p, f) for f in p.__struct_fields__}, **fields})


def approval(pid: str, p: Proposal):
    """ALICE's signed approval of what will run: the body, its last-known-good and its revert."""
    body = Review(proposal_id=pid, verdict="approve", principal=ALICE[0], reason="read it",
                  at=now_ms(), body_digest=authority.will_run_digest(p))
    return sign(PAYLOAD_TYPES["review"], to_json(body), ALICE[1])


async def proposed(nc, svc: str, p: Proposal):
    store = await started(nc, svc, {"orders": text(ORDERS)})
    client = MeshClient(nc, svc)
    pid = await client.publish(p)
    decision = await eventually(lambda: client.decision(pid))
    return store, client, pid, decision


async def approved_outcome(nc, client, svc, pid, p):
    await publish(nc, S.inbound_review(svc), approval(pid, p))
    return await outcome(client, pid)


async def held(store) -> dict:
    return json.loads(await store.content("orders"))


async def applied_refs(daemon, svc: str, pid: str) -> list[str]:
    """The refs of the proposal's `applied` trailer."""
    [applied] = [t for t in await trailers(daemon, svc, pid) if t.get("verdict") == "applied"]
    return applied["refs"]


def cli(*args: str):
    return asyncio.to_thread(improved, *args)


def item(review_out: str, pid: str) -> str:
    """One proposal's lines of `improved review`'s text (the queue is the session's)."""
    return review_out.split(pid, 1)[1].split("decide:", 1)[0]


async def test_a_forward_compatible_change_applies_on_its_approval_with_its_revert_recorded(
        daemon, nc, svc):
    wider = with_qty(type="integer", maximum=1000)
    p = schema_change(svc, wider)
    store, client, pid, decision = await proposed(nc, svc, p)
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_operator")
    out = await approved_outcome(nc, client, svc, pid, p)
    assert out.ok, out.error
    assert await held(store) == wider
    assert out.schema_class == "forward"
    assert "schema_class:forward" in await applied_refs(daemon, svc, pid)
    record = await daemon.engine.records.truth(svc, pid)
    assert record.revert_id == out.revert_proposal_id
    assert record.outcome.schema_class == "forward"
    assert record.revert.proposal_data == {"restore": {"orders": sha(text(ORDERS))}}
    await store.stop()


async def test_a_backward_change_is_refused_though_approved(daemon, nc, svc):
    p = schema_change(svc, with_qty(type="integer", maximum=10))
    store, client, pid, _ = await proposed(nc, svc, p)
    out = await approved_outcome(nc, client, svc, pid, p)
    assert out.ok is False
    assert out.error.startswith("schema_backward: orders at /properties/qty/maximum: lowered "
                                "to 10 (was maximum 100)")
    assert await held(store) == ORDERS
    assert [t.get("verdict") for t in await trailers(daemon, svc, pid)][-1] == "failed"
    await store.stop()


async def test_a_breaking_change_waits_for_the_operator_then_applies_on_the_signed_approval(
        daemon, nc, svc):
    retyped = with_qty(type="string")
    p = schema_change(svc, retyped)
    store, client, pid, decision = await proposed(nc, svc, p)
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_operator")
    await asyncio.sleep(0.3)
    assert store.orders == 0 and await client.outcome(pid) is None
    assert (await client.state(pid)).status == "pending"
    out = await approved_outcome(nc, client, svc, pid, p)
    assert out.ok, out.error
    assert out.authority == ALICE[0]
    assert out.schema_class == "breaking"
    assert "schema_class:breaking" in await applied_refs(daemon, svc, pid)
    assert await held(store) == retyped
    await store.stop()


async def test_the_operator_sees_the_class_of_a_pending_schema_change_before_approving(
        daemon, nc, svc, nats_url):
    """`improved review` and `improved show` ask the owning store; its class and reason are
    printed, its hostile text inert; a silent store is one line, and nothing else changes."""
    retyped = with_qty(type="string", description="\x1b[2J\r\u202eevil")
    p = schema_change(svc, retyped)
    store, client, pid, decision = await proposed(nc, svc, p)
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_operator")
    shown = await cli("review", "--nats", nats_url)
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and "\u202e" not in shown.stdout
    mine = item(shown.stdout, pid)
    # no key is trusted for the store here: its class is shown as nobody's word
    nobodys = "; unverified: unsigned, and the bus binds no service to its subjects"
    assert ("  schema class: breaking (orders at /properties/qty/type: no longer admits "
            "integer)" + nobodys) in mine.splitlines()
    one = await cli("show", pid, "--format", "text", "--nats", nats_url)
    assert one.returncode == 0, one.stderr
    assert one.stdout.splitlines()[4].startswith("  schema class: breaking (orders at ")
    listed = await cli("review", "--format", "json", "--nats", nats_url)
    [row] = [r for r in json.loads(listed.stdout) if r["proposal_id"] == pid]
    assert row["schema_class"]["class"] == "breaking"

    await store.stop()  # silence: the class is unknown, and the rest is as it was
    silent = await cli("review", "--nats", nats_url)
    assert silent.returncode == 0, silent.stderr
    quiet = item(silent.stdout, pid)
    assert "  schema class: unknown (service did not answer)" in quiet.splitlines()
    assert quiet.replace("unknown (service did not answer)", "") == mine.replace(
        "breaking (orders at /properties/qty/type: no longer admits integer)" + nobodys, "")
    assert (await client.state(pid)).status == "pending"


async def test_a_change_without_its_revert_is_refused_at_triage(daemon, nc, svc):
    p = schema_change(svc, with_qty(type="integer", maximum=1000), base=None)
    store, client, pid, decision = await proposed(nc, svc, p)
    assert (decision.verdict, decision.cause) == ("reject", "invalid")
    assert "schema_revert: a schema change carries its backward-compatible revert" in \
        decision.rationale
    assert (await client.state(pid)).status == "rejected"
    assert store.orders == 0 and await held(store) == ORDERS
    await store.stop()


async def test_a_revert_to_a_schema_the_owner_does_not_hold_never_reaches_the_store(
        daemon, nc, svc):
    """The proposer claims a base under which its breaking change would look forward-compatible;
    the daemon checks the claim against the owner's last-known-good and sends no order."""
    claimed = with_qty(type="string", maxLength=4)
    p = schema_change(svc, with_qty(type="string"), base=claimed,
                      summary=Summary(template_id="schema_change", args={"compat": "forward"}))
    store, client, pid, _ = await proposed(nc, svc, p)
    out = await approved_outcome(nc, client, svc, pid, p)
    assert out.ok is False and out.error.startswith(
        f"lkg: schema_base: the revert restores orders to {sha(text(claimed))}, but the "
        f"current schema is {sha(text(ORDERS))}")
    assert store.orders == 0 and await held(store) == ORDERS
    await store.stop()


async def test_a_quorum_cannot_apply_a_breaking_change_claimed_forward_compatible(
        quorum_daemon):
    nc, daemon = quorum_daemon
    svc = "qschema"
    p = schema_change(svc, with_qty(type="string"),
                      summary=Summary(template_id="schema_change", args={"compat": "forward"}))
    store, client, pid, decision = await proposed(nc, svc, p)
    assert (decision.verdict, decision.cause) == ("defer", "awaiting_quorum")
    reads = await quorum_reads(daemon, svc, pid)
    for voter, session in (("agent-a", "s1"), ("agent-b", "s2"), ("agent-c", "s3")):
        await publish(nc, S.QUORUM, vote(reads, voter, session))
    out = await outcome(client, pid)
    assert out.ok is False and out.authority.startswith("quorum:")
    assert out.error.startswith("schema_breaking: orders at /properties/qty/type: no longer "
                                "admits integer; a breaking change needs an operator's own "
                                "signed approval")
    assert await held(store) == ORDERS
    await store.stop()
