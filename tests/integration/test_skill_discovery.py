"""Discovery over a skills store's current heads (OMS: `system_valid_to` null, by name,
namespace, holder and proficiency) and the heads view of a holder's supersession chain
(`superseded_by`, `system_valid_to`), on `<svc>.skills.discover` against a real nats-server."""

from __future__ import annotations

import msgspec

from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import Signal, to_json

AT = 1768471200000
ALICE, BOB, CAROL = ("did:key:z6MkAlice", "did:key:z6MkBob", "did:key:z6MkCarol")


async def discover(nc, svc: str, **query) -> dict:
    msg = await nc.request(S.skills_discover(svc), to_json(query), timeout=5)
    return msgspec.json.decode(msg.data)


async def practised(store, identity: str, holder: str, outcomes: list[bool]) -> None:
    for i, positive in enumerate(outcomes):
        signal = Signal(kind="check", actor="evaluator:e1", service=store.service,
                        positive=positive, at=AT + i)
        await store.practice(identity, holder, signal, True, AT + 1000 * (i + 1))


async def test_discovery_finds_every_holder_of_a_skill_best_first(nc, svc, skills_store):
    store = skills_store
    review = await store.put_definition({"name": "review", "description": "review a diff"})
    summary = await store.put_definition({"name": "summary", "description": "summarise"})
    await practised(store, review, ALICE, [True, True, True])
    await practised(store, review, BOB, [True])
    await practised(store, summary, CAROL, [True, True])
    found = (await discover(nc, svc, name="review"))["skills"]
    assert [(g["holder_did"], g["practice_count"]) for g in found] == [(ALICE, 3), (BOB, 1)]
    assert all(g["skill"] == review and g["superseded_by"] is None
               and g["system_valid_to"] is None for g in found)
    assert found[0]["address"] == canonical.content_address(
        {k: v for k, v in found[0].items()
         if k not in ("address", "skill", "superseded_by", "system_valid_to")},
        canonical.SKILL)
    best = (await discover(nc, svc, namespace="agent:skills", min_proficiency=0.35))["skills"]
    assert [(g["name"], g["holder_did"]) for g in best] == [("review", ALICE),
                                                            ("summary", CAROL)]
    assert (await discover(nc, svc, holder=CAROL))["skills"][0]["name"] == "summary"
    assert (await discover(nc, svc, namespace="agent:other"))["skills"] == []
    bad = await discover(nc, svc, min_proficiency=2)
    assert bad["error"]["field"] == "min_proficiency"


async def test_the_heads_view_links_each_superseded_grain_to_its_successor(nc, svc, skills_store):
    store = skills_store
    review = await store.put_definition({"name": "review", "description": "review a diff"})
    await practised(store, review, ALICE, [True, False, True])
    chain = (await discover(nc, svc, holder=ALICE, history=True))["skills"]
    assert [g["practice_count"] for g in chain] == [1, 2, 3]
    for grain, successor in zip(chain, chain[1:], strict=False):
        assert grain["superseded_by"] == successor["address"]
        assert grain["system_valid_to"] == successor["created_at"]
        assert successor["derived_from"] == [grain["address"]]
    assert chain[-1]["superseded_by"] is None and chain[-1]["system_valid_to"] is None
    assert chain[-1] == {**(await store.competence(review, ALICE)), "skill": review,
                         "address": chain[-1]["address"], "superseded_by": None,
                         "system_valid_to": None}
