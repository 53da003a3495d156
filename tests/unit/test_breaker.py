"""The circuit breaker's window, pure: three rollbacks inside it trip the breaker, three spread
over more than it do not (the breaker on a live daemon is in tests/integration/test_breaker.py)."""

from __future__ import annotations

from improved.core.breaker import Autonomy, after_rollback


def test_three_rollbacks_inside_the_window_trip_the_breaker():
    day = 24 * 3600 * 1000
    s = Autonomy()
    for at in (0, 5 * day, 13 * day):
        assert s.blocks(at) is None
        s = after_rollback(s, at, 3, 14, 48)
    assert s.blocks(13 * day) == "circuit_open"
    assert s.blocks(13 * day + 48 * 3600 * 1000) is None
    # spread over more than the window, three rollbacks do not trip it
    s = Autonomy()
    for at in (0, 10 * day, 20 * day):
        s = after_rollback(s, at, 3, 14, 48)
    assert s.blocks(20 * day) is None and len(s.rollbacks) == 2


def test_rollbacks_leave_the_count_as_the_window_moves_on_without_a_new_one():
    day = 24 * 3600 * 1000
    s = Autonomy()
    for at in (0, 5 * day):
        s = after_rollback(s, at, 3, 14, 48)
    assert s.rollbacks_within(5 * day, 14) == 2
    assert s.rollbacks_within(14 * day + 1, 14) == 1  # the first left the window
    assert s.rollbacks_within(19 * day + 1, 14) == 0
    assert len(s.rollbacks) == 2  # the state itself moves only with the next rollback
