"""The knowledge store's core, pure: a CAL batch's inverse, replayed, gives back exactly the
grains recall returned before; the inverse of that replay re-applies the batch; quotas,
capabilities and the namespace are checked before anything is written."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from improved.protocol import cal
from improved_reference import knowledge as K

NS = "agent:recommendations"
T0 = 1_768_471_200_000
PID = "ab" * 32

SUBJECTS = st.sampled_from(["user:jo", "user:al"])
OBJECTS = st.sampled_from(["tea", "coffee", "water", "juice"])


def add(subject: str, obj: str) -> str:
    return (f'ADD fact SET subject = "{subject}" SET relation = "prefers" SET object = "{obj}" '
            'REASON "seen"')


def run(state, text: str, now: int):
    return K.execute(state, cal.parse(text), NS, now, PID)


@st.composite
def histories(draw):
    """A namespace built by a few batches, and one more batch to apply on top of it."""
    state, now = K.empty(), T0
    for _ in range(draw(st.integers(1, 4))):
        state = run(state, add(draw(SUBJECTS), draw(OBJECTS)), now).state
        now += 1000
    live = sorted(K.live(state))
    kind = draw(st.sampled_from(["add", "supersede", "where", "revert"]))
    if kind == "add":
        batch = add(draw(SUBJECTS), draw(OBJECTS)) + "\n" + add(draw(SUBJECTS), draw(OBJECTS))
    elif kind == "supersede":
        target = draw(st.sampled_from(live))
        batch = f'SUPERSEDE sha256:{target} SET object = "{draw(OBJECTS)}x" REASON "fix"'
    elif kind == "where":
        batch = (f'SUPERSEDE facts WHERE subject = "{draw(SUBJECTS)}" AND relation = "prefers" '
                 'SET object = "merged" REASON "merge"')
    else:
        target = draw(st.sampled_from(live))
        state = run(state, f'SUPERSEDE sha256:{target} SET object = "v2" REASON "v2"', now).state
        now += 1000
        head = next(h for h, e in state["index"].items() if e.get("supersedes") == [target])
        batch = f'REVERT sha256:{head} REASON "back"'
    return state, batch, now


@settings(max_examples=200, deadline=None)
@given(histories())
def test_the_inverse_replays_to_the_grains_before_and_its_inverse_reapplies(history):
    state, batch, now = history
    try:
        done = run(state, batch, now)
    except K.Refused as exc:  # a WHERE that matches nothing, or the same ADD twice in a batch
        assert "E046" in str(exc) or "stored already" in str(exc)
        return
    assert all(step["target"] for step in done.inverse)
    undone = K.replay(done.state, done.inverse, NS, now + 1)
    assert sorted(K.live(undone.state)) == sorted(K.live(state))
    redone = K.replay(undone.state, undone.inverse, NS, now + 2)
    assert sorted(K.live(redone.state)) == sorted(K.live(done.state))
    assert set(done.state["grains"]) == set(redone.state["grains"])  # nothing is deleted


def test_a_stale_inverse_is_refused_and_nothing_is_written():
    first = run(K.empty(), add("user:jo", "tea"), T0)
    [grain] = K.live(first.state)
    later = run(first.state, f'SUPERSEDE sha256:{grain} SET object = "x" REASON "later"', T0 + 1)
    with pytest.raises(K.Refused, match="not the head"):
        K.replay(later.state, first.inverse, NS, T0 + 2)


def test_quotas_count_per_minute_per_verb():
    state = K.empty()
    for i in range(K.MAX_ADD_PER_MINUTE):
        state = run(state, add("user:jo", f"o{i}"), T0 + i).state
    with pytest.raises(K.Refused, match="E052 AddQuotaExceeded"):
        run(state, add("user:jo", "one more"), T0 + 100)
    assert run(state, add("user:jo", "one more"), T0 + K.QUOTA_WINDOW_MS).written
    reverts = "\n".join(f'REVERT sha256:{"0" * 8} REASON "r{i}"' for i in range(6))
    with pytest.raises(K.Refused, match="MAX_REVERT_PER_MINUTE = 5"):
        run(state, reverts, T0 + 100)


@pytest.mark.parametrize(("principal", "namespace", "may"), [
    ("operator:alice", NS, True), ("policy:auto", "user:jo", True),
    ("mcp:curator:1", NS, False), ("curator.duplicate_sweep/1", NS, False),
])
def test_only_approvers_hold_a_capability_by_default(principal, namespace, may):
    assert K.may_write(principal, namespace, K.DEFAULT_WRITERS) is may


def test_a_namespace_condition_elsewhere_is_a_write_outside():
    state = run(K.empty(), add("user:jo", "tea"), T0).state
    with pytest.raises(K.Refused, match="E045"):
        run(state, 'SUPERSEDE facts WHERE namespace = "other" SET object = "x" REASON "x"',
            T0 + 1)
