"""Schema discipline in the owning service (SPEC 09 §7.4): the artefact store classifies a
`schema:` change against the schema it holds, not the one the proposer claims. Orders are sent
by hand, their acceptance trailers appended as in test_artefact_store (a server of this
module's own)."""

from __future__ import annotations

import json

import msgspec
import pytest_asyncio

from improved.cli import render
from improved.cli.queries import classified, schema_class
from improved.core.lkg import REVERT_ANALYZER
from improved.protocol import subjects as S
from improved.protocol.model import AnalyzerRef, Summary
from improved_reference.artefact_store import digest_of
from tests.bus import send
from tests.integration.test_artefact_store import (  # noqa: F401  (fixtures)
    OPERATOR,
    append,
    approved,
    l4,
    manifest_rev,
    module_server,
    nc,
    order,
    serving,
)

ORDERS = {"type": "object", "properties": {"sku": {"type": "string"},
                                           "qty": {"type": "integer", "maximum": 100}},
          "required": ["sku"], "additionalProperties": False}
QUORUM = "quorum:0123456789abcdef"


def text(schema: dict) -> str:
    return json.dumps(schema, sort_keys=True)


def with_qty(**qty) -> dict:
    return {**ORDERS, "properties": {**ORDERS["properties"], "qty": qty}}


WIDER = with_qty(type="integer", maximum=1000)  # forward-compatible
NARROWER = with_qty(type="integer", maximum=10)  # backward: only takes away
RETYPED = with_qty(type="string")  # breaking


def change(svc: str, schema: dict, base: dict | None = ORDERS, **over):
    """A proposal to make `orders` `schema`, whose revert restores `base` (None: no revert)."""
    content = text(schema)
    revert = None if base is None else {"restore": {"orders": digest_of(text(base).encode())}}
    return l4(svc, {"artefacts": {"orders": content}},
              [{"artefact": "orders", "digest": digest_of(content.encode()),
                "smoke_test": "json_schema"}],
              target_ref=f"schema:{svc}", revert=revert, **over)


@pytest_asyncio.fixture(loop_scope="session")
async def store(nc, svc):  # noqa: F811
    async with serving(nc, svc, {"orders": text(ORDERS)}) as s:
        yield s


async def held(store) -> dict:
    return json.loads(await store.content("orders"))


# -- the attack first: a proposer's claims decide nothing ----------------------------------------


async def test_a_breaking_change_claimed_forward_compatible_never_applies_without_the_operator(
        nc, svc, store):  # noqa: F811
    """The proposer says the change is forward-compatible and names as its base a schema under
    which it would be (qty already a string). Neither claim is believed."""
    js = nc.jetstream()
    claimed_base = with_qty(type="string", maxLength=4)
    lie = change(svc, RETYPED, base=claimed_base,
                 summary=Summary(template_id="schema_change", args={"compat": "forward"}))
    rev = await manifest_rev(store)
    result, _ = await send(nc, svc, await approved(js, order(lie, QUORUM), ("quorum", QUORUM)))
    assert not result.ok and result.error.startswith(
        "schema_base: the revert restores orders to sha256:")
    # the same change with its true base: classified against the store's head, breaking, and
    # a quorum is not the operator
    honest_base = change(svc, RETYPED,
                         summary=Summary(template_id="schema_change", args={"compat": "forward"}))
    result, _ = await send(nc, svc, await approved(js, order(honest_base, QUORUM),
                                                   ("quorum", QUORUM)))
    assert not result.ok
    assert result.error.startswith("schema_breaking: orders at /properties/qty/type: no longer "
                                   "admits integer; a breaking change needs an operator's own "
                                   f"signed approval ({QUORUM} is not an operator)")
    assert await held(store) == ORDERS and await manifest_rev(store) == rev
    # the operator's own approval is what a breaking change rests on
    await append(js, svc, order(honest_base).proposal_id, ("approve", OPERATOR))
    result, _ = await send(nc, svc, order(honest_base))
    assert result.ok, result.error
    assert result.schema_class == "breaking"  # the class found, answered for the chain
    again, _ = await send(nc, svc, order(honest_base))  # a repeated order: the ledger's answer
    assert again == result
    assert await held(store) == RETYPED
    ledger = json.loads((await store.ledger.get(order(honest_base).proposal_id)).value)
    assert ledger["schema"] == {"class": "breaking", "reasons": {
        "orders": "/properties/qty/type: no longer admits integer"}}


async def test_forward_compatible_applies_on_its_approval_and_backward_is_refused_whoever(
        nc, svc, store):  # noqa: F811
    js = nc.jetstream()
    rev = await manifest_rev(store)
    narrower = change(svc, NARROWER)
    result, _ = await send(nc, svc, await approved(js, order(narrower)))
    assert not result.ok and result.error.startswith(
        "schema_backward: orders at /properties/qty/maximum: lowered to 10 (was maximum 100); "
        "a change that only takes away is refused whoever approved it")
    assert await manifest_rev(store) == rev

    wider = change(svc, WIDER)
    result, _ = await send(nc, svc, await approved(js, order(wider, QUORUM), ("quorum", QUORUM)))
    assert result.ok, result.error
    assert result.schema_class == "forward"
    assert await held(store) == WIDER
    assert result.inverse == {"restore": {"orders": digest_of(text(ORDERS).encode())}}

    # its recorded reversal goes back although going back only takes away
    back = l4(svc, result.inverse, None, target_ref=f"schema:{svc}",
              analyzer=AnalyzerRef(id=REVERT_ANALYZER),
              derived_from=[f"mg:sha256:{order(wider).proposal_id}"])
    result, _ = await send(nc, svc, await approved(js, order(back)))
    assert result.ok, result.error
    assert result.schema_class == "reversal"
    assert await held(store) == ORDERS

    # any other restore to the wider schema is a change like another, with its revert
    again = l4(svc, {"restore": {"orders": digest_of(text(WIDER).encode())}}, None,
               target_ref=f"schema:{svc}")
    result, _ = await send(nc, svc, await approved(js, order(again)))
    assert not result.ok and result.error.startswith("schema_revert: ")


async def test_a_missing_revert_or_content_that_is_no_schema_is_refused(nc, svc, store):  # noqa: F811
    js = nc.jetstream()
    rev = await manifest_rev(store)
    result, _ = await send(nc, svc, await approved(js, order(change(svc, WIDER, base=None))))
    assert not result.ok and result.error.startswith(
        "schema_revert: a schema change carries its backward-compatible revert")
    bad = change(svc, WIDER)
    bad.proposal_data["artefacts"]["orders"] = "[1, 2]"
    bad.lkg[0]["digest"] = digest_of(b"[1, 2]")
    bad.lkg[0]["smoke_test"] = "json"
    result, _ = await send(nc, svc, await approved(js, order(bad)))
    assert not result.ok and result.error.startswith(
        "schema_invalid: orders: the proposed schema is not a JSON Schema")
    assert await held(store) == ORDERS and await manifest_rev(store) == rev


# -- the class of a pending change, asked before an operator approves ----------------------------

UNSIGNED = "unsigned, and the bus binds no service to its subjects"


async def test_the_store_classifies_a_pending_change_against_its_head_and_changes_nothing(
        nc, svc, store):  # noqa: F811
    rev = await manifest_rev(store)
    # no key is trusted for the store here: its class is shown, as nobody's word
    assert await schema_class(nc, change(svc, WIDER)) == {
        "class": "forward",
        "reason": "orders: every instance valid under the current schema stays valid",
        "unverified": UNSIGNED}
    assert await schema_class(nc, change(svc, NARROWER)) == {
        "class": "backward",
        "reason": "orders at /properties/qty/maximum: lowered to 10 (was maximum 100)",
        "unverified": UNSIGNED}
    # the proposer's claims (a base, a class) are not read: the store's head decides
    lie = change(svc, RETYPED, base=with_qty(type="string", maxLength=4),
                 summary=Summary(template_id="schema_change", args={"compat": "forward"}))
    assert await schema_class(nc, lie) == {
        "class": "breaking", "reason": "orders at /properties/qty/type: no longer admits integer",
        "unverified": UNSIGNED}
    assert await manifest_rev(store) == rev and await held(store) == ORDERS
    assert store.orders == 0  # a classification is no apply


async def test_a_pending_reversal_is_classified_as_the_apply_will_record_it(
        nc, svc, store):  # noqa: F811
    """The recorded way back of an applied change only takes away, yet it is no `backward`
    change: classify says `reversal`, as the apply's `schema_class` will."""
    js = nc.jetstream()
    wider = change(svc, WIDER)
    result, _ = await send(nc, svc, await approved(js, order(wider)))
    assert result.ok, result.error
    back = l4(svc, result.inverse, None, target_ref=f"schema:{svc}",
              analyzer=AnalyzerRef(id=REVERT_ANALYZER),
              derived_from=[f"mg:sha256:{order(wider).proposal_id}"])
    found = await schema_class(nc, back)
    assert found is not None and found["class"] == "reversal", found
    assert found["reason"].startswith(
        f"orders: the recorded reversal of {order(wider).proposal_id[:12]}")
    assert await held(store) == WIDER  # asked, not applied
    result, _ = await send(nc, svc, await approved(js, order(back)))
    assert result.ok and result.schema_class == found["class"]


async def test_a_bad_classify_request_is_one_line_and_the_cli_never_breaks_on_it(
        nc, svc, store):  # noqa: F811
    subject = S.classify_request(svc)
    for body in (b"not json", b"{}", b'{"proposal": {"service": "x"}}'):
        reply = msgspec.json.decode((await nc.request(subject, body, timeout=5)).data)
        assert reply["error"]["code"] == "invalid_value"
        assert "\n" not in reply["error"]["message"]
    wider = change(svc, WIDER)
    not_schema = msgspec.structs.replace(wider, target_ref=f"binary:{svc}")
    found = await schema_class(nc, msgspec.structs.replace(wider, proposal_data={"nope": 1}))
    assert found["class"] == "unknown" and found["reason"].startswith(
        "the service could not classify it: proposal_data must be")
    assert await schema_class(nc, not_schema) is None  # not a schema change: nothing asked
    assert await schema_class(nc, change(f"{svc}-nobody", WIDER)) == {
        "class": "unknown", "reason": "service did not answer"}


async def test_a_hostile_name_in_the_schema_reaches_the_operator_inert(nc, svc, store):  # noqa: F811
    hostile = "q\x1b[2J\r\u202e"
    extra = {**ORDERS, "properties": {**ORDERS["properties"], hostile: {"type": "string"}},
             "required": ["sku", hostile]}
    reply = await nc.request(S.classify_request(svc),
                             msgspec.json.encode({"proposal": change(svc, extra)}), timeout=5)
    found = classified(reply.data)
    assert found == {"class": "breaking", "reason": f"orders at /required: {hostile} became "
                                                    "required"}  # the store's claim, as it is
    line = render.schema_line(found)
    assert line == ("schema class: breaking (orders at /required: q\\x1b[2J\\r\\u202e "
                    "became required)")
