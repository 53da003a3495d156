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
