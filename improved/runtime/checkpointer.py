"""Signed checkpoints of the audit log (constitution V.4) and the sealing of its epochs: each
checkpoint verifies what the log gained since the last one, carries the Merkle frontier and
the members of each index on, and is kept in the data directory too, so a lost stream cannot
take what it covered with it. A break opens a crisis on the autonomy chain instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from improved.client import anchor as anchor_file
from improved.client import archive as archive_read
from improved.client import checkpointing, indexing, tool_chains
from improved.client.config import Config
from improved.client.streams import NeedsProvision
from improved.core import checkpoint as checkpoints
from improved.core.epochs import Seal
from improved.protocol import subjects as S
from improved.runtime import anchor as anchor_write
from improved.runtime import archive
from improved.runtime.autonomy import AutonomyChain
from improved.runtime.clock import now_ms
from improved.runtime.metrics import Metrics
from improved.runtime.store import Store
from improved.runtime.trusting import TrustInForce

log = structlog.get_logger("improved.engine")

WITNESS_TIMEOUT_S = 2.0  # how long a checkpoint waits for the runtime chains' heads
WITNESS_RETRY_MS = 3600 * 1000  # after a failed read of them, when to try again


class Checkpointer:
    """This process's checkpoints: one at a time, and what the last one covered and counted."""

    def __init__(self, nc: Client, store: Store, config: Config, actor: str,
                 trust: TrustInForce, autonomy: AutonomyChain, metrics: Metrics):
        self.nc = nc
        self.store = store
        self.config = config
        self.policy = config.policy
        self.actor = actor
        self.trust = trust
        self.autonomy = autonomy
        self.metrics = metrics
        metrics.set_checkpoint_interval(config.checkpoint_interval_s)
        self.checkpoint_read = 0  # trailers the last checkpoint read: what was new, not the log
        self.checkpointed_to = 0  # the stream sequence this process's last checkpoint covered
        self._witness_retry_at = 0  # when to try reading the runtime chains' heads again
        self._checkpointing = asyncio.Lock()  # one checkpoint at a time in this process
        # the members of each index as the last checkpoint this process signed counted them
        self.counted: indexing.Counted | None = None
        self._recount = False  # count them from the chains at the next checkpoint

    async def checkpoint(self, key: Ed25519PrivateKey,
                         count_limit: int | None = None) -> str | None:
        """Verify what the log gained since the last checkpoint — every new trailer in its
        chain, every checkpoint met on the way, and in O(1) that the stream still holds what
        the last one (on the stream or kept in the data directory) covered — then sign a new
        checkpoint that carries its Merkle frontier on, and the members of each index
        (`core.indexes`: the last one's counts and the index refs of what is new), and keep it
        in the data directory too (`client.checkpointing`). The cost follows what is new,
        not the history; only a first checkpoint reads the whole log, and only one whose base
        has no counts (the first after an upgrade) counts the members from the chains after
        the last seal — unless that is more than `count_limit` trailers: it is then signed
        without counts (`counted` says so), for a later one to count. On a break, enter crisis
        instead (recorded on the autonomy chain and in the data directory, so a lost stream
        cannot take the crisis with it); return the break."""
        async with self._checkpointing:
            try:
                problem = await self._checkpoint(key, count_limit)
            except Exception:
                self.metrics.checkpoint("failed")
                raise
            if problem is not None:
                self.metrics.checkpoint("broken")
            elif self.counted is not None:  # set by the checkpoint just signed
                self.metrics.checkpoint("verified", self.counted.at)
            return problem

    async def _checkpoint(self, key: Ed25519PrivateKey, count_limit: int | None) -> str | None:
        path = anchor_file.path_in(self.config.data_dir)
        problems: list[str] = []
        try:  # before the stream: whatever it covered was on the stream before it was written
            kept = anchor_file.read(path)
        except ValueError as exc:
            kept, problems = None, [f"the checkpoint kept in the data directory cannot be "
                                    f"read: {exc}"]
        written = set(self.store.written)  # what this process appended, as the log is read
        view = await self.store.audit_view()
        if view.created is None:  # deleted under a running daemon: bring it back to say so
            try:
                await self.store.ensure()
                view = await self.store.audit_view()  # new: no anchor's stream any more
            except NeedsProvision as exc:  # the crisis is kept in the data directory anyway
                log.error("the audit stream is gone and this user may not re-create it",
                          error=str(exc))
        crisis = kept.crisis if kept else ""
        if crisis and await self.autonomy.resolved(crisis):
            crisis, kept = "", None  # an operator accepted the log as it is: the new baseline
        trusted = self.trust.trusted_daemons(key)
        since, scrubbed, seal, covered = None, 0, None, 0
        if view.created is not None:
            seal, unsealed = await archive_read.last_seal(self.store, trusted)
            problems += [unsealed] if unsealed else []
            base, claims, found = await checkpointing.choose_base(
                self.store, kept, view, self.trust.chain_trust, trusted,
                seal.removable if seal else 0)
            problems += found
            covered = base.count
            if not problems:
                # what the base covers was fully verified before it was signed
                trust = dataclasses.replace(self.trust.chain_trust, covered_to=base.last_seq)
                since = await checkpointing.verify_since(self.store, base, view, trust,
                                                         trusted, claims, archived=seal)
                problems += since.problems
                # an archived epoch is the export's to scrub
                scrubbed, damaged = await checkpointing.scrub(
                    self.store, max(kept.scrubbed_to if kept else 0, seal.upto if seal else 0),
                    base.last_seq, max(checkpointing.SCRUB_SLICE, since.read))
                problems += damaged
        else:
            problems.append(checkpoints.prefix_problem(kept or checkpointing.empty_base(view),
                                                      view, None) or "")
        if crisis and not problems:
            problems = [f"{crisis} is still open (kept in {path}) until an operator resolves it"]
        now = now_ms()
        if problems or since is None:
            await self.autonomy.crisis(problems, crisis, kept, view, path, now)
            return "; ".join(problems)
        members = await self._members(since, seal, count_limit, first=covered == 0)
        cp = checkpoints.make_from(since.tree.frontier(), since.tree.count, since.last_seq,
                                  since.last_hash, now, key, await self._runtime_heads(now),
                                  members)
        await self.store.append_sealed(
            checkpointing.CP_SUBJECT, checkpoints.CHECKPOINT_ID, "L0", "operation",
            lambda chain, at: checkpoints.draft(cp, self.actor), clock=lambda: now)
        anchor = checkpoints.anchor_of(cp, view.created or "", scrubbed_to=scrubbed)
        anchor_write.write(path, anchor)
        self.autonomy.keep(anchor, trusted, seal.removable if seal else 0)
        self.trust.cover(cp.last_seq)
        self.store.written.difference_update(written)  # the checkpoint vouches for them now
        self.checkpoint_read = since.read
        log.info("checkpoint signed", trailers=cp.count, root=cp.root, read=since.read,
                 **({"members": members} if members is not None else {}))
        self.checkpointed_to = cp.last_seq
        self.counted = indexing.Counted(cp.last_seq, cp.at, members)
        return None

    async def _members(self, since: checkpointing.Since, seal: Seal | None,
                       count_limit: int | None, first: bool) -> dict[str, int] | None:
        """The members of each index as of `since.last_seq`: carried on from the base's
        counts, or — when the base has none (`first`: there is no base, the log's first
        checkpoint), or the last index check found the counts off the chains (`recount`) —
        counted from the chains after the last seal, at most `count_limit` trailers of them
        (None: more; the checkpoint goes without)."""
        members = since.members
        if members is not None and not self._recount and min(members.values(), default=0) >= 0:
            return members
        start = seal.upto + 1 if seal is not None else 1
        if count_limit is not None and since.last_seq - start + 1 > count_limit:
            return None
        say = log.info if first else log.warning
        say("counting the members of the indexes from the audit chains, once: the log's first "
            "checkpoint" if first else "counting the members of the indexes from the audit "
            "chains, once: the last checkpoint has no counts to carry on" if members is None
            else "counting the members of the indexes from the audit chains again: the last "
            "counts were off the chains", from_seq=start, to_seq=since.last_seq)
        started = time.perf_counter()
        records, _ = await indexing.from_chains(self.store, start, since.last_seq, None,
                                                self.policy)
        counts = indexing.counts_of(records)
        log.info("index members counted from the chains", members=counts,
                 seconds=round(time.perf_counter() - started, 2))
        self._recount = False
        return counts

    def recount(self) -> None:
        """Count the index members from the chains at the next checkpoint: the last counts
        did not match what the chains say (an index check found it)."""
        self._recount = True

    async def _runtime_heads(self, now: int) -> tuple[checkpoints.RuntimeHead, ...]:
        """The tool runtimes' chain heads for the checkpoint to witness — for `improved audit
        verify` to tell a runtime chain removed or cut short — or none. A witness only: this
        daemon decides nothing by them, and nothing about them stops a checkpoint. A user
        that may not read IMPROVE_TOOLS_AUDIT (the server drops the request, so it times out)
        records none, and is asked again only after WITNESS_RETRY_MS."""
        if now < self._witness_retry_at:
            return ()
        try:
            return await asyncio.wait_for(tool_chains.runtime_heads(self.nc),
                                          WITNESS_TIMEOUT_S)
        except NotFoundError:  # no such stream (yet): no runtime chain to witness
            return ()
        except Exception as exc:
            self._witness_retry_at = now + WITNESS_RETRY_MS
            log.info("the tool runtimes' chain heads were not witnessed",
                     stream=S.STREAM_TOOLS_AUDIT, error=f"{type(exc).__name__}: {exc}")
            return ()

    async def seal_if_due(self, key: Ed25519PrivateKey) -> None:
        """Seal the next epoch of the log, up to what the last checkpoint of this process
        verified, when it is due (`runtime.archive`). It reads the epoch, so it runs after a
        periodic checkpoint, never on the way to ready or out; a failure is logged and tried
        again after the next checkpoint."""
        if not self.checkpointed_to:
            return
        settings = self.config.audit
        try:
            await archive.seal_if_due(self.store, key, self.actor, self.checkpointed_to,
                                      now_ms(), settings.epoch_trailers, settings.epoch_hours,
                                      settings.retention_days, self.trust.trusted_daemons(key))
        except Exception as exc:  # the log is whole; sealing can wait for the next one
            log.warning("could not seal the epoch", error=f"{type(exc).__name__}: {exc}")
