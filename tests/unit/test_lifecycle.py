"""The pure lifecycle (DESIGN §1, §4, §6): register → triage → apply → learn-back, each step
sealed into the audit chain; the record must always be what the chain says it is."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from improved.core import apply, audit, learnback, propose, record, triage
from improved.core.gradient import CLASSES
from improved.core.policy import Policy
from improved.core.record import ProposalRecord
from improved.protocol.model import (
    AnalyzerRef,
    ApplyResult,
    Origin,
    Proposal,
    Signal,
    Summary,
    Trailer,
)
from tests.builders import said

POLICY = Policy()
START = 1_700_000_000_000
TRIAGER = "improved:test"
ORIGIN_ACTOR = "mcp:aaa:1"
SKILL = {"name": "greet", "description": "say hello"}

# (target_ref, the scope its scheme implies)
TARGETS = (
    ("cache:search", "knowledge"),
    ("rank:search/top", "knowledge"),
    ("skill:greet", "knowledge"),
    ("doc:_doc/notes.md", "knowledge"),
    ("config:apply.timeout", "operation"),
    ("code:src/lib.rs", "code"),
    ("grain:g1", "knowledge"),
    ("doc:x/../_spec/CHANGELOG.md", "knowledge"),
)
# combinations that pass the guards, so that runs reach the gate, the apply and learn-back
FITTING = (
    ("L0", "cache:search"), ("L0", "rank:search/top"), ("L3", "skill:greet"),
    ("L1", "code:src/lib.rs"), ("L2", "skill:greet"), ("L4", "code:src/lib.rs"),
    ("L2", "grain:g1"),
)
SCOPE_OF = dict(TARGETS)
AUTO = (("L0", "cache:search"), ("L0", "rank:search/top"), ("L3", "skill:greet"))
profiles = st.one_of(
    st.sampled_from(AUTO),
    st.sampled_from(FITTING),
    st.tuples(st.sampled_from(CLASSES), st.sampled_from([t for t, _ in TARGETS])),
)


def make_proposal(**overrides) -> Proposal:
    fields = dict(
        service="svc", target_ref="skill:greet", change_class="L2", scope="knowledge",
        origin=Origin(actor=ORIGIN_ACTOR, service="svc"),
        analyzer=AnalyzerRef(id="pub.analyzer/1"),
        summary=Summary(template_id="new_skill", args={"name": "greet"}),
        created_at=START - 60_000, proposal_data={"skill": SKILL},
    )
    fields.update(overrides)
    if fields["change_class"] == "L4":  # L4 lists every artefact it touches (SPEC 09 §7)
        fields.setdefault("lkg", [{"artefact": "main", "digest": "sha256:" + "a" * 64,
                                   "smoke_test": "nonempty"}])
    return Proposal(**fields)


def bodies(trailers: list[Trailer]) -> list[dict]:
    return [msgspec.to_builtins(t) for t in trailers]


@dataclass
class Tracked:
    start: ProposalRecord
    record: ProposalRecord
    trailers: list[Trailer] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)


class Chain:
    """One proposal driven through the pure stages, as the engine would, with a fake clock and
    a fake stream sequence."""

    def __init__(self, proposal: Proposal, now: int = START, stream: list[int] | None = None):
        self.now = now
        self.stream = stream if stream is not None else [0]
        pid, dedup = propose.identify(proposal)
        rec, draft = propose.register(proposal, pid, dedup, POLICY, now)
        start, _ = propose.register(proposal, pid, dedup, POLICY, 0)
        self.t = Tracked(start=start, record=rec)
        self.commit(draft, rec)

    @property
    def pid(self) -> str:
        return self.t.record.proposal_id

    def commit(self, draft: audit.Draft, rec: ProposalRecord | None = None) -> Trailer:
        """Seal `draft` onto the record (`rec`: a registration's new one) and fold it in, as
        the engine's commit does."""
        rec = self.t.record if rec is None else rec
        trailer = audit.seal(draft, rec, self.now)
        self.stream[0] += 1
        before = self.t.record.status
        self.t.record = record.fold(rec, trailer, self.stream[0])
        self.t.trailers.append(trailer)
        self.t.seqs.append(self.stream[0])
        if before == "applied":
            assert self.t.record.status == "applied", "status left `applied`"
        return trailer

    def wants_triage(self) -> bool:
        r = self.t.record
        return triage.needs_triage(r) or (apply.needs_apply(r) and apply.expired(r, self.now))

    def triage(self, grant: bool) -> bool:
        if not self.wants_triage():
            return False
        d = triage.decide(self.t.record, POLICY, self.now, grant, TRIAGER)
        assert d == triage.decide(self.t.record, POLICY, self.now, grant, TRIAGER)
        if self.t.record.proposal.change_class == "L3" and d.cause in (None, "no_grant"):
            # the only class change is L2 → L3, and only a grant makes it
            assert (d.verdict == "accept") == grant
            assert d.gate_class == ("L3" if grant else "L2")
        self.commit(triage.transition(self.t.record, d))
        # the chain says what the stage decided: the decision, at its gate class
        assert self.t.record.decision == d and self.t.record.gate_class == d.gate_class
        return True

    def apply(self, result: ApplyResult) -> bool:
        r = self.t.record
        if not apply.needs_apply(r) or apply.expired(r, self.now):
            return False
        by = apply.authority(r, POLICY)
        assert by == POLICY.policy_principal != r.proposal.origin.actor
        self.commit(apply.transition(r, said(result), by))
        out = self.t.record.outcome
        assert out is not None and (out.ok, out.applied_id, out.authority, out.error) == (
            result.ok, result.applied_id, by, result.error)
        assert out.inverse == apply.derived_inverse(r, result)[0]
        assert not apply.needs_apply(self.t.record), "an outcome is final"
        return True

    def signal(self, sig: Signal, emitter: str = "") -> bool:
        step = learnback.observe_signal(self.t.record, sig, POLICY, self.now, emitter)
        if step is None:
            digest = propose.signal_digest(sig)
            assert any(s.digest == digest for s in self.t.record.signals)
            return False
        draft, counted = step
        assert counted.digest == propose.signal_digest(sig)
        self.commit(draft)
        assert self.t.record.signals[-1] == counted  # the chain counts what the stage counted
        assert learnback.observe_signal(self.t.record, sig, POLICY, self.now) is None
        return True

    def check(self) -> None:
        t, pid = self.t, self.pid
        assert audit.verify_chain(pid, bodies(t.trailers)) is None
        # as a reader gets them from the broker: JSON
        assert audit.verify_chain(pid, json.loads(msgspec.json.encode(t.trailers))) is None
        assert record.replay(t.start, t.trailers, t.seqs) == t.record
        assert record.fold_status(t.trailers) == (t.record.status, t.record.stage)
        assert [x.seq for x in t.trailers] == list(range(len(t.trailers)))
        assert t.record.chain.length == len(t.trailers)
        assert t.record.chain.last_hash == t.trailers[-1].hash
        applied = [x for x in t.trailers if x.to_stage == "apply" and x.verdict == "applied"]
        assert len(applied) <= 1
        assert len([x for x in t.trailers if x.to_stage == "apply"]) <= 1
        assert len([x for x in t.trailers if x.to_stage == "propose"]) == 1
        cls = t.record.proposal.change_class
        if applied or t.record.status == "applied":
            # without an operator approval only L0 and granted L3 apply (never L1, L2, L4)
            assert cls in ("L0", "L3"), cls
            assert t.record.decision is not None and t.record.decision.verdict == "accept"
            assert applied[0].observer_type == "rec:policy"


inverses = st.none() | st.dictionaries(
    st.sampled_from(("op", "grain", "prior")), st.text(max_size=6) | st.integers(), max_size=3,
) | st.lists(st.integers(), max_size=3)


class Lifecycle(RuleBasedStateMachine):
    proposals = Bundle("proposals")

    def __init__(self):
        super().__init__()
        self.now = START
        self.stream = [0]
        self.chains: dict[str, Chain] = {}

    @precondition(lambda self: len(self.chains) < 4)
    @rule(target=proposals, profile=profiles, wrong_scope=st.integers(0, 5),
          ttl=st.none() | st.none() | st.integers(0, 20_000), self_signal=st.integers(0, 3),
          variant=st.integers(0, 2))
    def register(self, profile, wrong_scope, ttl, self_signal, variant):
        cls, target_ref = profile
        scope = SCOPE_OF[target_ref]
        if wrong_scope == 0:
            scope = "operation" if scope != "operation" else "knowledge"
        sigs = [Signal(kind="refine", actor="mcp:aaa:2", service="svc", positive=True,
                       at=self.now)] if self_signal == 0 else None
        p = make_proposal(change_class=cls, target_ref=target_ref, scope=scope,
                          valid_to=None if ttl is None else self.now + ttl, signals=sigs,
                          summary=Summary(template_id="new_skill", args={"name": "greet",
                                                                        "v": variant}))
        pid, _ = propose.identify(p)
        if pid not in self.chains:  # a redelivered proposal registers nothing
            chain = Chain(p, self.now, self.stream)
            self.chains[pid] = chain
        return pid

    def _chain(self, pid: str) -> Chain:
        chain = self.chains[pid]
        chain.now = self.now
        return chain

    @rule(pid=proposals, grant=st.booleans())
    def triage(self, pid, grant):
        self._chain(pid).triage(grant)

    @rule(pid=proposals, ok=st.booleans(), rollbackable=st.booleans(), inverse=inverses)
    def apply(self, pid, ok, rollbackable, inverse):
        result = ApplyResult(ok=ok, applied_id=f"a-{pid[:8]}" if ok else "", inverse=inverse,
                             rollbackable=rollbackable, error=None if ok else "refused: busy")
        self._chain(pid).apply(result)

    @rule(pid=proposals, grant=st.booleans(), ok=st.booleans(), inverse=inverses)
    def advance(self, pid, grant, ok, inverse):
        """What the engine does with no new input: triage while needed, then apply."""
        chain = self._chain(pid)
        for _ in range(4):
            if chain.triage(grant):
                continue
            result = ApplyResult(ok=ok, applied_id="a-adv" if ok else "", inverse=inverse,
                                 rollbackable=ok, error=None if ok else "refused")
            if not chain.apply(result):
                break
        assert not chain.wants_triage()

    @rule(pid=proposals, own=st.booleans(), positive=st.booleans(),
          kind=st.sampled_from(("refine", "check", "world", "metric")),
          call=st.integers(2, 4), other_service=st.booleans())
    def signal(self, pid, own, positive, kind, call, other_service):
        actor = f"mcp:aaa:{call}" if own else f"mcp:s{call}:1"
        sig = Signal(kind=kind, actor=actor, service="other" if other_service else "svc",
                     positive=positive, at=self.now, proposal_id=pid)
        # who verifiably sent it: the proposing service, nobody, another service or a check
        emitter = (("service:svc" if call % 2 else "") if own
                   else "service:other" if other_service else f"check:c{call}")
        self._chain(pid).signal(sig, emitter)

    @rule(ms=st.integers(1, 4_000))
    def tick(self, ms):
        self.now += ms

    @invariant()
    def chains_agree(self):
        for chain in self.chains.values():
            chain.check()


TestLifecycle = Lifecycle.TestCase
TestLifecycle.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- a few runs spelled out ----------------------------------------------------------------------


def test_l0_auto_applies_once():
    c = Chain(make_proposal(change_class="L0", target_ref="cache:search"))
    assert c.triage(grant=False)
    assert c.t.record.decision.verdict == "accept"
    assert c.apply(ApplyResult(ok=True, applied_id="a1", inverse={"op": "retract"},
                               rollbackable=True))
    assert c.t.record.status == "applied" and c.t.record.applied_at == START
    assert not c.apply(ApplyResult(ok=True, applied_id="a2"))
    assert not c.triage(grant=False)
    c.check()


def test_l3_with_grant_applies_without_grant_waits_as_l2():
    c = Chain(make_proposal(change_class="L3"))
    c.triage(grant=False)
    assert (c.t.record.status, c.t.record.gate_class) == ("pending", "L2")
    assert not apply.needs_apply(c.t.record)
    g = Chain(make_proposal(change_class="L3", valid_to=START + 10))
    g.triage(grant=True)
    assert apply.needs_apply(g.t.record)
    assert g.apply(ApplyResult(ok=True, applied_id="s1"))
    assert g.t.record.status == "applied"
    c.check()
    g.check()


@pytest.mark.parametrize("cls", ["L1", "L2", "L4"])
def test_other_classes_are_never_applied_without_approval(cls):
    target = "code:src/lib.rs" if cls == "L4" else "skill:greet"
    scope = "code" if cls == "L4" else "knowledge"
    c = Chain(make_proposal(change_class=cls, target_ref=target, scope=scope))
    c.triage(grant=True)
    assert c.t.record.decision.verdict == ("accept" if cls == "L1" else "defer")
    assert not apply.needs_apply(c.t.record)
    assert not c.apply(ApplyResult(ok=True, applied_id="x"))
    assert c.t.record.status == "pending"
    c.check()


def test_failed_apply_is_final_and_not_applied():
    c = Chain(make_proposal(change_class="L0", target_ref="rank:top"))
    c.triage(grant=False)
    assert c.apply(ApplyResult(ok=False, error="refused: schema", rollbackable=True))
    r = c.t.record
    assert r.status == "pending" and r.outcome is not None and not r.outcome.ok
    assert r.outcome.rollbackable is False and r.applied_at is None
    assert not apply.needs_apply(r)
    c.check()


def test_accepted_but_expired_before_apply_is_retriaged_to_expired():
    c = Chain(make_proposal(change_class="L0", target_ref="cache:x", valid_to=START + 5))
    c.triage(grant=False)
    c.now = START + 5
    assert not c.apply(ApplyResult(ok=True, applied_id="late"))
    assert c.triage(grant=False)
    assert c.t.record.status == "expired"
    assert c.t.record.decision.cause == "expired"
    assert not apply.needs_apply(c.t.record)
    c.check()


def test_world_signal_counts_only_after_apply():
    c = Chain(make_proposal(change_class="L0", target_ref="cache:x"))
    c.triage(grant=False)
    c.signal(Signal(kind="world", actor="mcp:zzz:1", service="other", positive=True, at=START),
             "service:other")
    assert not c.t.record.signals[-1].independent
    c.apply(ApplyResult(ok=True, applied_id="a1"))
    c.now += 1
    c.signal(Signal(kind="world", actor="mcp:zzz:1", service="other", positive=True,
                    at=c.now), "service:other")
    assert c.t.record.signals[-1].independent
    assert learnback.verdict(c.t.record) == "confirmed"
    c.check()


# -- replay edge cases found while writing the machine ------------------------------------------


@pytest.mark.parametrize("inverse", ["RETRACT grain:abc", "42"])
def test_replay_keeps_a_string_inverse(inverse):
    c = Chain(make_proposal(change_class="L0", target_ref="cache:x"))
    c.triage(grant=False)
    c.apply(ApplyResult(ok=True, applied_id="a1", inverse=inverse, rollbackable=True))
    assert record.replay(c.t.start, c.t.trailers, c.t.seqs) == c.t.record


def test_replay_equals_live_for_a_long_forbidden_path():
    long_path = "x/" * 300 + "_spec/CHANGELOG.md"
    c = Chain(make_proposal(target_ref="doc:_doc/a.md", target_files=[long_path]))
    c.triage(grant=False)
    assert c.t.record.decision.cause == "forbidden_target"
    assert record.replay(c.t.start, c.t.trailers, c.t.seqs) == c.t.record


def test_l1_is_never_applied_even_when_approved():
    c = Chain(make_proposal(change_class="L1", target_ref="code:src/lib.rs", scope="code"))
    c.triage(grant=False)
    c.commit(audit.Draft(from_stage="triage", to_stage="triage", actor="operator:alice",
                         observer_type="human", reason="looks fine", verdict="approve"))
    assert c.t.record.status == "approved"
    assert not apply.needs_apply(c.t.record)


# -- verify_chain names the first break ---------------------------------------------------------


@pytest.fixture
def chain() -> Chain:
    c = Chain(make_proposal(change_class="L0", target_ref="cache:x",
                            signals=[Signal(kind="check", actor="mcp:aaa:2", service="svc",
                                            positive=True, at=START)]))
    c.signal(Signal(kind="check", actor="mcp:bbb:1", service="svc", positive=True, at=START),
             "check:ci")
    c.triage(grant=False)
    c.apply(ApplyResult(ok=True, applied_id="a1", inverse={"op": "retract"}, rollbackable=True))
    assert [t.to_stage for t in c.t.trailers] == ["propose", "learn-back", "triage", "apply"]
    c.check()
    return c


def _streamed(pid: str, trailers: list[dict], after: int | None = None) -> audit.Break | None:
    """The same chain fed trailer by trailer (what a checkpoint does), from the first one, or
    continued after position `after` from the hash verified there."""
    run = audit.ChainRun.start(pid, None)
    rest = trailers
    if after is not None:
        run = audit.ChainRun.after(pid, after, trailers[after]["hash"], "pending", None)
        rest = trailers[after + 1:]
    for body in rest:
        brk = audit.verify_next(run, body)
        if brk is not None:
            return brk
    return None


def _break(pid: str, trailers: list[dict]) -> tuple[int, str]:
    b = audit.verify_chain(pid, trailers)
    assert b is not None and b.proposal_id == pid
    assert str(b).startswith(f"{pid} trailer {b.seq}: ")
    assert _streamed(pid, trailers) == b  # read whole or streamed: the same first break
    return b.seq, b.problem


def test_intact_chain_verifies(chain):
    assert audit.verify_chain(chain.pid, bodies(chain.t.trailers)) is None
    assert chain.t.trailers[0].prev == chain.pid
    b = bodies(chain.t.trailers)
    assert all(_streamed(chain.pid, b, after) is None for after in (None, 0, 1, 2))
    b[3]["reason"] = "rewritten after the checkpoint"
    assert _streamed(chain.pid, b, after=1) == audit.Break(
        chain.pid, 3, "hash does not match the trailer's content")


def test_altered_reason(chain):
    b = bodies(chain.t.trailers)
    b[2]["reason"] = "accepted by nobody"
    assert _break(chain.pid, b) == (2, "hash does not match the trailer's content")


def test_altered_verdict(chain):
    b = bodies(chain.t.trailers)
    b[3]["verdict"] = "failed"
    assert _break(chain.pid, b) == (3, "hash does not match the trailer's content")


def test_altered_hash(chain):
    b = bodies(chain.t.trailers)
    b[1]["hash"] = "0" * 64
    assert _break(chain.pid, b) == (1, "hash does not match the trailer's content")


def test_altered_and_resealed_trailer_breaks_the_next_link(chain):
    b = bodies(chain.t.trailers)
    b[1]["reason"] = "rewritten"
    b[1]["hash"] = audit.trailer_hash(b[1])
    assert _break(chain.pid, b) == (2, "prev does not link to the previous trailer")


def test_deleted_middle_trailer(chain):
    b = bodies(chain.t.trailers)
    del b[1]
    assert _break(chain.pid, b) == (1, "sequence jumps to 2")


def test_deleted_first_trailer(chain):
    b = bodies(chain.t.trailers)[1:]
    assert _break(chain.pid, b) == (0, "sequence jumps to 1")


def test_reordered_trailers(chain):
    b = bodies(chain.t.trailers)
    b[1], b[2] = b[2], b[1]
    assert _break(chain.pid, b) == (1, "sequence jumps to 2")


def test_renumbered_reorder_breaks_the_link(chain):
    b = bodies(chain.t.trailers)
    b[1], b[2] = b[2], b[1]
    for i in (1, 2):
        b[i]["seq"] = i
        b[i]["hash"] = audit.trailer_hash(b[i])
    assert _break(chain.pid, b) == (1, "prev does not link to the previous trailer")


def test_trailer_from_another_proposal(chain):
    other = Chain(make_proposal(change_class="L0", target_ref="cache:y"))
    b = bodies(chain.t.trailers)
    foreign = bodies(other.t.trailers)[0]
    _, problem = _break(chain.pid, [*b[:2], foreign, *b[2:]])
    assert other.pid in problem and problem.startswith("belongs to proposal")
    # the whole chain checked against the wrong id fails at once
    seq, problem = _break(other.pid, b)
    assert seq == 0 and chain.pid in problem


def test_foreign_trailer_break_is_named_at_its_position(chain):
    other = Chain(make_proposal(change_class="L0", target_ref="cache:y"))
    b = bodies(chain.t.trailers)
    foreign = bodies(other.t.trailers)[0]
    seq, _ = _break(chain.pid, [*b[:2], foreign, *b[2:]])
    assert seq == 2


def test_empty_chain():
    pid = "ab" * 32
    assert audit.verify_chain(pid, []) == audit.Break(pid, 0, "no trailers")


@pytest.mark.parametrize("key", ["hash", "prev"])
def test_non_ascii_tampering_is_named(chain, key):
    b = bodies(chain.t.trailers)
    b[1][key] = "é" * 64
    seq, _ = _break(chain.pid, b)
    assert seq == 1


# -- the lifecycle is part of verifying a chain --------------------------------------------------


def _sealed(pid: str, *drafts: audit.Draft) -> list[dict]:
    head, out = record.ChainHead(), []
    for i, d in enumerate(drafts):
        t = audit.seal_next(d, pid, head, "L2", "knowledge", START + i)
        out.append(msgspec.to_builtins(t))
        head = record.ChainHead(length=i + 1, last_hash=t.hash, stream_seq=i + 1)
    return out


def _d(to_stage: str, verdict: str | None = None, cause: str | None = None) -> audit.Draft:
    return audit.Draft(from_stage="triage", to_stage=to_stage, actor="improved:x",
                       observer_type="rec:system", reason="r", verdict=verdict, cause=cause)


REG = _d("propose")


@pytest.mark.parametrize(("steps", "named"), [
    ((_d("triage", "reject"), _d("triage", "approve")), "rejected → approved"),
    ((_d("triage", "reject", "expired"), _d("apply", "applied")), "expired → applied"),
    ((_d("triage", "accept"), _d("apply", "applied"), _d("apply", "rolled_back"),
      _d("apply", "applied")), "rolled_back → applied"),
    ((_d("triage", "reject"), REG), "a second registration"),
    ((_d("triage", "accept"), _d("apply", "applied"), _d("triage", "reject")),
     "applied → rejected"),
])
def test_a_chain_the_lifecycle_forbids_does_not_verify(steps, named):
    """Correctly hashed and linked, but a transition OMS never makes: a broken chain."""
    pid = "cd" * 32
    bodies = _sealed(pid, REG, *steps)
    assert audit.verify_links(pid, bodies) is None
    brk = audit.verify_chain(pid, bodies)
    assert brk is not None and named in brk.problem and brk.seq == len(steps)


def test_every_lifecycle_the_loop_walks_verifies():
    pid = "ce" * 32
    walks = [
        (_d("triage", "defer", "awaiting_operator"), _d("triage", "approve"),
         _d("apply", "dispatched"), _d("apply", "applied"), _d("apply", "rollback"),
         _d("apply", "rolled_back")),
        (_d("triage", "accept"), _d("triage", "superseded")),
        (_d("triage", "approve"), _d("triage", "superseded"), _d("triage", "reject")),
        (_d("triage", "defer", "awaiting_operator"), _d("triage", "reject", "expired")),
    ]
    for steps in walks:
        assert audit.verify_chain(pid, _sealed(pid, REG, *steps)) is None
