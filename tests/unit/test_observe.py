"""Observe's analyzers under pressure (core/observe.py): what they remember stays bounded
however many distinct targets and signals a bus participant sends, and the analyzers still find
what they are for."""

from __future__ import annotations

from improved.core import observe
from improved.core.observe import RegressionAnalyzer, StaleSkillAnalyzer
from improved.protocol.model import Signal

T0 = 1_000_000


def negative(target: str, actor: str, at: int, kind: str = "metric") -> Signal:
    return Signal(kind=kind, actor=actor, service="svc", positive=False, at=at,
                  target_ref=target, name="ctr", value=0.1)


def test_distinct_targets_never_grow_the_memory_past_its_bound():
    regression, stale = RegressionAnalyzer(), StaleSkillAnalyzer()
    for i in range(observe.MAX_TRACKED * 3):
        regression.observe("svc", negative(f"rank:t{i}", f"mcp:a{i}:1", T0 + i))
        stale.observe("svc", negative(f"skill:s{i}", f"mcp:a{i}:1", T0 + i, kind="check"))
    assert len(regression._seen) == observe.MAX_TRACKED
    assert len(stale._negatives) == observe.MAX_TRACKED


def test_one_target_flooded_keeps_only_the_newest_signals():
    stale = StaleSkillAnalyzer(threshold=10**9)  # never fires: only the memory is measured
    for i in range(observe.MAX_PER_TARGET * 4):
        stale.observe("svc", negative("skill:s", f"mcp:a{i}:1", T0 + i, kind="check"))
    kept = stale._negatives[("svc", "skill:s")]
    assert len(kept) == observe.MAX_PER_TARGET and kept[-1].at == T0 + observe.MAX_PER_TARGET * 4 - 1


def test_a_regression_is_still_found_among_the_flood():
    regression = RegressionAnalyzer()
    for i in range(observe.MAX_TRACKED * 2):
        regression.observe("svc", negative(f"rank:noise{i}", "mcp:n:1", T0))
    found = []
    for s in range(3):
        found += regression.observe("svc", negative("rank:real", f"mcp:s{s}:1", T0 + s))
    assert len(found) == 1 and found[0].proposal.change_class == "L1"
