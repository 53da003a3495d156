"""The shell of stage 1: the analyzers' windows and weights, kept in JetStream so that every
replica of the daemon folds its share of the signals into the same windows and ranks by the
same weights, and a restart loses neither.

Windows (KV `improved_windows`, one key per analyzer, service and target, `subjects.window_key`):
read, stepped by the pure analyzer (`core.observe`), written back with compare-and-set (created
when absent, else updated at the revision read; a key this replica has not met lately is most
likely new, and is tried as a create without the read); a replica that loses the race reads
what won and steps again, so a signal is folded into the window exactly as if one process had
seen them all. The window is written before its candidates go on the bus; should the daemon stop in
between, the signal is delivered again, and the window, which keeps the evidence of its last
candidate, makes the same candidate again (same evidence, same proposal id; enqueueing it twice
is one proposal).

Weights (KV `improved_learned`, one key per analyzer id): the counts of its proposals accepted
and rejected, updated with compare-and-set by the replica that commits the approve, apply or
reject trailer (`Engine._commit`: a trailer is committed by exactly one replica, once, since the
chain append is exclusive). The only way to count a trailer twice is to retry a write that
landed without its acknowledgement; the counts keep the hashes of the last trailers counted and
a retry finds its own there (`core.observe.counted`). Why a counter rather than the chains
themselves: counting the approve and reject trailers at every ranking would be exact, but its
cost grows with the history; the counter costs one read and one write per approve, apply or
reject of an analyzer's proposal, whatever the history, and the hashes it keeps name the
trailers it counted. The reverse gap — a daemon stopped between its chain append and this
write — loses that one count: the weight is a ranking hint, never an input to authority, and
could be recounted from those trailers (nothing does so yet).

Neither bucket is read by anything but the analyzers; what they lead to is a proposal, which
meets every guard and gate as any other does.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Final

import structlog

from improved.core import observe
from improved.core.observe import Candidate, Counts, Observer, Window
from improved.protocol import subjects as S
from improved.protocol.model import Proposal, Signal

if TYPE_CHECKING:
    from improved.runtime.store import Store

log = structlog.get_logger("improved.observe")

KNOWN_KEYS: Final = 20_000  # window keys remembered as existing (a few MB)


class Observing:
    """Stage 1 against the shared buckets of `store` (opened by `Store.ensure`)."""

    def __init__(self, store: Store, observer: Observer):
        self.store = store
        self.observer = observer
        # windows this process read or wrote lately: any other is most likely new, so its
        # first write is tried as a create without a read (a conflict reads and steps again)
        self._known: OrderedDict[str, None] = OrderedDict()

    async def observe(self, svc: str, signal: Signal) -> list[Proposal]:
        """Fold `signal` into every window it concerns; the candidates to propose, best first."""
        found: list[tuple[str, Candidate]] = []
        for analyzer in self.observer.analyzers:
            target = analyzer.target(svc, signal)
            if target is None:
                continue

            def step(current: bytes | None, analyzer: observe.Analyzer = analyzer
                     ) -> tuple[bytes | None, list[Candidate]]:
                window: Window = observe.decode(current, observe.EMPTY)
                new, candidates = analyzer.step(svc, window, signal)
                return (None if new == window else observe.encode(new)), candidates

            key = S.window_key(analyzer.id, svc, target)
            made, _ = await self.store.compare_and_set(
                self.store.windows, S.BUCKET_WINDOWS, key, step, absent=key not in self._known)
            found += [(analyzer.id, c) for c in made]
            self._known[key] = None
            self._known.move_to_end(key)
            while len(self._known) > KNOWN_KEYS:
                self._known.popitem(last=False)
        if not found:
            return []
        counts = {aid: await self.counts(aid) for aid in {aid for aid, _ in found}}
        return self.observer.rank(found, counts)

    async def counts(self, analyzer_id: str) -> Counts:
        """What operators made of this analyzer's proposals so far, as every replica sees it."""
        data, _ = await self.store.kv_read(self.store.learned, S.BUCKET_LEARNED, analyzer_id)
        return observe.decode(data, observe.NO_COUNTS)

    async def weight(self, analyzer_id: str) -> float:
        return observe.weight(await self.counts(analyzer_id))

    async def learn(self, analyzer_id: str, accepted: bool, trailer_hash: str) -> None:
        """Count the committed trailer `trailer_hash` for its proposal's analyzer, once. A
        failure is logged, never raised: the transition is committed whatever its count."""
        if not self.observer.knows(analyzer_id):
            return

        def count(current: bytes | None) -> tuple[bytes | None, None]:
            new = observe.counted(observe.decode(current, observe.NO_COUNTS), trailer_hash, accepted)
            return (None if new is None else observe.encode(new)), None

        try:
            await self.store.compare_and_set(self.store.learned, S.BUCKET_LEARNED, analyzer_id,
                                             count)
        except Exception as exc:
            log.warning("could not count a decision toward its analyzer's weight",
                        analyzer=analyzer_id, trailer=trailer_hash, accepted=accepted,
                        error=f"{type(exc).__name__}: {exc}")
