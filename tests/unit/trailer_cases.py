"""One trailer of every kind, written by the code under test from fixed inputs: what
tests/unit/test_trailers.py compares with `trailer_refs.json`, the refs the code before the
typed trailer data wrote from the same inputs (made by running `cases()` against it: the
adapter below speaks both APIs). Imports nothing but `improved`, so it runs against either."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import msgspec

from improved.core import (
    apply,
    audit,
    authority,
    breaker,
    checkpoint,
    epochs,
    evidence,
    indexes,
    learnback,
    lkg,
    planner,
    policy,
    propose,
    quorum,
    record,
    signing,
    tools,
    trailers,
    triage,
)
from improved.core.boundary import Attested, Unattested
from improved.protocol.model import (
    AnalyzerRef,
    ApplyResult,
    DsseSignature,
    Envelope,
    GrantCommand,
    MetricSnapshot,
    Origin,
    Proposal,
    Review,
    Signal,
    Summary,
    Vote,
)

NEW = hasattr(record, "fold")  # the API with one fold, or the one before it
NOW = 1_700_000_000_000
ACTOR = "improved:test"
POLICY = policy.Policy(doc_allowlist=("**",))
QUORUM = policy.Policy(doc_allowlist=("**",), quorum=True)
ENV = Envelope(payloadType="application/vnd.improved.review+json", payload="e30=",
               signatures=[DsseSignature(keyid="ed25519:" + "1" * 64, sig="c2ln")])
_SEQ = itertools.count(1)


def proposal(**over: Any) -> Proposal:
    fields: dict[str, Any] = dict(
        service="svc", target_ref="skill:greet", change_class="L2", scope="knowledge",
        origin=Origin(actor="mcp:aaa:1", service="svc"),
        analyzer=AnalyzerRef(id="pub.analyzer/1"),
        summary=Summary(template_id="new_skill", args={"name": "greet"}),
        created_at=NOW - 60_000,
        proposal_data={"skill": {"name": "greet", "description": "say hello"}})
    fields.update(over)
    return Proposal(**fields)


L4 = dict(service="deploy", target_ref="binary:deploy", change_class="L4", scope="operation",
          origin=Origin(actor="agentd:run-1:3", service="agentd"),
          analyzer=AnalyzerRef(id="pub.swapper/1"), summary=Summary(template_id="swap", args={}),
          proposal_data={"artefacts": {"a": "new a"}},
          lkg=[{"artefact": "a", "digest": "sha256:" + "a" * 64, "smoke_test": "nonempty"}])
L0 = dict(target_ref="rank:x", change_class="L0", proposal_data={"set": {"key": "x", "value": 1}})
REPORT = lkg.LkgReport(ok=True, artefacts=[lkg.LkgArtefact(
    artefact="a", lkg_digest="sha256:" + "1" * 64, smoke_test="nonempty", rc=0)])


def verified(principal: str, digest: str, payload: bytes = b"{}") -> signing.Verified:
    return signing.Verified(payload, "ed25519:" + digest[-8:], principal, digest, ENV)


def act(n: int) -> authority.Act:
    return authority.Act(f"{n:064x}", 40 + n)


class Chain:
    """A record walked through its stages, as the engine commits them: what each stage wrote
    (`out`), named."""

    def __init__(self, out: dict[str, dict[str, Any]]):
        self.out = out
        self.record: Any = None

    def register(self, name: str, p: Proposal, pol: policy.Policy = POLICY, **kw: Any) -> None:
        pid, dedup = propose.identify(p)
        start, draft = propose.register(p, pid, dedup, pol, NOW - 1, **kw)
        self._commit(name, None, start, draft)

    def step(self, name: str, result: Any) -> None:
        """Commit what a stage returned: (record after, draft) before, the draft now."""
        if NEW:
            self._commit(name, self.record, self.record, result)
        else:
            after, draft = result[0], result[1]
            self._commit(name, self.record, after, draft)

    def _commit(self, name: str, before: Any, base: Any, draft: audit.Draft) -> None:
        if NEW:  # as the engine commits: the data decoded once, before the trailer is sealed
            typed = draft.data  # what the stage wrote the refs from: the same as they read
            draft, data = indexes.moves_of(before, base, draft, NOW)
            assert typed is None or data is not None and msgspec.structs.replace(
                typed, index=data.index) == data, (name, typed, data)
        else:
            draft, data = indexes.with_moves(before, base, draft), None
        trailer = audit.seal(draft, base, NOW)
        if data is not None:  # what the commit folds is what a rebuild decodes
            assert data == trailers.decode(trailer), (name, data, trailers.decode(trailer))
        seq = next(_SEQ)
        self.record = (record.fold(base, trailer, seq, data) if NEW
                       else record.with_trailer(base, trailer, seq))
        self.out[name] = {"to_stage": trailer.to_stage, "verdict": trailer.verdict,
                          "cause": trailer.cause, "gate_class": trailer.gate_class,
                          "refs": list(trailer.refs)}

    def triage(self, name: str, pol: policy.Policy = POLICY, grant: bool = False) -> None:
        d = triage.decide(self.record, pol, NOW, grant, ACTOR)
        self.step(name, triage.transition(self.record, d))


def _now(*args: Any) -> tuple[Any, ...]:
    """The arguments of a stage that took the clock before the fold (the record it built
    carried it): `now` dropped for the new API."""
    return args if not NEW else args[:-1]


def review(chain: Chain, verdict: str, n: int) -> Any:
    rv = Review(proposal_id=chain.record.proposal_id, verdict=verdict,
                principal="operator:alice", reason="looked at it", at=NOW)
    return authority.review(chain.record, act(n), verified("operator:alice", act(n).digest),
                            rv, False, ACTOR, NOW)


def proposal_chains(out: dict[str, dict[str, Any]]) -> None:
    """Registration, triage, the operator's acts, dispatch and outcome, signals, measurement,
    rollback: every kind a proposal's chain holds."""
    c = Chain(out)
    c.register("registration", proposal())
    c.triage("decided/defer")
    c.step("refused", authority.refusal(c.record, act(2), "unknown_key", "no trusted key",
                                        ACTOR, "ed25519:12"))
    c.step("approved", review(c, "approve", 3))
    c.step("dispatched/apply", apply.dispatch(*_now(c.record, POLICY, ACTOR, NOW)))
    c.step("undelivered", apply.undelivered(*_now(c.record, "no responders", ACTOR, NOW)))
    c.step("dispatched/again", apply.dispatch(*_now(c.record, POLICY, ACTOR, NOW)))
    failed = ApplyResult(ok=False, error="bad diff", inverse={"undo": 1})
    c.step("applied/failed", apply.transition(*_now(c.record, Unattested(failed, "unsigned"),
                                                    "operator:alice", NOW)))

    signed = Chain(out)
    signed.register("registration/signed", proposal(created_at=NOW - 5), proposer="agent:svc:a",
                    envelope=ENV)
    signed.triage("decided/again")
    signed.step("rejected", review(signed, "reject", 4))

    old = Chain(out)
    old.register("registration/superseded", proposal(created_at=NOW - 7))
    old.step("superseded", propose.supersede(old.record, "f" * 64, ACTOR))

    snap = MetricSnapshot(metric="ctr", baseline=0.5, review_after=NOW + 100, query="q.ctr")
    auto = Chain(out)
    auto.register("registration/l0", proposal(metric_snapshot=snap, **L0))
    auto.triage("decided/accept")
    sig = Signal(kind="metric", actor="mcp:meter:1", service="metrics", positive=False,
                 at=NOW - 3, name="ctr", value=0.25)
    auto.step("signal/valued", _signal(auto, sig, "check:meter"))
    auto.step("signal/plain", _signal(auto, Signal(kind="check", actor="mcp:bbb:1",
                                                   service="ci", positive=True, at=NOW - 2),
                                      ""))
    auto.step("dispatched/l0", apply.dispatch(*_now(auto.record, POLICY, ACTOR, NOW)))
    ok = ApplyResult(ok=True, applied_id="a-1", inverse="RETRACT grain:abc", rollbackable=True,
                     schema_class="forward")
    auto.step("applied", apply.transition(*_now(auto.record, Attested(ok, "service:svc", "sig"),
                                                PRINCIPAL, NOW)))
    for name, reading in (("measured/regressed", learnback.Reading(value=0.1)),
                          ("measured/unmeasured", learnback.Reading(cause="no answer"))):
        m = planner.after_measure(*_now(auto.record, Attested(reading, "service:svc", "sig"),
                                        POLICY, ACTOR, NOW))
        out[name] = _shape(audit.seal(m.commit.draft, auto.record, NOW))
    held = planner.after_measure(*_now(auto.record, Attested(learnback.Reading(value=0.6),
                                                             "service:svc", "sig"),
                                       POLICY, ACTOR, NOW))
    auto.step("measured/held", held.commit.draft if NEW
              else (held.commit.record, held.commit.draft))
    auto.step("rollback", review(auto, "rollback", 5))
    auto.step("dispatched/rollback", apply.dispatch_rollback(*_now(auto.record, ACTOR, NOW)))
    inverse_id, _ = apply.rollback_order(auto.record, 1)
    back = ApplyResult(ok=False, applied_id="", error="refused")
    out["rollback_failed"] = _shape(audit.seal(_draft(apply.rollback_transition(
        *_now(auto.record, inverse_id, Attested(back, "service:svc", "sig"), NOW))),
        auto.record, NOW))
    back = ApplyResult(ok=True, applied_id="r-1")
    auto.step("rolled_back", apply.rollback_transition(
        *_now(auto.record, inverse_id, Attested(back, "service:svc", "sig"), NOW)))

    finished = Chain(out)
    finished.register("registration/finished", proposal(created_at=NOW - 9, **L0))
    finished.triage("decided/accept-again")
    finished.step("dispatched/finished", apply.dispatch(*_now(finished.record, POLICY, ACTOR,
                                                              NOW)))
    finished.step("applied/finished", apply.transition(*_now(
        finished.record, Attested(ApplyResult(ok=True, applied_id="z", inverse={"a": 1},
                                              rollbackable=True), "service:svc", "sig"),
        PRINCIPAL, NOW)))
    inverse = Chain(out)
    inverse.register("registration/inverse", apply.inverse_proposal(finished.record))
    inverse.triage("decided/inverse")
    inverse.step("dispatched/inverse", apply.dispatch(*_now(inverse.record, POLICY, ACTOR, NOW)))
    inverse.step("applied/inverse", apply.transition(*_now(
        inverse.record, Attested(ApplyResult(ok=True, applied_id="i"), "service:svc", "sig"),
        PRINCIPAL, NOW)))
    finished.step("rolled_back/by", apply.rolled_back_by(*_now(finished.record, inverse.record,
                                                               NOW)))


PRINCIPAL = POLICY.policy_principal


def _signal(chain: Chain, sig: Signal, emitter: str) -> Any:
    got = learnback.observe_signal(chain.record, sig, POLICY, NOW, emitter)
    assert got is not None
    return got[0] if NEW else (got[0], got[1])


def _draft(result: Any) -> audit.Draft:
    return result if NEW else result[1]


def _shape(t: Any) -> dict[str, Any]:
    return {"to_stage": t.to_stage, "verdict": t.verdict, "cause": t.cause,
            "gate_class": t.gate_class, "refs": list(t.refs)}


def l4_chains(out: dict[str, dict[str, Any]]) -> None:
    """The quorum and the L4's last-known-good, its reversal and the inherited approval."""
    q = Chain(out)
    q.register("registration/l4-quorum", proposal(created_at=NOW - 11, **L4), QUORUM)
    q.triage("decided/awaiting_quorum", QUORUM)
    for n, voter, session in ((6, "agent-a", "s1"), (7, "agent-b", "s2"), (8, "agent-c", "s3")):
        v = Vote(proposal_id=q.record.proposal_id, vote="approve", voter=voter, session=session,
                 read=quorum.expected_reads(q.record), at=NOW)
        q.step(f"vote/{voter}", quorum.count(q.record, act(n), verified(voter, act(n).digest),
                                             v, "c2ln", ACTOR))
    q.step("quorum", quorum.decided(*_now(q.record, ACTOR, NOW)))
    dissent = Chain(out)
    dissent.register("registration/l4-dissent", proposal(created_at=NOW - 12, **L4), QUORUM)
    dissent.triage("decided/awaiting_quorum-again", QUORUM)
    v = Vote(proposal_id=dissent.record.proposal_id, vote="dissent", voter="agent-d",
             session="s4", read=quorum.expected_reads(dissent.record), at=NOW)
    dissent.step("vote/dissent", quorum.count(dissent.record, act(9),
                                              verified("agent-d", act(9).digest), v, "c2ln",
                                              ACTOR))
    dissent.step("decided/quorum_dissent", quorum.decided(*_now(dissent.record, ACTOR, NOW)))

    o = Chain(out)
    o.register("registration/l4", proposal(created_at=NOW - 13, **L4))
    o.triage("decided/awaiting_operator")
    o.step("approved/l4", review(o, "approve", 10))
    refused = planner.after_lkg(o.record, Attested(lkg.LkgReport(ok=False, error="rc 1"),
                                                   "service:deploy", "sig"),
                                POLICY, ACTOR, 1 << 20, NOW)
    out["lkg_refused"] = _shape(audit.seal(refused.draft, o.record, NOW))
    verified_ = planner.after_lkg(o.record, Attested(REPORT, "service:deploy", "sig"), POLICY,
                                  ACTOR, 1 << 20, NOW)
    o.step("lkg_verified", verified_.draft if NEW else (verified_.record, verified_.draft))
    applied = o.record.replace(status="applied")
    rev = Chain(out)
    rev.register("registration/reversal", o.record.revert)
    rev.step("inherit", lkg.inherit(*_now(rev.record, applied, NOW)))


def mesh_chains(out: dict[str, dict[str, Any]]) -> None:
    """The grant, autonomy, checkpoint, seal, policy, trust and tool runtime chains."""
    skill = "greet:" + "e" * 64
    for name, op in (("grant", "grant"), ("revoke", "revoke")):
        cmd = GrantCommand(op=op, skill=skill, principal="operator:alice", reason="ok", at=NOW,
                           expires_at=NOW + 5 if op == "grant" else None,
                           proposal_id="d" * 64 if op == "grant" else None)
        out[name] = _shape_draft(authority.grant_act([], act(11), verified(
            "operator:alice", act(11).digest), cmd, None, ACTOR))
    out["grant/refused"] = _shape_draft(authority.grant_act(
        [], act(12), None, None, signing.ActRefused("unknown_key", "no"), ACTOR))
    state = breaker.Autonomy(rollbacks=(NOW - 5, NOW), paused_until=NOW + 10, switch="on")
    for verdict, extra in (("rollback", {"proposal": "b" * 64}), ("autonomy_off", {}),
                           ("crisis", {}),
                           ("crisis_resolved", {"act": "c" * 64, "keyid": "ed25519:k",
                                                "resolved": "crisis-1"})):
        marks = (breaker.Marks(**extra) if NEW else
                 tuple(f"{k}:{v}" for k, v in extra.items()))
        out[f"autonomy/{verdict}"] = _shape_draft(breaker.draft(
            state, verdict, ACTOR, "rec:system", "r", marks, None))
    cp = checkpoint.Checkpoint(count=3, root="r" * 64, last_seq=9, at=NOW, keyid="ed25519:k",
                               public="cHVi", sig="c2ln", frontier=("f" * 64, "g" * 64),
                               last_hash="h" * 64, runtimes=(("c" * 64, 2, "x" * 64, 7),),
                               members=(("due", 1), ("review", 2)))
    out["checkpoint"] = _shape_draft(checkpoint.draft(cp, ACTOR))
    out["checkpoint/bare"] = _shape_draft(checkpoint.draft(
        dataclasses.replace(cp, runtimes=(), members=None), ACTOR))
    seal = epochs.Seal(epoch=2, upto=90, count=80, root="r" * 64, removable=40, at=NOW,
                       frontier=("f" * 64,), last_hash="h" * 64, keyid="ed25519:k",
                       public="cHVi", sig="c2ln")
    out["seal"] = _shape_draft(epochs.draft(seal, ACTOR))
    out["policy"] = _shape_draft(policy.draft(policy.Policy(quorum=True, breaker_threshold=5,
                                                            doc_allowlist=("docs/**",)), ACTOR))
    trust = evidence.trust_draft(({"operator:alice": "YWxpY2U="}, {"agent-a": "YQ=="}, {}),
                                 None, ACTOR)
    out["trust"] = _shape_draft(trust)
    tool_chains(out)


def tool_chains(out: dict[str, dict[str, Any]]) -> None:
    from improved.core.retention import Known
    from improved.protocol import subjects as S

    known = {S.STREAM_TOOLS_SPENT: Known(S.STREAM_TOOLS_SPENT, "expires", "2026-01-01", 1),
             S.STREAM_TOOLS_AUDIT: Known(S.STREAM_TOOLS_AUDIT, "keeps", "2026-01-01", 2)}
    out["ledger"] = _shape_draft(tools.ledger_draft("rt", known, "seen first"))
    provider = tools.Provider("deploy", "L4", "deploys", lambda args: None, "1")
    upgrade = verified("operator:alice", "9" * 64, b'{"nonce": "n"}')
    proof = tools.SessionProof(at=NOW, nonce="bm9uY2Vub25jZW5vbmNl", sig="c2ln" * 22)
    allowed = tools.Decision(tool="deploy", args={"x": 1}, provider=provider, via="upgrade",
                             act=upgrade, principal="operator:alice", session="s-1",
                             proof="p" * 64, session_key="ed25519:sk", signed_proof=proof)
    out["tool_call"] = _shape_draft(tools.call_draft("rt", allowed, known))
    out["tool_call/mounted"] = _shape_draft(tools.call_draft("rt", tools.Decision(
        tool="deploy", args={}, provider=provider, via="mounted")))
    refused = tools.Decision(tool="deploy", args={"x": 1}, provider=provider, session="s-2",
                             reply={"refused": {"reason": "no_grant", "detail": "d"}})
    out["tool_refused"] = _shape_draft(tools.call_draft("rt", refused, known))


def _shape_draft(draft: audit.Draft | None) -> dict[str, Any]:
    assert draft is not None
    return {"to_stage": draft.to_stage, "verdict": draft.verdict, "cause": draft.cause,
            "refs": list(draft.refs)}


def cases() -> dict[str, dict[str, Any]]:
    """Every case by name: its stage, verdict, cause, (a proposal chain's) gate class, refs."""
    out: dict[str, dict[str, Any]] = {}
    proposal_chains(out)
    l4_chains(out)
    mesh_chains(out)
    return out


if __name__ == "__main__":  # against the code before: `PYTHONPATH=<its tree> python this`
    import json
    import sys

    json.dump(cases(), sys.stdout, indent=1, sort_keys=True)
