"""The indexes as membership functions of a record (core.indexes): the trailer that moves a
proposal in or out of an index says so, a checkpoint's counts are those refs added up, and a
reader checks what an index names against the count — reading one chain per subject, however
long the history — and knows when it falls short."""

from __future__ import annotations

import itertools

import msgspec

from improved.core import (
    apply,
    audit,
    authority,
    checkpoint,
    epochs,
    indexes,
    learnback,
    planner,
    propose,
    signing,
    trailers,
)
from improved.core.authority import Act
from improved.core.breaker import Autonomy
from improved.core.policy import Policy
from improved.core.record import ProposalRecord, fold
from improved.protocol.model import ApplyResult, MetricSnapshot, Review, Summary, Trailer
from tests.builders import NOW, TRIAGER, make_proposal, said
from tests.unit.test_planner import ALICE, OPERATORS

POLICY = Policy(doc_allowlist=("**",))
L0 = dict(target_ref="rank:x", change_class="L0", proposal_data={"set": {"key": "x", "value": 1}})
_SEQ = itertools.count(1)


class Chain:
    """One proposal's chain walked purely, committed as the engine commits: the trailer gets
    the membership refs of the record before it and after (`indexes.with_moves`)."""

    def __init__(self, **overrides):
        proposal = make_proposal(**overrides)
        pid, dedup = propose.identify(proposal)
        record, draft = propose.register(proposal, pid, dedup, POLICY, NOW - 1)
        self.trailers: list[Trailer] = []
        self.seqs: list[int] = []
        self.record = self.commit(None, record, draft)

    def commit(self, before: ProposalRecord | None, record: ProposalRecord, draft) -> ProposalRecord:
        seq = next(_SEQ)
        # the engine's one fold (`indexes.sealed`) is the long way round: moves, seal, fold
        sealed, sealed_data, after = indexes.sealed(before, record, draft, NOW, seq)
        draft, data = indexes.moves_of(before, record, draft, NOW)
        trailer = audit.seal(draft, record, NOW)
        assert data is None or data == trailers.decode(trailer)  # as a rebuild reads it
        self.trailers.append(trailer)
        self.seqs.append(seq)
        self.record = fold(record, trailer, self.seqs[-1], data)
        assert (sealed, sealed_data, after) == (trailer, data, self.record)
        return self.record

    def settle(self, now: int = NOW) -> planner.Step:
        """Every commit the planner asks for, up to the first step that needs the world."""
        for _ in range(20):
            step = planner.next_step(self.record, planner.View(now=now, autonomy=Autonomy()),
                                     POLICY, TRIAGER)
            if not isinstance(step, planner.Commit):
                return step
            self.commit(self.record, self.record, step.draft)
        raise AssertionError("the planner kept committing")

    def refs(self) -> list[str]:
        return [r for t in self.trailers for r in t.refs if r.startswith("index:")]

    def replayed(self) -> list[ProposalRecord]:
        """The record after each trailer, as a reader rebuilds it from the chain."""
        return [propose.rebuild_record(self.trailers[:n], self.seqs[:n], POLICY)
                for n in range(1, len(self.trailers) + 1)]


def waiting(name: str = "greet") -> Chain:
    chain = Chain(summary=Summary(template_id="new_skill", args={"name": name}))
    assert isinstance(chain.settle(), planner.Done)
    assert indexes.members(chain.record) == {"review"}
    return chain


def applied(chain: Chain, step: planner.Step) -> None:
    assert isinstance(step, planner.SendApply), step
    chain.commit(chain.record, chain.record, apply.transition(
        chain.record, said(ApplyResult(ok=True, applied_id="a")), step.authority))


def approve(chain: Chain) -> None:
    """An operator's signed approval, recorded as the review ingest does."""
    rv = Review(proposal_id=chain.record.proposal_id, verdict="approve",
                principal="operator:alice", reason="looked at it", at=NOW)
    env = signing.sign(signing.PAYLOAD_TYPES["review"], msgspec.json.encode(rv), ALICE)
    verified = OPERATORS.verify(env, signing.PAYLOAD_TYPES["review"])
    chain.commit(chain.record, chain.record, authority.review(
        chain.record, Act(verified.digest, next(_SEQ)), verified, rv, False, TRIAGER, NOW))


def measured_later() -> Chain:
    snap = MetricSnapshot(metric="ctr", baseline=0.2, review_after=NOW + 100, query="q")
    chain = Chain(metric_snapshot=snap, **L0)
    applied(chain, chain.settle())
    return chain


def test_the_trailer_that_moves_a_proposal_in_or_out_of_an_index_says_so():
    chain = waiting()
    assert chain.refs() == ["index:+review"]  # on the deferring triage trailer, once
    assert chain.trailers[1].refs[-1] == "index:+review"
    approve(chain)
    assert chain.refs() == ["index:+review", "index:-review"]
    assert indexes.members(chain.record) == frozenset()

    due = measured_later()
    assert due.refs() == ["index:+due"] and indexes.members(due.record) == {"due"}
    step = planner.after_measure(due.record, said(learnback.Reading(value=0.2)), POLICY, TRIAGER)
    due.commit(due.record, due.record, step.commit.draft)
    assert due.refs() == ["index:+due", "index:-due"]

    plain = Chain(**L0)  # no review_after, never gated: it never costs a ref
    applied(plain, plain.settle())
    assert plain.record.status == "applied" and plain.refs() == []


def test_the_refs_are_what_the_replay_says_and_a_wrong_one_is_named():
    for chain in (waiting(), measured_later()):
        records = chain.replayed()
        assert indexes.refs_problem(records, [t.refs for t in chain.trailers]) is None
    chain = waiting()
    refs = [list(t.refs) for t in chain.trailers]
    refs[1] = [r for r in refs[1] if not r.startswith("index:")] + ["index:+due"]
    problem = indexes.refs_problem(chain.replayed(), refs)
    assert problem is not None and "trailer 1" in problem and "+review" in problem
    # a chain written before the refs were kept carries none: nothing to check
    bare = [[r for r in t.refs if not r.startswith("index:")] for t in chain.trailers]
    assert indexes.refs_problem(chain.replayed(), bare) is None


def test_refs_move_the_counts_and_nothing_else_does():
    assert indexes.moves(["index:+review", "index:-due", "index:+due", "proposal:{}"]) == \
        {"review": 1, "due": 0}
    assert indexes.moves(["index:+nosuch", "index:review", "index:", 7, "index:*review"]) == {}
    counts = {"review": 2, "due": 0}
    indexes.add(counts, ["index:-review", "index:+due"])
    assert counts == {"review": 1, "due": 1}
    indexes.add(None, ["index:+review"])  # unknown counts stay unknown
    assert indexes.counted({"review": 1}) is None  # a count for every index, or none
    assert indexes.counted({"review": 1, "due": 2, "later": 3}) == {"review": 1, "due": 2}


def test_a_checkpoint_carries_its_counts_and_one_without_them_reads_as_none():
    from tests.keys import ALICE

    cp = checkpoint.make_from((), 0, 0, "", NOW, ALICE[1], members={"review": 3, "due": 1})
    draft = checkpoint.draft(cp, TRIAGER)
    assert 'members:{"due":1,"review":3}' in draft.refs
    body = {"refs": list(draft.refs)}
    assert checkpoint.from_trailer(body).members == (("due", 1), ("review", 3))
    older = {"refs": [r for r in draft.refs if not r.startswith("members:")]}
    assert checkpoint.from_trailer(older).members is None
    garbled = {"refs": [*older["refs"], 'members:{"review":-1}']}
    assert checkpoint.from_trailer(garbled).members is None
    anchor = checkpoint.anchor_of(cp, "created")
    assert checkpoint.anchor_from(checkpoint.anchor_dict(anchor)) == anchor
    doc = checkpoint.anchor_dict(anchor)
    del doc["members"]
    assert checkpoint.anchor_from(doc).members is None


def test_tombstones_outlive_the_next_two_checkpoints():
    ttl = indexes.tombstone_ttl_s(300)
    assert ttl == 660
    assert indexes.vouched(600_000, ttl) and not indexes.vouched(600_001, ttl)
    assert indexes.tombstone_ttl_s(0) == indexes.MARGIN_S


def test_the_check_against_the_count():
    assert indexes.check("review", 3, 3, True).complete
    short = indexes.check("review", 3, 2, True)
    assert not short.complete and short.short == 1 and "omitted 1 of the 3" in short.why
    assert not indexes.check("review", 3, 4, True).complete  # the count is off
    assert "older" in indexes.check("review", 3, 3, False).why  # tombstones may be gone
    assert "no count" in indexes.check("review", None, 0, True).why


def test_a_reader_reads_one_chain_per_subject_however_long_the_history():
    history = []  # closed proposals: approved, out of the queue, their tombstones long gone
    for i in range(50):
        chain = waiting(f"old{i}")
        approve(chain)
        history.append(chain)
    open_items = [waiting(f"open{i}") for i in range(3)]
    left = waiting("left")  # counted at the checkpoint, approved since: its tombstone stands
    at = left.seqs[-1]
    approve(left)
    named = [indexes.Named(c.record.service, c.record.proposal_id, queue_entry(c.record))
             for c in open_items] + [indexes.Named("svc", left.record.proposal_id, None)]
    assert len(indexes.to_read(named)) == 4  # one chain per subject, none of the 50
    # tombstones stored before the checkpoint began its read name no member of it: not read
    checkpoint_at = NOW + 3_600_000
    old = [indexes.Named("svc", c.record.proposal_id, None, at=NOW) for c in history]
    recent = indexes.Named("svc", left.record.proposal_id, None, at=checkpoint_at - 1000)
    assert indexes.to_read([*named[:3], *old, recent], checkpoint_at) == \
        indexes.to_read(named)

    def replayed(of: list[Chain]) -> dict[tuple[str, str], indexes.Replayed]:
        out = {}
        for c in of:
            prefix = sum(1 for q in c.seqs if q <= at)
            out[(c.record.service, c.record.proposal_id)] = indexes.Replayed(
                c.record, propose.rebuild_record(c.trailers[:prefix], c.seqs[:prefix], POLICY)
                if prefix else None)
        return out

    review = indexes.INDEXES["review"]
    found = indexes.assess(review, named, replayed([*open_items, left]), count=4, fresh=True)
    assert found.verdict.complete and found.found == 4 and not found.wrong
    assert {r.proposal_id for r in found.members} == {c.record.proposal_id for c in open_items}

    # an entry purged: the subjects no longer hold every member the checkpoint counted
    found = indexes.assess(review, named[1:], replayed([*open_items[1:], left]), count=4,
                           fresh=True)
    assert not found.verdict.complete and found.verdict.short == 1
    # the tombstone of the one that left purged too
    found = indexes.assess(review, named[:3], replayed(open_items), count=4, fresh=True)
    assert not found.verdict.complete and found.verdict.short == 1
    # an entry tombstoned instead: the tombstone still names it, so it is listed; its
    # subject is wrong (the daemon writes it again)
    hidden = open_items[0].record
    tombstoned = [indexes.Named(hidden.service, hidden.proposal_id, None), *named[1:]]
    found = indexes.assess(review, tombstoned, replayed([*open_items, left]), count=4,
                           fresh=True)
    assert found.verdict.complete and hidden in found.members and found.wrong == [hidden]


def queue_entry(record: ProposalRecord):
    return indexes.INDEXES["review"].entry(record)


def test_an_owed_measurement_holds_the_epoch_cut():
    chain = measured_later()
    scan = epochs.Scan()
    for seq, trailer in zip(chain.seqs, chain.trailers, strict=True):
        scan.feed(seq, "improve.audit.svc." + chain.record.proposal_id,
                  msgspec_builtins(trailer))
    far = NOW + 365 * epochs.DAY_MS  # applied and untouched for a year: closed, but owed
    assert scan.cut(chain.seqs[-1], far, 30) == chain.seqs[0] - 1
    step = planner.after_measure(chain.record, said(learnback.Reading(value=0.2)), POLICY, TRIAGER)
    chain.commit(chain.record, chain.record, step.commit.draft)
    scan.feed(chain.seqs[-1], "improve.audit.svc." + chain.record.proposal_id,
              msgspec_builtins(chain.trailers[-1]))
    assert scan.cut(chain.seqs[-1], far, 30) == chain.seqs[-1]


def msgspec_builtins(trailer: Trailer) -> dict:
    return msgspec.to_builtins(trailer)


def test_a_pass_that_moves_a_proposal_in_and_out_again_leaves_its_tombstone():
    """Measured in the pass that applied it: no entry before, none after, but the checkpoint
    may have counted it in between, so the reader must find its tombstone."""
    from improved.core import queue

    chain = measured_later()
    before = propose.rebuild_record(chain.trailers[:1], chain.seqs[:1], POLICY)
    step = planner.after_measure(chain.record, said(learnback.Reading(value=0.2)), POLICY,
                                 TRIAGER)
    after = chain.commit(chain.record, chain.record, step.commit.draft)
    assert learnback.due_change(before, after, False) is None
    assert learnback.due_change(before, after, False, moved=True) == learnback.DueWrite(None)
    # the same for the queue: in and out within one pass
    waits = waiting("in-and-out")
    first = propose.rebuild_record(waits.trailers[:1], waits.seqs[:1], POLICY)
    approve(waits)
    assert queue.change(first, waits.record, False) is None
    assert queue.change(first, waits.record, False, moved=True) == queue.Write(None)
    assert queue.change(None, waits.record, False, moved=True) == queue.Write(None)
