"""Whether an L3 skill's grant is active, as its verified grant chain says — never the retained
record, never a lookup by name — read from the stream leader, so a grant revoked a moment ago is
never read as active. A grant chain only ever grows: it is read and verified whole only when
its end moved since the last whole read under the same trust.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import NamedTuple

import msgspec
from nats.js import JetStreamContext

from improved.client import chains
from improved.client.acks import Acks
from improved.core import audit
from improved.core.authority import GrantActs, grant_as_of, grant_covers
from improved.protocol import subjects as S

GRANT_MEMO_SIZE = 4096  # grant chains whose verified end each process remembers
GRANT_FRESH_S = 1.0  # how long an active grant read here stands for the next intent (not its order)


class _GrantChain(NamedTuple):
    """A grant chain as read whole from the leader: the trust it was verified under, its last
    trailer then (stream sequence, hash), the trailers (stream sequence, body), its acts
    (None: it does not verify whole), and when its end was last read (monotonic seconds)."""

    trust: audit.Authenticity | None
    end: tuple[int, str]
    chain: chains.Sequenced
    acts: GrantActs | None
    read_at: float


class GrantReads:
    """Grant chains as last read whole, by skill hash (at most GRANT_MEMO_SIZE of them)."""

    js: JetStreamContext
    acks: Acks
    _grants: OrderedDict[str, _GrantChain]

    async def grant_active(self, identity: str | None, now_ms: int,
                           trust: audit.Authenticity | None = None, *,
                           fresh: bool = False) -> bool:
        """An active, unexpired grant for exactly `<name>:<sha256>`, as its verified grant
        chain says (never the retained record, never a lookup by name), read from the stream
        leader. A chain this process read and verified within GRANT_FRESH_S, active then, is
        taken as it was without reading its end again: this read only lets an L3 record its
        intent, and the intent is judged again from the leader as of its own stream sequence
        (`grant_active_as_of`) before its order is sent, so a grant revoked a moment ago
        withdraws the intent and sends nothing. A grant not active then is read again, and
        so is every grant with `fresh` (what decides an order's retry)."""
        memo = self._grants.get(identity.split(":", 1)[1]) \
            if identity and ":" in identity and not fresh else None
        if memo is not None and memo.trust is trust and memo.acts \
                and time.monotonic() - memo.read_at < GRANT_FRESH_S:
            grant = grant_as_of(memo.acts)
            if grant is not None and identity is not None and grant_covers(grant, identity,
                                                                           now_ms):
                return True
        read = await self._grant_chain(identity, trust)
        grant = grant_as_of(read.acts) if read is not None and read.acts else None
        return (grant is not None and identity is not None
                and grant_covers(grant, identity, now_ms))

    async def grant_active_as_of(self, identity: str | None, seq: int, at: int,
                                 trust: audit.Authenticity | None = None) -> bool:
        """Was the grant of exactly `<name>:<sha256>` active as of stream sequence `seq` of the
        audit stream — only the grant chain's acts recorded below `seq` count — and unexpired
        at `at`? Whether the intent at `seq` (recorded at `at`) stands. Asked after that
        intent's append was acknowledged, so the read from the leader sees every act below it,
        and judged on the chain's trailers below `seq` alone: whatever lands later (a revoke,
        or a trailer that does not verify) changes no verdict already given on it."""
        read = await self._grant_chain(identity, trust)
        if read is None or identity is None:
            return False
        acts = read.acts
        if acts is None:  # a break somewhere: what stood below `seq` is what its prefix says
            acts = chains.verified_acts(identity, [t for t in read.chain if t[0] < seq], trust)
        grant = grant_as_of(acts, seq) if acts else None
        return grant is not None and grant_covers(grant, identity, at)

    async def _grant_chain(self, identity: str | None,
                           trust: audit.Authenticity | None) -> _GrantChain | None:
        """The grant chain of `identity` read from the leader and verified under `trust`;
        None for a bad identity or no chain. It is read and verified whole only when its last
        trailer (one read) is not the one it ended with at the last whole read under the same
        trust: a grant chain only ever grows, so a verified prefix stays verified, and one read
        of its end, made now, says whether anything was added since."""
        subject = chains.grant_chain_subject(identity)
        if subject is None or identity is None:
            return None
        sha = identity.split(":", 1)[1]
        last = await self.acks.last(S.STREAM_AUDIT, subject)
        if last is None:
            return None
        now = time.monotonic()
        body = audit.trailers_in(msgspec.json.decode(last.data or b"{}"))[-1]
        end = (last.seq, body.get("hash", "") if isinstance(body, dict) else "")
        memo = self._grants.get(sha)
        if memo is not None and memo.trust is trust and memo.end == end:
            self._grants[sha] = memo = memo._replace(read_at=now)
            self._grants.move_to_end(sha)
            return memo
        chain = await chains.read_from_leader(self.js, subject)
        read = _GrantChain(trust, end, chain, chains.verified_acts(identity, chain, trust), now)
        self._grants[sha] = read
        while len(self._grants) > GRANT_MEMO_SIZE:
            self._grants.popitem(last=False)
        return read
