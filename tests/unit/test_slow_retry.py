"""The slow retry of a given-up apply (runtime/inbound.py): a minute, doubling, up to its cap."""

from improved.runtime.inbound import slow_backoff_s


def test_the_slow_backoff_grows_to_its_cap():
    assert [slow_backoff_s(n, 300.0) for n in range(5)] == [60.0, 120.0, 240.0, 300.0, 300.0]
    assert slow_backoff_s(10_000, 300.0) == 300.0 and slow_backoff_s(0, 0.5) == 0.5
