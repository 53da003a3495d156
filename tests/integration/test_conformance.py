"""The conformance kit against live services on a real nats-server (no daemon): the reference
stores, and small in-test services that get each level right or wrong on purpose."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from improved.client.conformance import (
    Report,
    probe,
    render,
)
from improved.client.sdk import MeshClient, failed, serve_spec
from improved.protocol import subjects
from improved.protocol.model import ApplyOrder, ApplyResult, TriageDecision, to_json
from improved_reference import doc_store, knowledge_store, ranking_store, skills_store
from improved_reference.doc_store import DocStore
from improved_reference.knowledge_store import KnowledgeStore
from improved_reference.ranking_store import RankingStore
from improved_reference.skills_store import SkillsStore
from tests.bus import serving

FAST = 0.5  # seconds per request where the probe is expected to wait for nothing


class Fake:
    """A tiny service: a spec, an apply handler and optional get/lkg handlers."""

    def __init__(self, nc, service: str):
        self.nc, self.service = nc, service
        self.subs: list = []
        self.orders: list[ApplyOrder] = []
        self.decisions: list[TriageDecision] = []

    async def spec(self, spec: dict[str, Any]) -> None:
        self.subs.append(await serve_spec(self.nc, self.service, spec))

    async def apply(self, handler: Callable[[ApplyOrder], Awaitable[ApplyResult]],
                    sample: Any = None) -> None:
        """Serve applies with `handler`, and the conformance kit with `sample` (a valid
        proposal of this service unless given), taking decisions into `self.decisions`."""
        async def counted(order: ApplyOrder) -> ApplyResult:
            self.orders.append(order)
            return await handler(order)

        async def made() -> Any:
            return sample if sample is not None else valid_sample(self.service)

        async def took(decision: TriageDecision) -> None:
            self.decisions.append(decision)

        client = MeshClient(self.nc, self.service)
        self.subs.append(await client.serve_apply(counted))
        self.subs.append(await client.serve_conformance(made, took))

    async def reply(self, subject: str, answer: Callable[[dict], Any]) -> None:
        async def on_msg(msg) -> None:
            await msg.respond(to_json(answer(msgspec.json.decode(msg.data))))

        self.subs.append(await self.nc.subscribe(subject, cb=on_msg))

    async def close(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()


@pytest_asyncio.fixture(loop_scope="session")
async def fake(nc, svc):
    f = Fake(nc, svc)
    yield f
    await f.close()


async def refuse_unaccepted(order: ApplyOrder) -> ApplyResult:
    return failed(f"not_accepted: no operator acceptance on record for {order.proposal_id}")


def valid_sample(svc: str, **over: Any) -> dict[str, Any]:
    """A proposal as a service publishes its own."""
    return {"service": svc, "target_ref": "config:sample", "change_class": "L2",
            "scope": "operation", "origin": {"actor": f"{svc}:tuner", "service": svc},
            "analyzer": {"id": f"{svc}.tuner/1"},
            "summary": {"template_id": "tune", "args": {}},
            "proposal_data": {"set": {"key": "sample", "value": 1}},
            "created_at": 1_700_000_000_000, **over}


def improving(svc: str, **more: Any) -> dict[str, Any]:
    return {"service": svc, "improve": True, "apply": subjects.apply_request(svc), **more}


def no_grant(request: dict) -> dict:
    return {"error": {"code": "no_grant", "message": f"no active grant for {request['skill']}"}}


def no_lkg(request: dict) -> dict:
    return {"ok": False, "error": f"no last-known-good for {request['lkg'][0]['artefact']}"}


async def full_l4(fake: Fake, svc: str, **spec_over: Any) -> None:
    await fake.spec(improving(svc, schemes=["code:"], identity="<name>:<sha256>",
                              get=subjects.skills_get(svc), lkg=subjects.lkg_request(svc),
                              **spec_over))
    await fake.apply(refuse_unaccepted)
    await fake.reply(subjects.skills_get(svc), no_grant)
    await fake.reply(subjects.lkg_request(svc), no_lkg)


def lines(report: Report) -> list[str]:
    return render(report).splitlines()


# -- L0 and below ---------------------------------------------------------------------------------


async def test_a_service_that_never_answers_meets_no_level(nc, svc):
    report = await probe(nc, svc, timeout=FAST)
    assert report.level is None
    assert [(c.level, c.passed) for c in report.checks] == [("L0", False)]
    assert lines(report)[-2:] == [
        f"{svc} meets no level",
        f"not L0: no answer on {svc}.spec.get: a service must advertise, even the omission "
        f"(no answer on {svc}.spec.get (no responders))",
    ]


async def test_a_silent_subscriber_is_no_answer_either(nc, svc):
    async def never_replies(msg) -> None:
        pass

    sub = await nc.subscribe(subjects.service_spec(svc), cb=never_replies)
    try:
        report = await probe(nc, svc, timeout=FAST)
    finally:
        await sub.unsubscribe()
    assert report.level is None
    assert f"within {FAST:g}s" in report.checks[0].detail


async def test_an_advertised_omission_is_l0(nc, svc):
    sub = await serve_spec(nc, svc)  # no capabilities: {"improve": false}
    try:
        report = await probe(nc, svc, timeout=FAST)
    finally:
        await sub.unsubscribe()
    assert report.level == "L0"
    assert report.spec == {"service": svc, "improve": False}
    assert [c.level for c in report.checks] == ["L0", "L0", "L1"]  # and no order was sent
    assert lines(report)[-2:] == [
        f"{svc} meets L0",
        f"not L1: {svc} advertises \"improve\": false: it does not take part in the loop",
    ]


@pytest.mark.parametrize("spec", [{"service": "x"}, {"improve": "yes"}])
async def test_a_spec_without_a_boolean_improve_is_not_l0(fake, nc, svc, spec):
    await fake.spec(spec)
    report = await probe(nc, svc, timeout=FAST)
    assert report.level is None
    assert "\"improve\": true or false" in report.first_failure.detail


async def test_an_error_reply_on_spec_get_is_not_l0(fake, nc, svc):
    await fake.reply(subjects.service_spec(svc),
                     lambda _: {"error": {"code": "internal", "message": "boom"}})
    report = await probe(nc, svc, timeout=FAST)
    assert report.level is None
    assert "not the service's capabilities" in report.first_failure.detail


# -- L1 -------------------------------------------------------------------------------------------


async def test_no_apply_handler_is_l0(fake, nc, svc):
    await fake.spec(improving(svc))
    report = await probe(nc, svc, timeout=FAST)
    assert report.level == "L0"
    assert report.first_failure.name == "malformed order answered"
    assert "must get a reply" in report.first_failure.detail


async def test_an_apply_subject_the_daemon_does_not_use_is_l0(fake, nc, svc):
    await fake.spec(improving(svc, apply=f"{svc}.orders"))
    await fake.apply(refuse_unaccepted)
    report = await probe(nc, svc, timeout=FAST)
    assert report.level == "L0"
    assert "the daemon sends to" in report.first_failure.detail
    assert fake.orders == []


# -- the reference stores: honest about not verifying acceptance --------------------------------


@pytest_asyncio.fixture(loop_scope="session")
async def ranking(nc, svc):
    store = RankingStore(nc, svc)
    await store.start()
    yield store
    await store.stop()
    for bucket in ranking_store.bucket_names(svc):
        await nc.jetstream().delete_key_value(bucket)


@pytest_asyncio.fixture(loop_scope="session")
async def skills(nc, svc):
    store = SkillsStore(nc, svc)
    await store.start()
    yield store
    await store.stop()
    for bucket in skills_store.bucket_names(svc):
        await nc.jetstream().delete_key_value(bucket)


async def test_the_ranking_store_is_l1_because_it_does_not_check_acceptance(nc, svc, ranking):
    report = await probe(nc, svc)
    assert report.level == "L1"
    failure = report.first_failure
    assert (failure.level, failure.name) == ("L2", "refuses without acceptance")
    assert "refused, but not for lack of acceptance" in failure.detail
    assert lines(report)[-2] == f"{svc} meets L1"
    assert lines(report)[-1].startswith(
        "not L2: an L2 order without an operator acceptance on record was refused, but not for "
        "lack of acceptance")
    assert ranking.applies == 0 and await ranking.value("conformance-probe") is None


async def test_the_skills_store_trusting_the_bus_is_l1_and_says_so(nc, svc, skills):
    report = await probe(nc, svc)
    assert report.level == "L1" and report.claimed == "L1"
    assert report.first_failure.level == "L2"
    assert "not for lack of acceptance" in report.first_failure.detail
    assert skills.applies == 0


@pytest.mark.parametrize(("store_class", "module"), [(KnowledgeStore, knowledge_store),
                                                    (DocStore, doc_store)])
async def test_the_knowledge_and_doc_stores_trusting_the_bus_are_l1(nc, svc, store_class,
                                                                     module):
    async with serving(nc, store_class(nc, svc), module.bucket_names(svc)) as store:
        report = await probe(nc, svc)
        assert report.level == "L1" and report.claimed == "L1", render(report)
        assert "not for lack of acceptance" in report.first_failure.detail
        assert store.applies == 0


@pytest.mark.parametrize("store_class", [SkillsStore, RankingStore, KnowledgeStore, DocStore])
async def test_a_store_verifying_acceptance_is_l3(daemon, nc, svc, store_class):
    """With the gate in the store (the audit chain must show the acceptance), the skills store
    meets L3 (TOFU by hash); the ranking, knowledge and doc stores hold no skills, so L3 does
    not apply to them and they stop short of L4 (no last-known-good check)."""
    store = store_class(nc, svc, verify_acceptance=True)
    await store.start()
    try:
        report = await probe(nc, svc)
        assert report.level == "L3", render(report)
        assert report.claimed == "L3"
        assert lines(report)[-1].startswith("not L4:")
        assert store.applies == 0
    finally:
        await store.stop()


# -- L2 and above ---------------------------------------------------------------------------------


async def test_a_service_refusing_unaccepted_orders_without_skills_or_lkg_is_l3(fake, nc, svc):
    """L2 holds; L3 does not apply (no skills to pin); L4 needs the last-known-good check."""
    await fake.spec(improving(svc, schemes=["rank:", "score:"]))
    await fake.apply(refuse_unaccepted)
    report = await probe(nc, svc, timeout=FAST)
    assert report.level == "L3"
    assert all(c.passed for c in report.checks if c.level in ("L0", "L1", "L2", "L3"))
    assert "not applicable" in next(c.detail for c in report.checks if c.level == "L3")
    assert lines(report)[-2] == f"{svc} meets L3"
    assert lines(report)[-1].startswith("not L4:") and "last-known-good" in lines(report)[-1]
    # the malformed order never reached the handler; the L2 order came twice, identical,
    # and between them a hand-made L0 order that triage never accepted (refused too)
    assert len(fake.orders) == 3 and fake.orders[0] == fake.orders[2]
    assert fake.orders[1].proposal.change_class == "L0"
    order = fake.orders[0]
    assert order.proposal.target_ref == "rank:conformance-probe"
    assert order.proposal.scope == "knowledge"
    assert (order.proposal.change_class, order.authority, order.attempt) == (
        "L2", "operator:conformance-probe", 1)
    assert order.proposal.analyzer.id == "improved.conformance/1"
    assert order.proposal.origin.actor == "conformance"
    assert order.proposal.proposal_data == {}


async def test_applying_an_unaccepted_order_is_not_l2(fake, nc, svc):
    await fake.spec(improving(svc))

    async def applies(order: ApplyOrder) -> ApplyResult:
        return ApplyResult(ok=True, applied_id="k@1")

    await fake.apply(applies)
    report = await probe(nc, svc, timeout=FAST)
    assert report.level == "L1"
    assert report.first_failure.detail.startswith(
        "an L2 order without an operator acceptance on record was applied")
    assert len(fake.orders) == 1  # not sent again, nor any L4 order
    assert fake.orders[0].proposal.target_ref == "config:conformance-probe"
    assert fake.orders[0].proposal.scope == "operation"


async def test_a_refusal_that_changes_on_repeat_is_not_l2(fake, nc, svc):
    await fake.spec(improving(svc))

    async def forgetful(order: ApplyOrder) -> ApplyResult:
        return failed(f"not_accepted: attempt {len(fake.orders)}")

    await fake.apply(forgetful)
    report = await probe(nc, svc, timeout=FAST)
    assert report.level == "L1"
    assert report.first_failure.name == "idempotent"
    assert "different reply" in report.first_failure.detail


async def test_a_full_l4_service(fake, nc, svc):
    await full_l4(fake, svc)
    report = await probe(nc, svc, timeout=FAST)
    assert report.level == "L4", render(report)
    assert not any(c.failed for c in report.checks)
    assert {c.level for c in report.checks} == {"L0", "L1", "L2", "L3", "L4"}
    assert lines(report)[-1] == f"{svc} meets L4"
    # what the kit could not see is said, with why: no window advertised, nothing applied
    assert [(c.name, c.probed) for c in report.not_probed] == [
        ("all-or-none window", False), ("applied L4s emit revert_proposal_id", False)]
    assert "NOT PROBED L4 all-or-none window: the spec advertises no \"window\"" in \
        render(report)
    l4 = [o for o in fake.orders if o.proposal.change_class == "L4"]
    assert len(l4) == 1 and l4[0].proposal.lkg[0]["digest"] == "sha256:" + "0" * 64
    assert l4[0].proposal.target_ref == "code:conformance-probe"
    assert l4[0].proposal.scope == "code"


async def test_serving_a_definition_without_a_grant_is_not_l3(fake, nc, svc):
    await full_l4(fake, svc)
    await fake.close()
    fake.subs = []
    await fake.spec(improving(svc, identity="<name>:<sha256>", get=subjects.skills_get(svc)))
    await fake.apply(refuse_unaccepted)
    await fake.reply(subjects.skills_get(svc),
                     lambda r: {"skill": r["skill"], "definition": {"name": "probe"}})
    report = await probe(nc, svc, timeout=FAST)
    assert report.level == "L2"
    assert "returned a definition" in report.first_failure.detail


async def test_an_l3_service_without_lkg_is_l3(fake, nc, svc):
    await fake.spec(improving(svc, identity="<name>:<sha256>", get=subjects.skills_get(svc)))
    await fake.apply(refuse_unaccepted)
    await fake.reply(subjects.skills_get(svc), no_grant)
    report = await probe(nc, svc, timeout=FAST)
    assert report.level == "L3"
    assert lines(report)[-1].startswith("not L4: the spec advertises no 'lkg' subject")


async def test_confirming_an_unknown_last_known_good_is_not_l4(fake, nc, svc):
    await fake.spec(improving(svc, identity="<name>:<sha256>", get=subjects.skills_get(svc),
                              lkg=subjects.lkg_request(svc)))
    await fake.apply(refuse_unaccepted)
    await fake.reply(subjects.skills_get(svc), no_grant)
    await fake.reply(subjects.lkg_request(svc), lambda _: {"ok": True})
    report = await probe(nc, svc, timeout=FAST)
    assert report.level == "L3"
    assert "was confirmed" in report.first_failure.detail
    # no L4 order after that (the L0 one is the forged-acceptance probe)
    assert all(o.proposal.change_class in ("L0", "L2") for o in fake.orders)


async def test_a_bad_service_name_is_refused(nc):
    with pytest.raises(ValueError, match="must match"):
        await probe(nc, "Not.A.Service")


async def test_the_reference_artefact_store_is_l4_and_changes_nothing(daemon, nc, svc):
    from improved_reference.artefact_store import ArtefactStore

    store = ArtefactStore(nc, svc)
    await store.start()
    try:
        await store.seed({"app": '{"v": 1}'})
        before = await store.manifest()
        report = await probe(nc, svc, timeout=FAST)
        assert report.level == "L4", render(report)
        assert lines(report)[-1] == f"{svc} meets L4"
        assert await store.manifest() == before and store.applies == 0
    finally:
        await store.stop()


async def test_applying_an_l0_order_triage_never_accepted_is_not_l2(fake, nc, svc):
    """A service that checks acceptance for L2 but waves L0 orders through is not L2: anyone on
    the bus could label a change L0."""
    await fake.spec(improving(svc))

    async def lenient(order: ApplyOrder) -> ApplyResult:
        if order.proposal.change_class == "L0":
            return ApplyResult(ok=True, applied_id="x")
        return await refuse_unaccepted(order)

    await fake.apply(lenient)
    report = await probe(nc, svc, timeout=FAST)
    assert report.level == "L1"
    failed = report.first_failure
    assert failed.name == "refuses an L0 order triage never accepted" and "was applied" in \
        failed.detail


# -- the mesh -------------------------------------------------------------------------------------


async def test_the_mesh_meets_the_lowest_level_of_the_services_in_the_loop(own_server):
    """`--mesh` finds every service that answers discovery; one that advertises its omission
    is listed and left out of the mesh's level (it does not participate); the mesh meets its
    lowest participant's level; a named service that never answers leaves it at no level."""
    import asyncio

    from improved.client import connection
    from improved.client.conformance import probe_mesh, render_mesh
    from improved.runtime.store import Store
    from tests.cli import improved

    nc = await connection.connect(own_server.url, "mesh-conformance")
    await Store(nc).ensure()  # the audit stream a store verifying acceptance reads
    ranking = RankingStore(nc, "ranking")
    skills_ = SkillsStore(nc, "skills", verify_acceptance=True)
    await ranking.start()
    await skills_.start()
    quiet = await serve_spec(nc, "quiet")  # {"improve": false}
    try:
        mesh = await probe_mesh(nc, timeout=FAST)
        assert {r.service: r.level for r in mesh.reports} == {
            "quiet": "L0", "ranking": "L1", "skills": "L3"}
        assert [r.service for r in mesh.participants] == ["ranking", "skills"]
        assert mesh.level == "L1"
        text = render_mesh(mesh)
        assert text.splitlines()[-1] == "the mesh meets L1 (its lowest participant: ranking)"
        assert "quiet    L0    advertises no improvement surface" in text

        cli = await asyncio.to_thread(improved, "conformance", "--mesh", "--nats",
                                      own_server.url)
        assert cli.returncode == 1, cli.stderr  # the ranking store fails L2
        assert cli.stdout.splitlines()[-1] == text.splitlines()[-1]

        await ranking.stop()
        assert (await probe_mesh(nc, timeout=FAST)).level == "L3"
        ghost = await probe_mesh(nc, ["ghost"], timeout=FAST)
        assert ghost.level is None
        assert render_mesh(ghost).splitlines()[-1] == "the mesh meets no level: ghost meets none"
        cli = await asyncio.to_thread(improved, "conformance", "--mesh", "ghost", "--nats",
                                      own_server.url, "--timeout", "0.5")
        assert cli.returncode == 1
        assert ranking.applies == 0 and skills_.applies == 0
    finally:
        await quiet.unsubscribe()
        await skills_.stop()
        await connection.close(nc)


def test_conformance_wants_one_service_or_the_mesh():
    from tests.cli import improved

    for args in ((), ("a", "b"), ("Bad_Name",)):
        done = improved("conformance", *args)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, args


# -- L1: what a service emits and takes (issue 34) ------------------------------------------------


async def test_the_sample_and_the_decision_reach_the_service_and_nothing_reaches_the_loop(
        fake, nc, svc):
    await fake.spec(improving(svc))
    await fake.apply(refuse_unaccepted)
    report = await probe(nc, svc, timeout=FAST)
    passed = {c.name for c in report.checks if c.level == "L1" and c.passed}
    assert {"emits a valid proposal", "takes triage decisions",
            "refuses a bad decision"} <= passed, render(report)
    from improved.core import propose
    from improved.protocol.model import Proposal

    sample_id = propose.identify(msgspec.convert(valid_sample(svc), Proposal))[0]
    # one decision taken, on the sample, as the daemon retains it; the bad ones never reach it
    assert [(d.proposal_id, d.verdict) for d in fake.decisions] == [(sample_id, "defer")]
    assert await MeshClient(nc, svc).decision(sample_id) is None  # nothing was published


async def test_a_service_emitting_an_invalid_proposal_is_l0_and_the_mesh_names_it(
        fake, nc, svc, own_server):
    """A service built from the SDK whose proposals carry a class the contract does not
    have: the kit names the field, and `--mesh` names the service."""
    import asyncio

    from improved.client import connection
    from tests.cli import improved

    bad = valid_sample(svc, change_class="L9")
    await fake.spec(improving(svc))
    await fake.apply(refuse_unaccepted, sample=bad)
    report = await probe(nc, svc, timeout=FAST)
    assert report.level == "L0"
    assert report.first_failure.name == "emits a valid proposal"
    assert report.first_failure.detail.startswith(
        "its sample proposal is invalid at change_class: invalid_value")
    assert fake.orders == []  # the malformed order never reaches the handler; no other sent
    assert fake.decisions == []

    own = await connection.connect(own_server.url, "conformance-bad-emitter")
    bad_fake = Fake(own, "bademitter")
    try:
        await bad_fake.spec(improving("bademitter"))
        await bad_fake.apply(refuse_unaccepted, sample=valid_sample("bademitter",
                                                                    change_class="L9"))
        cli = await asyncio.to_thread(improved, "conformance", "--mesh", "--nats",
                                      own_server.url, "--timeout", "0.5")
    finally:
        await bad_fake.close()
        await connection.close(own)
    assert cli.returncode == 1, cli.stderr
    out = cli.stdout.splitlines()
    assert "emits invalid proposals: bademitter" in out
    assert any(line.strip().startswith("L1  FAIL emits a valid proposal: its sample proposal "
                                       "is invalid at change_class") for line in out), out
    assert any(line.strip() == "L2  not probed: L1 failed first" for line in out), out


async def test_a_service_that_cannot_be_asked_for_a_sample_is_l0(fake, nc, svc):
    await fake.spec(improving(svc))
    fake.subs.append(await MeshClient(nc, svc).serve_apply(refuse_unaccepted))
    report = await probe(nc, svc, timeout=FAST)
    assert report.level == "L0"
    assert report.first_failure.detail == (
        f"no answer on {svc}.improve.conformance.propose (no responders): the kit asks a "
        "service for a sample of the proposals it emits there (MeshClient.serve_conformance)")


async def test_a_service_taking_any_decision_handed_to_it_is_l0(fake, nc, svc):
    """One that takes a decision about another service's proposal, or with a verdict the
    contract does not have, does not read what it is given."""
    await fake.spec(improving(svc))
    fake.subs.append(await MeshClient(nc, svc).serve_apply(refuse_unaccepted))
    async def sample(msg) -> None:
        await msg.respond(to_json(valid_sample(svc)))

    async def takes_anything(msg) -> None:
        body = msgspec.json.decode(msg.data)
        await msg.respond(to_json({"taken": True, "proposal_id": body.get("proposal_id"),
                                   "verdict": body.get("verdict")}))

    fake.subs.append(await nc.subscribe(subjects.conformance_propose(svc), cb=sample))
    fake.subs.append(await nc.subscribe(subjects.conformance_triage(svc), cb=takes_anything))
    report = await probe(nc, svc, timeout=FAST)
    assert report.level == "L0", render(report)
    assert report.first_failure.name == "refuses a bad decision"
    assert report.first_failure.detail.startswith(
        "a decision with verdict \"maybe\" was not refused with an error reply")


async def test_a_decision_handed_to_a_store_moves_nothing(daemon, nc, svc):
    """The attack on the new surface: anyone may hand a store an `accept` decision; a store
    verifying acceptance still refuses the order, since only the audit chain counts."""
    from improved.client.conformance import probe_order
    from improved.client.conformance_evidence import probe_decision

    store = RankingStore(nc, svc, verify_acceptance=True)
    await store.start()
    try:
        order = probe_order(svc, {"schemes": ["rank:"]})
        taken = msgspec.json.decode((await nc.request(
            subjects.conformance_triage(svc),
            to_json(probe_decision(svc, order.proposal_id, verdict="accept", cause=None,
                                   actor="operator:mallory")), timeout=2)).data)
        assert taken == {"taken": True, "proposal_id": order.proposal_id, "verdict": "accept"}
        result = msgspec.json.decode((await nc.request(
            subjects.apply_request(svc), to_json(order), timeout=2)).data)
        assert result["ok"] is False and result["error"].startswith("not_accepted:")
        assert store.applies == 0
    finally:
        await store.stop()
        for bucket in ranking_store.bucket_names(svc):
            await nc.jetstream().delete_key_value(bucket)


# -- L4: the window and the reversal ids, judged from what happened (issue 34) --------------------


async def window_fake(fake: Fake, nc, svc: str, writes: list[tuple[str | None, dict]]) -> str:
    """A full L4 fake advertising a window whose key holds `writes` (tag, version set)."""
    js = nc.jetstream()
    bucket = f"window_{svc.replace('-', '_')}"
    await js.create_key_value(bucket=bucket, history=64)
    for tag, value in writes:
        headers = {"Improve-Proposal-Id": tag} if tag else None
        await js.publish(f"$KV.{bucket}.manifest", to_json(value), headers=headers)
    await full_l4(fake, svc, window={"bucket": bucket, "key": "manifest"})
    return bucket


async def test_swapping_one_artefact_at_a_time_is_not_l4(fake, nc, svc):
    bucket = await window_fake(fake, nc, svc, [(None, {"a": "1", "b": "1"}),
                                               ("p" * 64, {"a": "2", "b": "1"}),
                                               ("p" * 64, {"a": "2", "b": "2"})])
    try:
        report = await probe(nc, svc, timeout=FAST)
    finally:
        await nc.jetstream().delete_key_value(bucket)
    assert report.level == "L3", render(report)
    assert report.first_failure.name == "all-or-none window"
    assert report.first_failure.detail == (
        f"{bucket}/manifest: proposal pppppppppppp changed ['a'] in revision 2 and ['b'] in "
        "revision 3: a reader between them saw a mix")


async def test_swapping_every_artefact_in_one_write_is_l4(fake, nc, svc):
    bucket = await window_fake(fake, nc, svc, [(None, {"a": "1", "b": "1"}),
                                               ("p" * 64, {"a": "2", "b": "2"})])
    try:
        report = await probe(nc, svc, timeout=FAST)
    finally:
        await nc.jetstream().delete_key_value(bucket)
    assert report.level == "L4", render(report)
    window = next(c for c in report.checks if c.name == "all-or-none window")
    assert window.passed and window.probed


async def test_the_artefact_store_after_an_l4_and_its_reversal_is_l4_on_evidence(
        daemon, nc, svc):
    """After a real swap and its reversal through the daemon, the kit judges both from what
    happened: each a single write of the manifest, each naming its reversal on its chain."""
    from tests.bus import approve, outcome, started
    from tests.factories import swap

    store = await started(nc, svc, {"a": '{"v": 1}', "b": '{"v": 1}'})
    try:
        client = MeshClient(nc, svc)
        pid = await client.publish(swap(svc, {"a": '{"v": 2}', "b": '{"v": 2}'}))
        await approve(nc, client, svc, pid)
        assert (await outcome(client, pid)).ok
        rev_id = await client.publish((await daemon.engine.records.truth(svc, pid)).revert)
        assert (await outcome(client, rev_id)).ok
        report = await probe(nc, svc, timeout=FAST)
        assert report.level == "L4", render(report)
        assert report.not_probed == []
        by_name = {c.name: c.detail for c in report.checks}
        assert by_name["all-or-none window"].startswith("2 write(s) of applies")
        assert by_name["applied L4s emit revert_proposal_id"].startswith("2 applied L4(s)")
    finally:
        await store.stop()
