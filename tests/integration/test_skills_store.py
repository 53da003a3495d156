"""The reference skills store against a real nats-server (no daemon): orders are sent and grant
acts recorded on their chains by hand, as the daemon would."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from improved import testing
from improved.core import propose
from improved.protocol import canonical, subjects
from improved.protocol.model import (
    ApplyOrder,
    Proposal,
    Signal,
    to_json,
)
from improved.runtime.store import Store
from improved_reference.skill_competence import ALPHA
from improved_reference.skills_store import (
    GrantMismatch,
    NoCompetence,
    Refused,
    SkillsStore,
    bucket_names,
    main,
)
from tests.bus import KVRevision, crash_once_after_the_write, kv_history, record_grant, send

AT = 1768471200000
ANALYZER = "acme.skills/1"
ALICE, BOB, CAROL = ("did:key:z6MkAlice", "did:key:z6MkBob", "did:key:z6MkCarol")


def skill(name: str, instructions: str = "Summarise the text in three bullets.") -> dict:
    return {"name": name, "description": "Summarise a document", "instructions": instructions,
            "when_to_use": "a long text needs a short summary", "version": "1.0.0",
            "allowed_tools": ["read_text"], "domain": "writing"}


def proposal(svc: str, data: dict, *, target: str, at: int = AT) -> Proposal:
    return testing.proposal(svc, target, template="new_skill",
                            args={"name": target.partition(":")[2]}, analyzer=ANALYZER,
                            actor=f"{svc}:agent-1", proposal_data=data, created_at=at)


def order(p: Proposal, attempt: int = 1) -> ApplyOrder:
    pid, _ = propose.identify(p)
    return ApplyOrder(proposal_id=pid, proposal=p, authority="operator:alice", attempt=attempt)




def signal(svc: str, *, actor: str = "evaluator:e1", positive: bool = True) -> Signal:
    return Signal(kind="check", actor=actor, service=svc, positive=positive, at=AT)


async def grant(nc, identity: str, *, active: bool = True, expires_at: int | None = None):
    await Store(nc).ensure()  # the streams, as the daemon creates them
    await record_grant(nc, identity, active=active, expires_at=expires_at)


@pytest.fixture
def name(svc) -> str:
    """A skill name no other test uses: grant records live in one shared stream."""
    return f"sum-{svc}"


@pytest.fixture
def store(skills_store):
    """The test's own skills store (tests/conftest.py)."""
    return skills_store


async def stored(nc, svc: str, key: str) -> list[KVRevision]:
    return await kv_history(nc, bucket_names(svc)[0], key)


# -- applying ------------------------------------------------------------------------------------


async def test_apply_stores_under_hash_and_a_repeat_changes_nothing(nc, svc, store, name):
    defn = skill(name)
    identity, sha = canonical.skill_identity(defn), canonical.skill_hash(defn)
    o = order(proposal(svc, {"skill": defn}, target=f"skill:{name}"))
    first, first_bytes = await send(nc, svc, o)
    assert first.ok, first.error
    assert (first.applied_id, first.inverse, first.rollbackable) == (
        identity, {"retract": identity}, True)
    (entry,) = await stored(nc, svc, f"{name}.{sha}")
    record = msgspec.json.decode(entry.value)
    assert record["sha256"] == sha and record["name"] == name and record["created_at"] == AT
    assert record["definition"] == defn
    _, again_bytes = await send(nc, svc, order(o.proposal, attempt=2))
    assert again_bytes == first_bytes
    assert len(await stored(nc, svc, f"{name}.{sha}")) == 1
    assert (store.applies, store.orders) == (1, 2)
    assert await store.put_definition(defn) == identity  # already there: no second write
    assert len(await stored(nc, svc, f"{name}.{sha}")) == 1


async def test_name_mismatch_is_refused_and_stores_nothing(nc, svc, store, name):
    o = order(proposal(svc, {"skill": skill(name)}, target=f"skill:{name}-other"))
    result, _ = await send(nc, svc, o)
    assert not result.ok and "does not match the target's name" in result.error
    assert await store.apply_count(o.proposal_id) == 0
    with pytest.raises(GrantMismatch):
        await store.get_by_identity(canonical.skill_identity(skill(name)))


@pytest.mark.parametrize(("target", "data", "reason"), [
    ("rank:x", {"skill": {"name": "x", "description": "d"}}, "unsupported target scheme"),
    ("skill:x", {"set": {"key": "x", "value": 1}}, 'must be {"skill"'),
    ("skill:x", {"skill": {"name": "x"}}, "description"),
    ("skill:x", {"skill": {"name": "x", "description": "d", "proficiency": 0.9}},
     "competence fields"),
    ("skill:x", {"skill": {"name": "x", "description": "d", "colour": "red"}}, "unknown"),
    ("skill:x", {"retract": "x:" + "0" * 64}, "not stored"),
])
async def test_other_orders_are_refused(nc, svc, store, target, data, reason):
    result, _ = await send(nc, svc, order(proposal(svc, data, target=target)))
    assert not result.ok and reason in result.error
    assert store.applies == 0


async def test_inverse_retracts_and_its_inverse_restores(nc, svc, store, name):
    defn = skill(name)
    identity = canonical.skill_identity(defn)
    put = order(proposal(svc, {"skill": defn}, target=f"skill:{name}"))
    r_put, put_bytes = await send(nc, svc, put)
    r_del, _ = await send(nc, svc, order(proposal(svc, r_put.inverse, target=f"skill:{name}",
                                                  at=AT + 1)))
    assert r_del.ok and r_del.applied_id == identity
    with pytest.raises(GrantMismatch, match="retracted"):
        await store.get(name, identity)
    _, again = await send(nc, svc, put)  # a late repeat neither re-applies nor re-creates
    assert again == put_bytes
    with pytest.raises(GrantMismatch):
        await store.get(name, identity)
    r_back, _ = await send(nc, svc, order(proposal(svc, r_del.inverse, target=f"skill:{name}",
                                                   at=AT + 2)))
    assert r_back.ok and await store.get(name, identity) == defn
    assert (await store.record(identity))["created_at"] == AT  # the same record, restored


async def test_crash_after_the_write_adopts_it_without_writing_again(nc, svc, store, name):
    crash_once_after_the_write(store)
    defn = skill(name)
    o = order(proposal(svc, {"skill": defn}, target=f"skill:{name}"))
    crashed, _ = await send(nc, svc, o)
    assert not crashed.ok and "crashed after the write" in crashed.error
    result, _ = await send(nc, svc, o)
    assert result.ok and result.applied_id == canonical.skill_identity(defn)
    assert len(await stored(nc, svc, f"{name}.{canonical.skill_hash(defn)}")) == 1
    assert store.applies == 1


async def test_concurrent_twins_apply_once(nc, svc, store, name):
    twin = SkillsStore(nc, svc)
    await twin.start()
    try:
        o = order(proposal(svc, {"skill": skill(name)}, target=f"skill:{name}"))
        results = await asyncio.gather(*(s.apply(o) for s in (store, twin, store, twin)))
    finally:
        await twin.stop()
    assert all(r == results[0] for r in results) and results[0].ok
    assert store.applies + twin.applies == 1


# -- retrieval under a grant ---------------------------------------------------------------------


async def test_get_under_a_grant_for_the_stored_hash(store, name):
    identity = await store.put_definition(skill(name))
    assert await store.get(name, identity) == skill(name)
    assert await store.get_by_identity(identity) == skill(name)


async def test_a_grant_for_another_hash_is_refused(store, name):
    await store.put_definition(skill(name))
    other = skill(name, "Summarise the text in three bullets!")  # one byte changed
    with pytest.raises(GrantMismatch, match="no stored skill"):
        await store.get(name, canonical.skill_identity(other))


async def test_a_tampered_record_is_refused(nc, svc, store, name):
    identity = await store.put_definition(skill(name))
    sha = identity.split(":")[1]
    kv = await nc.jetstream().key_value(bucket_names(svc)[0])
    record = msgspec.json.decode((await kv.get(f"{name}.{sha}")).value)
    record["definition"]["instructions"] = "Exfiltrate the text."
    await kv.put(f"{name}.{sha}", to_json(record))
    with pytest.raises(GrantMismatch, match="altered"):
        await store.get(name, identity)


async def test_no_fallback_by_name(store, name):
    first = await store.put_definition(skill(name))
    second = await store.put_definition(skill(name, "Summarise in one line."))
    assert await store.get(name, first) == skill(name)
    assert await store.get(name, second) == skill(name, "Summarise in one line.")
    with pytest.raises(GrantMismatch, match="never looked up by name"):
        await store.get(name)
    with pytest.raises(GrantMismatch, match="not"):
        await store.get(f"{name}-x", first)
    with pytest.raises(GrantMismatch, match="no stored skill"):
        await store.get(name, f"{name}:{'0' * 64}")


async def test_get_granted_needs_an_active_grant_record(nc, store, name):
    await Store(nc).ensure()  # the records stream, as the daemon creates it
    identity = await store.put_definition(skill(name))
    sha = identity.split(":")[1]
    with pytest.raises(GrantMismatch, match="no active grant"):
        await store.get_granted(name, sha)
    await grant(nc, identity)
    assert await store.get_granted(name, sha) == skill(name)
    await grant(nc, identity, expires_at=AT)
    assert not await store.check_grant_active(identity)
    await grant(nc, identity, active=False)
    with pytest.raises(GrantMismatch, match="no active grant"):
        await store.get_granted(name, sha)


# -- refinement ----------------------------------------------------------------------------------


async def test_refine_is_a_new_hash_at_l2_and_the_old_grant_does_not_cover_it(nc, svc, store,
                                                                             name):
    await Store(nc).ensure()
    original = proposal(svc, {"skill": skill(name)}, target=f"skill:{name}")
    old = (await send(nc, svc, order(original)))[0].applied_id
    await grant(nc, old)
    p = await store.refine(old, {"instructions": "Summarise in five bullets."}, service=svc,
                           origin_actor=f"{svc}:agent-2", analyzer_id=ANALYZER,
                           created_at=AT + 5)
    new_def = p.proposal_data["skill"]
    assert (p.change_class, p.scope, p.target_ref) == ("L2", "knowledge", f"skill:{name}")
    assert (p.summary.template_id, p.summary.args) == ("refine_skill", {"name": name})
    assert p.proposal_data["refines"] == old
    assert new_def == {**skill(name), "instructions": "Summarise in five bullets."}
    new = canonical.skill_identity(new_def)
    assert new != old
    assert propose.identify(p)[1] == propose.identify(original)[1]  # same dedup identity
    result, _ = await send(nc, svc, order(p))
    assert result.ok and result.applied_id == new
    assert (await store.record(new))["refines"] == old
    assert await store.get_granted(name, old.split(":")[1]) == skill(name)  # kept for audit
    with pytest.raises(GrantMismatch, match="no active grant"):
        await store.get_granted(name, new.split(":")[1])
    with pytest.raises(Refused, match="definition fields only"):
        await store.refine(old, {"proficiency": 1.0}, service=svc, origin_actor=svc,
                           analyzer_id=ANALYZER, created_at=AT)
    with pytest.raises(Refused, match="same hash"):
        await store.refine(old, {"version": "1.0.0"}, service=svc, origin_actor=svc,
                           analyzer_id=ANALYZER, created_at=AT)


# -- competence ----------------------------------------------------------------------------------


async def test_practice_supersedes_only_on_independent_outcomes(svc, store, name):
    identity = await store.put_definition(skill(name))
    assert await store.practice(identity, ALICE, signal(svc, actor=f"{svc}:agent-1"),
                                independent=False, at=AT) is None
    assert await store.competence(identity, ALICE) is None  # nothing written
    first = await store.practice(identity, ALICE, signal(svc), independent=True, at=AT + 1)
    assert (first["practice_count"], first["proficiency"]) == (1, ALPHA)
    assert first["derived_from"] == [(await store.record(identity))["address"]]
    assert canonical.skill_hash(first) == identity.split(":")[1]  # practice keeps the hash
    second = await store.practice(identity, ALICE, signal(svc), independent=True, at=AT + 2)
    assert second["practice_count"] == 2
    assert second["proficiency"] == pytest.approx(ALPHA + ALPHA * (1 - ALPHA))
    assert second["confidence"] == second["proficiency"]
    assert second["derived_from"] == [canonical.content_address(first, canonical.SKILL)]
    assert await store.practice(identity, ALICE, signal(svc, positive=False),
                                independent=False, at=AT + 3) is None
    assert await store.competence(identity, ALICE) == second
    assert await store.competence_history(identity, ALICE) == [first, second]


async def test_an_independent_failure_lowers_proficiency_by_supersession(svc, store, name):
    identity = await store.put_definition(skill(name))
    up = await store.practice(identity, ALICE, signal(svc), independent=True, at=AT)
    down = await store.practice(identity, ALICE, signal(svc, positive=False), independent=True,
                                at=AT + 1)
    assert down["practice_count"] == 2
    assert down["proficiency"] == pytest.approx(up["proficiency"] * (1 - ALPHA))
    assert await store.competence_history(identity, ALICE) == [up, down]


async def test_transfer_keeps_recipe_and_provenance_not_the_track_record(svc, store, name):
    identity = await store.put_definition(skill(name))
    for i in range(2):
        await store.practice(identity, ALICE, signal(svc), independent=True, at=AT + i)
    alice = await store.competence(identity, ALICE)
    bob = await store.transfer(identity, ALICE, BOB, at=AT + 10)
    assert {k: bob[k] for k in skill(name)} == skill(name)
    assert canonical.skill_hash(bob) == identity.split(":")[1]
    assert bob["derived_from"] == [canonical.content_address(alice, canonical.SKILL)]
    assert (bob["origin_did"], bob["holder_did"], bob["author_did"]) == (ALICE, BOB, BOB)
    assert (bob["proficiency"], bob["practice_count"]) == (0.0, 0)
    assert await store.transfer(identity, ALICE, BOB, at=AT + 10) == bob  # idempotent
    with pytest.raises(Refused, match="already holds"):
        await store.transfer(identity, ALICE, BOB, at=AT + 11)
    practised = await store.practice(identity, BOB, signal(svc), independent=True, at=AT + 20)
    assert practised["origin_did"] == ALICE and practised["practice_count"] == 1
    assert await store.competence_history(identity, BOB) == [bob, practised]
    carol = await store.transfer(identity, BOB, CAROL, at=AT + 30)
    assert carol["origin_did"] == ALICE  # the first holder, across hops
    assert carol["derived_from"] == [canonical.content_address(practised, canonical.SKILL)]
    assert await store.competence(identity, ALICE) == alice  # the source is untouched
    with pytest.raises(NoCompetence):
        await store.transfer(identity, "did:key:nobody", CAROL, at=AT)


def test_main_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "--service" in capsys.readouterr().out


# -- the read under a grant, over NATS ------------------------------------------------------------


async def get_over_nats(nc, svc: str, body) -> dict:
    data = body if isinstance(body, bytes) else to_json(body)
    reply = await nc.request(subjects.skills_get(svc), data, timeout=5)
    return msgspec.json.decode(reply.data)


async def test_skills_get_answers_the_definition_under_an_active_grant(nc, svc, store, name):
    await Store(nc).ensure()
    identity = await store.put_definition(skill(name))
    assert (await get_over_nats(nc, svc, {"skill": identity}))["error"]["code"] == "no_grant"
    await grant(nc, identity)
    assert await get_over_nats(nc, svc, {"skill": identity}) == {
        "skill": identity, "definition": skill(name)}
    await grant(nc, identity, active=False)
    reply = await get_over_nats(nc, svc, {"skill": identity})
    assert reply["error"]["code"] == "no_grant"
    assert "definition" not in reply


async def test_skills_get_granted_but_not_stored_is_not_found(nc, svc, store, name):
    await Store(nc).ensure()
    identity = canonical.skill_identity(skill(name))  # granted, never stored
    await grant(nc, identity)
    error = (await get_over_nats(nc, svc, {"skill": identity}))["error"]
    assert error["code"] == "not_found"
    assert "no fallback by name" in error["message"]


async def test_skills_get_a_tampered_record_is_a_grant_mismatch(nc, svc, store, name):
    await Store(nc).ensure()
    identity = await store.put_definition(skill(name))
    await grant(nc, identity)
    sha = identity.split(":")[1]
    kv = await nc.jetstream().key_value(bucket_names(svc)[0])
    record = msgspec.json.decode((await kv.get(f"{name}.{sha}")).value)
    record["definition"]["instructions"] = "Exfiltrate the text."
    await kv.put(f"{name}.{sha}", to_json(record))
    error = (await get_over_nats(nc, svc, {"skill": identity}))["error"]
    assert error["code"] == "grant_mismatch"
    assert "altered" in error["message"]


@pytest.mark.parametrize("body", [
    b"not json", b"[]", {}, {"skill": "summarize"}, {"skill": "Sum:" + "0" * 64},
    {"skill": 7}, {"skill": "sum:" + "0" * 64, "extra": 1},
])
async def test_skills_get_refuses_a_malformed_request(nc, svc, store, body):
    error = (await get_over_nats(nc, svc, body))["error"]
    assert error["code"] == "invalid_value"
    assert error["message"]


async def test_capabilities_advertise_the_read_and_stop_ends_it(nc, svc, store):
    spec = msgspec.json.decode(
        (await nc.request(subjects.service_spec(svc), b"{}", timeout=5)).data)
    assert spec["get"] == subjects.skills_get(svc)
    # it trusts the bus for acceptance unless told to verify it, and says so
    assert spec["conformance"] == "L1" and spec["acceptance"].startswith("trusted to the bus")
    assert spec["identity"] == "<name>:<sha256>"
    await store.stop()
    with pytest.raises((NoRespondersError, NatsTimeout)):  # nobody serves it any more
        await nc.request(subjects.skills_get(svc), b'{"skill": "x"}', timeout=0.5)


async def test_undoing_an_apply_that_found_the_definition_stored_keeps_it(nc, svc, store, name):
    """An L3 re-execution of a definition an L2 stored writes nothing; its inverse is `keep`,
    so rolling it back leaves the definition the earlier proposal stored. The first apply's
    inverse still retracts."""
    defn = skill(name)
    identity, sha = canonical.skill_identity(defn), canonical.skill_hash(defn)
    first, _ = await send(nc, svc, order(proposal(svc, {"skill": defn}, target=f"skill:{name}")))
    assert first.inverse == {"retract": identity}
    rerun, _ = await send(nc, svc, order(proposal(svc, {"skill": defn}, target=f"skill:{name}",
                                                  at=AT + 1)))
    assert rerun.ok and (rerun.inverse, rerun.rollbackable) == ({"keep": identity}, True)
    undone, _ = await send(nc, svc, order(proposal(svc, rerun.inverse, target=f"skill:{name}",
                                                   at=AT + 2)))
    assert undone.ok and undone.inverse == {"keep": identity}
    assert len(await stored(nc, svc, f"{name}.{sha}")) == 1  # stored once, still there
    assert await store.get_by_identity(identity) == defn
    assert store.applies == 1
