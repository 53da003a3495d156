"""Observe's analyzers, pure (core/observe.py): a window stays bounded however many signals a bus
participant sends about one target, the analyzers still find what they are for, a window folded
by two replicas in any order proposes one id, a redelivered signal makes the same candidate
again, and a learned weight counts each trailer once."""

from __future__ import annotations

import itertools

from improved.core import observe, propose
from improved.core.observe import (
    Counts,
    Observer,
    RegressionAnalyzer,
    StaleSkillAnalyzer,
)
from improved.protocol.model import Signal

T0 = 1_000_000


def negative(target: str, actor: str, at: int, kind: str = "metric", **over) -> Signal:
    return Signal(kind=kind, actor=actor, service="svc", positive=False, at=at,
                  target_ref=target, name=over.pop("name", "ctr"), value=0.1, **over)


def fold(analyzer, signals, windows=None):
    """Step `analyzer` through `signals` as the shell does, one window per target; the
    candidates made, and the windows as stored (encoded and decoded again)."""
    windows = {} if windows is None else windows
    found = []
    for sig in signals:
        target = analyzer.target("svc", sig)
        if target is None:
            continue
        window = observe.decode(windows.get(target), observe.EMPTY)
        new, candidates = analyzer.step("svc", window, sig)
        if new != window:
            windows[target] = observe.encode(new)
        found += candidates
    return found, windows


def observed(observer: Observer, signals, windows=None, counts=None):
    """What `observer` proposes after each of `signals`, its windows kept as the shell keeps
    them (one per analyzer and target) and ranked by `counts`."""
    windows = {} if windows is None else windows
    out = []
    for sig in signals:
        found = [(a.id, c) for a in observer.analyzers
                 for c in fold(a, [sig], windows.setdefault(a.id, {}))[0]]
        out.append(observer.rank(found, counts or {}))
    return out


def test_the_regression_analyzer_needs_distinct_sessions_within_its_window():
    observer = Observer([RegressionAnalyzer(threshold=3, window_ms=1000)])

    def neg(actor, at):
        return Signal(kind="metric", actor=actor, service="watch", positive=False, at=at,
                      target_ref="rank:a", name="ctr")

    windows: dict = {}
    # one session three times is no regression; a second session, then a third outside the
    # window of the first, still not enough; a third session inside the window of the others
    *nothing, proposals = observed(observer, [
        neg("mcp:a:1", 10), neg("mcp:a:2", 20), neg("mcp:a:3", 30),
        neg("mcp:b:1", 40), neg("mcp:c:1", 5000),
        neg("mcp:d:1", 5100), neg("mcp:e:1", 5200)], windows)
    assert nothing == [[]] * 6 and len(proposals) == 1
    p = proposals[0]
    assert (p.change_class, p.target_ref, p.service) == ("L1", "rank:a", "svc")
    # deterministic: the same signals give the same proposal (same id on every replica)
    again = observed(observer, [neg("mcp:c:1", 5000), neg("mcp:d:1", 5100),
                                neg("mcp:e:1", 5200)])
    assert again[-1] == proposals
    # positive signals are ignored
    assert observed(observer, [Signal(kind="metric", actor="mcp:z:1", service="w",
                                      positive=True, at=1, target_ref="rank:a")], windows) == [[]]


def test_stale_skills_are_proposed_for_archival_and_a_success_resets_them():
    def outcome(actor, positive, at):
        return Signal(kind="refine", actor=actor, service="agents", positive=positive, at=at,
                      target_ref="skill:summarize")

    observer = Observer([StaleSkillAnalyzer(threshold=3)])
    *nothing, [p] = observed(observer, [
        outcome("mcp:a:1", False, 1), outcome("mcp:b:1", False, 2),
        outcome("mcp:c:1", True, 3),  # success: not stale
        outcome("mcp:d:1", False, 4), outcome("mcp:e:1", False, 5),
        outcome("mcp:f:1", False, 6)])
    assert nothing == [[]] * 5
    assert (p.change_class, p.target_ref, p.proposal_data) == (
        "L2", "skill:summarize", {"archive": "summarize"})
    assert propose.render_summary(p.summary.template_id, p.summary.args) == \
        "archive skill summarize after 3 negative outcomes"


def test_learned_weights_order_candidates_and_never_keep_one_back():
    """The counts live in a bucket anyone on an open bus may rewrite: they order what the
    evidence calls for, never silence it."""
    regress, stale = RegressionAnalyzer(threshold=3), StaleSkillAnalyzer(threshold=3)
    observer = Observer([regress, stale])
    counts = {regress.id: Counts(rejected=3),  # operators kept rejecting its proposals
              stale.id: Counts(accepted=1)}
    assert observe.weight(counts[regress.id]) == 0.2
    assert observe.weight(counts[stale.id]) == 2 / 3
    assert observer.knows(stale.id) and not observer.knows("someone.else/1")

    def neg(actor, at, ref, kind="metric"):
        return Signal(kind=kind, actor=actor, service="w", positive=False, at=at,
                      target_ref=ref, name="ctr")

    # three sessions make a candidate: 3 x 0.2 is below the threshold of 1.0, and it is
    # proposed all the same; so it is under a weight rewritten to next to nothing
    sessions = ("mcp:a:1", "mcp:b:1", "mcp:c:1")
    for said in (counts, {regress.id: Counts(rejected=10**9)}):
        [proposed] = observed(observer, [neg(a, i, "rank:a") for i, a in enumerate(sessions)],
                              counts=said)[-1]
        assert proposed.analyzer.id == regress.id and proposed.change_class == "L1"
    # two candidates at once: the analyzer operators accepted more often comes first
    found = [(a.id, c) for a in (regress, stale) for c in fold(
        a, [neg(s, i, "skill:sum", kind="check" if a is stale else "metric")
            for i, s in enumerate(sessions)], {})[0]]
    assert [p.analyzer.id for p in observer.rank(found, counts)] == [stale.id, regress.id]
    # below the threshold by its own evidence: nothing, whatever the weight
    weak = [(aid, observe.Candidate(c.proposal, 0.5)) for aid, c in found]
    assert observer.rank(weak, {regress.id: Counts(accepted=10**9)}) == []


def test_one_target_flooded_keeps_only_the_newest_signals():
    stale = StaleSkillAnalyzer(threshold=10**9)  # never fires: only the window is measured
    flood = [negative("skill:s", f"mcp:a{i}:1", T0 + i, kind="check")
             for i in range(observe.MAX_PER_TARGET * 4)]
    _, windows = fold(stale, flood)
    kept = observe.decode(windows["skill:s"], observe.EMPTY).signals
    assert len(kept) == observe.MAX_PER_TARGET and kept[-1].at == flood[-1].at


def test_a_window_of_large_signals_stays_within_its_bytes():
    """Signals as large as the contract allows (a 1 KiB target, the longest actor and name):
    the window keeps the newest that fit MAX_WINDOW_BYTES, fewer than MAX_PER_TARGET."""
    stale = StaleSkillAnalyzer(threshold=10**9)
    target = "skill:" + "x" * 1000
    flood = [negative(target, f"mcp:{'a' * 120}{i:08}:{'b' * 128}", T0 + i, kind="check",
                      name="n" * 128) for i in range(observe.MAX_PER_TARGET)]
    _, windows = fold(stale, flood)
    kept = observe.decode(windows[target], observe.EMPTY).signals
    assert len(windows[target]) <= observe.MAX_WINDOW_BYTES + 64
    assert 0 < len(kept) < observe.MAX_PER_TARGET and kept[-1] == flood[-1]


def test_a_regression_is_still_found_among_the_flood():
    noise = [negative(f"rank:noise{i}", "mcp:n:1", T0) for i in range(2_000)]
    real = [negative("rank:real", f"mcp:s{s}:1", T0 + s) for s in range(3)]
    found, windows = fold(RegressionAnalyzer(), noise + real)
    assert len(found) == 1 and found[0].proposal.change_class == "L1"
    assert observe.decode(windows["rank:real"], observe.EMPTY).signals == ()  # spent


def test_signals_older_than_the_window_do_not_count():
    regression = RegressionAnalyzer(window_ms=1_000)
    late = [negative("rank:t", "mcp:a:1", T0), negative("rank:t", "mcp:b:1", T0 + 1),
            negative("rank:t", "mcp:c:1", T0 + 5_000)]
    assert fold(regression, late)[0] == []


def test_two_replicas_folding_in_any_order_propose_one_id():
    """Whichever replica steps which signal, in whatever order they reach the shared window,
    the candidate is the same proposal: it is a function of its evidence alone."""
    sigs = [negative("rank:t", f"mcp:s{i}:1", T0 + i, name=f"m{i}") for i in range(3)]
    ids = set()
    for order in itertools.permutations(sigs):
        found, _ = fold(RegressionAnalyzer(), order)
        assert len(found) == 1
        assert found[0].proposal.summary.args["metric"] == "m2"  # the newest evidence names it
        ids.add(propose.identify(found[0].proposal)[0])
    assert len(ids) == 1


def test_a_redelivered_signal_makes_the_same_candidate_again():
    """The shell writes the window, then proposes; stopped in between, the signal comes again
    and must make the same candidate (the same proposal id), and a new signal must not."""
    for analyzer, kind, target in ((RegressionAnalyzer(), "metric", "rank:t"),
                                   (StaleSkillAnalyzer(), "check", "skill:s")):
        sigs = [negative(target, f"mcp:s{i}:1", T0 + i, kind=kind) for i in range(3)]
        (first,), windows = fold(analyzer, sigs)
        for again in sigs:  # any of its evidence, delivered again
            (same,), _ = fold(analyzer, [again], dict(windows))
            assert same.proposal == first.proposal
        fresh = negative(target, "mcp:s9:1", T0 + 9, kind=kind)
        assert fold(analyzer, [fresh], dict(windows))[0] == []


def test_a_success_clears_a_stale_skills_window():
    stale = StaleSkillAnalyzer()
    two = [negative("skill:s", f"mcp:s{i}:1", T0 + i, kind="check") for i in range(2)]
    ok = Signal(kind="check", actor="mcp:ok:1", service="svc", positive=True, at=T0 + 5,
                target_ref="skill:s")
    third = negative("skill:s", "mcp:s3:1", T0 + 6, kind="check")
    assert fold(stale, [*two, ok, third])[0] == []
    assert len(fold(stale, [*two, third])[0]) == 1


def test_a_stored_window_that_does_not_decode_is_an_empty_one():
    assert observe.decode(b"{not json", observe.EMPTY) == observe.EMPTY
    assert observe.decode(b'{"signals": [{"kind": "nope"}]}', observe.EMPTY) == observe.EMPTY
    assert observe.decode(b"[]", observe.NO_COUNTS) == observe.NO_COUNTS


def test_a_trailer_counts_once_toward_its_analyzers_weight():
    counts = Counts()
    counts = observe.counted(counts, "h1", True)
    assert observe.counted(counts, "h1", True) is None  # a retried write counts nothing
    counts = observe.counted(counts, "h2", False)
    assert (counts.accepted, counts.rejected) == (1, 1)
    assert observe.weight(counts) == 0.5 and observe.weight(Counts()) == 0.5
    for i in range(observe.MAX_COUNTED * 2):
        counts = observe.counted(counts, f"x{i}", True)
    assert len(counts.counted) == observe.MAX_COUNTED  # bounded, whatever the history
    assert counts.accepted == 1 + observe.MAX_COUNTED * 2
