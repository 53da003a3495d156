"""Shared machinery of the crash, fault and fuzz suites: daemon processes that can be killed,
paced publishers that retry until JetStream acknowledges, a proposal mix with known outcomes,
and one "settle and check" of every loop invariant.

`settle_and_check` is the single judge: given a connection, the (service, proposal id, expected
final status) of every acknowledged proposal and the reference RankingStore(s), it waits until
the loop is quiet and then asserts that
- every acknowledged proposal has its retained ProposalState with the expected status (L0
  `applied` with an ok ApplyOutcome, L2 `pending` deferred `awaiting_operator`, the others
  `rejected` with their cause), and a chain;
- every chain verifies (`audit.verify_chain`), its seq is contiguous, it has one `propose`
  trailer, one decision per triage event, at most one `applied` trailer, no repeated trailer,
  and the status folded from it alone is the expected one;
- nothing was applied twice: the RankingStore's ledger holds each L0 id once (complete) and
  no other, and its values stream has exactly one write tagged with each L0 id;
- no chain exists for the service that nobody published.
It returns the figures the tests print.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal as signals
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from improved.core import audit
from improved.core.policy import Policy
from improved.core.propose import rebuild_record
from improved.protocol import subjects as S
from improved.protocol.model import Proposal, to_json
from improved.runtime.audit_log import trailer_decoder
from improved.runtime.store import Store
from improved_reference.kv_service import PROVENANCE
from improved_reference.ranking_store import RankingStore
from tests.factories import rank_proposal, skill_proposal

READY = "improved: ready as"
FORBIDDEN = ["notes/../_spec/2026-04-20-00-constitution.md"]

# The invariants' failure messages name at most this many problems.
SHOWN = 25
# Unsettled proposals, an idle consumer, nothing moving for this long: it will not settle.
STUCK_S = 10.0
# Unsettled proposals, nothing settling for this long although messages are held: give up
# (longer than the consumer's 30 s ack wait plus a few backoffs).
STALLED_S = 90.0


# -- daemon processes --------------------------------------------------------------------------


def write_config(path: Path, replicas: int = 1, timeout_s: float = 2.0, attempts: int = 3,
                 max_deliveries: int = 8) -> Path:
    # the replicas sharing this config sign checkpoints with one key, so each trusts the others'
    key = path.with_suffix(".checkpoint.pem")
    path.write_text(f"replicas = {replicas}\ncheckpoint_key = \"{key}\"\n\n[apply]\n"
                    f"timeout_s = {timeout_s}\nattempts = {attempts}\n"
                    f"max_deliveries = {max_deliveries}\n")
    return path


class DaemonProcess:
    """`python -m improved.cli run --nats URL` as a child process, configured through
    IMPROVED_CONFIG; started, SIGKILLed and started again as often as a test likes."""

    def __init__(self, url: str, log: Path, config: Path | None = None, name: str = "daemon"):
        self.url = url
        self.log = log
        self.config = config
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.kills = 0
        self._offset = 0
        # its own data directory, kept across its restarts: the last checkpoint it signed is
        # there, and another daemon (or this one on another server) would read it as a loss
        self.data_dir = log.parent / f"{log.stem}-{uuid.uuid4().hex[:8]}.data"

    def start(self) -> None:
        self._offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "improved.cli", "--log-level", "warning", "run",
                 "--nats", self.url, "--data-dir", str(self.data_dir)],
                # in the test's directory: whatever the daemon keeps under its data_dir
                # (`.improved/` by default) stays out of the repository
                stdout=out, stderr=out, stdin=subprocess.DEVNULL, cwd=self.log.parent,
                env={**os.environ, "IMPROVED_CONFIG": str(self.config or "")})
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        """What this start wrote to the log so far."""
        if not self.log.exists():
            return ""
        with open(self.log, "rb") as fh:
            fh.seek(self._offset)
            return fh.read().decode(errors="replace")

    async def ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if READY in self.output():
                return
            if not self.alive():
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n"
                                     f"{self.output()[-3000:]}")
            await asyncio.sleep(0.05)
        raise AssertionError(f"{self.name} not ready within {timeout}s:\n"
                             f"{self.output()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no drain, no ack, no goodbye."""
        if self.alive():
            self.proc.send_signal(signals.SIGKILL)
            self.proc.wait()
            self.kills += 1

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait for the drain; SIGKILL if it takes too long. The exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signals.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


async def kill_repeatedly(daemon: DaemonProcess, kills: int, rng: random.Random,
                          low: float = 0.2, high: float = 1.5) -> list[float]:
    """Once ready, let it work `low`–`high` s, SIGKILL it, start it again; `kills` times. The
    delays used. The daemon is left running and ready."""
    delays = []
    for _ in range(kills):
        await daemon.ready()
        delay = rng.uniform(low, high)
        delays.append(round(delay, 2))
        await asyncio.sleep(delay)
        daemon.kill()
        daemon.start()
    await daemon.ready()
    return delays


# -- the proposal mix --------------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    """An acknowledged proposal and where it must end."""

    svc: str
    pid: str
    status: str  # applied | pending | rejected
    cause: str | None = None  # the triage cause of a deferred or rejected one


def mix(svc: str, n: int, rng: random.Random, l0: float = 0.6,
        l2: float = 0.25) -> list[tuple[Proposal, str, str | None]]:
    """`n` proposals for `svc`, each with its own target (so no two share a dedup_key):
    L0 rank changes (applied), L2 skills (awaiting an operator) and rejections at triage
    (a forbidden target, or a skill below its minimum class). (proposal, status, cause)."""
    out = []
    tag = rng.randrange(1 << 30)
    for i in range(n):
        roll = rng.random()
        if roll < l0:
            out.append((rank_proposal(svc, key=f"k{tag}-{i}", value=i), "applied", None))
        elif roll < l0 + l2:
            out.append((skill_proposal(svc, name=f"s{tag}-{i}"), "pending", "awaiting_operator"))
        elif i % 2:
            out.append((rank_proposal(svc, key=f"f{tag}-{i}", value=i, target_files=FORBIDDEN),
                        "rejected", "forbidden_target"))
        else:
            out.append((skill_proposal(svc, name=f"c{tag}-{i}", change_class="L0"),
                        "rejected", "class_mismatch"))
    return out


def l0_mix(svc: str, n: int, tag: str = "") -> list[tuple[Proposal, str, str | None]]:
    return [(rank_proposal(svc, key=f"k{tag}{i}", value=i), "applied", None) for i in range(n)]


# -- publishing ----------------------------------------------------------------------------------


@dataclass
class Publisher:
    """Publishes proposals into IMPROVE_IN with `Nats-Msg-Id` = the proposal id, retrying each
    until JetStream acknowledges it (a broker outage is waited out). Only acknowledged proposals
    are expected to exist; an unacknowledged one may or may not."""

    nc: Client
    timeout: float = 2.0
    give_up_s: float = 120.0
    acked: list[Expected] = field(default_factory=list)
    attempted: set[str] = field(default_factory=set)
    retries: int = 0
    duplicates: int = 0  # acks the broker marked duplicate (a retry of a stored message)
    errors: Counter = field(default_factory=Counter)
    first_ack: float | None = None
    last_ack: float | None = None

    def __post_init__(self):
        self.js = self.nc.jetstream(timeout=self.timeout)

    async def publish(self, proposal: Proposal, status: str, cause: str | None) -> str:
        from improved.core import propose

        pid, _ = propose.identify(proposal)
        data = to_json(proposal)
        self.attempted.add(pid)
        deadline = time.monotonic() + self.give_up_s
        while True:
            try:
                ack = await self.js.publish(S.inbound_proposal(proposal.service), data,
                                            headers={"Nats-Msg-Id": S.message_id(pid, data)},
                                            stream=S.STREAM_INBOUND, timeout=self.timeout)
            except Exception as exc:  # outage, leader election, reconnect: try again
                self.errors[type(exc).__name__] += 1
                if time.monotonic() > deadline:
                    raise
                self.retries += 1
                await asyncio.sleep(0.2)
                continue
            break
        self.duplicates += bool(ack.duplicate)
        now = time.monotonic()
        self.first_ack = self.first_ack or now
        self.last_ack = now
        self.acked.append(Expected(proposal.service, pid, status, cause))
        return pid

    async def run(self, items: Iterable[tuple[Proposal, str, str | None]], rate: float | None,
                  concurrency: int = 32) -> None:
        """Publish everything, paced at `rate` per second (None: as fast as acks come)."""
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        start = time.monotonic()
        sent = 0

        async def worker() -> None:
            nonlocal sent
            while not queue.empty():
                item = queue.get_nowait()
                if rate:
                    due = start + sent / rate
                    sent += 1
                    delay = due - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                await self.publish(*item)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


# -- reading what the loop left --------------------------------------------------------------


async def last_record(js, subject: str) -> bytes | None:
    try:
        msg = await js.get_msg(S.STREAM_RECORDS, subject=subject, direct=True)
    except NotFoundError:
        return None
    return msg.data or None


async def records_of(js, exp: Expected) -> tuple[dict | None, dict | None, dict | None]:
    """(ProposalState, TriageDecision, ApplyOutcome) as retained, each None when absent."""
    raw = await asyncio.gather(
        last_record(js, S.proposal_state(exp.svc, exp.pid)),
        last_record(js, S.triage_decision(exp.svc, exp.pid)),
        last_record(js, S.apply_outcome(exp.svc, exp.pid)))
    return tuple(msgspec.json.decode(r) if r else None for r in raw)


def record_problem(exp: Expected, state, decision, outcome) -> str | None:
    """Why the retained records of `exp` are not where they must end, or None."""
    if state is None:
        return "no ProposalState"
    if state["status"] != exp.status:
        return f"status {state['status']} (stage {state['stage']}), expected {exp.status}"
    if decision is None:
        return "no TriageDecision"
    if exp.status == "applied":
        if decision["verdict"] != "accept":
            return f"decision {decision['verdict']}/{decision['cause']}"
        if outcome is None or not outcome["ok"]:
            return f"apply outcome {outcome!r}"
    elif decision["cause"] != exp.cause:
        return f"decision {decision['verdict']}/{decision['cause']}, expected cause {exp.cause}"
    return None


async def gather_chunked(coros: list, size: int = 256) -> list:
    out = []
    for i in range(0, len(coros), size):
        out.extend(await asyncio.gather(*coros[i:i + size]))
    return out


async def wait_records(nc: Client, expected: list[Expected], timeout: float) -> dict[str, str]:
    """Wait until every proposal's retained records say where it must end; what is still
    wrong when `timeout` runs out (empty when all settled)."""
    js = nc.jetstream(timeout=10)
    pending = list(expected)
    problems: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    still_since = None  # since when nothing moved while the consumer had nothing left
    moved_at = time.monotonic()  # when the last proposal settled
    while True:
        try:
            found = await gather_chunked([records_of(js, e) for e in pending])
        except Exception as exc:  # a broker still electing leaders: look again
            problems = {e.pid: f"unreadable: {exc!r}" for e in pending}
            found = None
        if found is not None:
            before = set(problems)
            problems = {}
            still = []
            for exp, recs in zip(pending, found, strict=True):
                why = record_problem(exp, *recs)
                if why is not None:
                    problems[exp.pid] = why
                    still.append(exp)
            if len(still) < len(pending):
                moved_at = time.monotonic()
            pending = still
            if pending and set(problems) == before and await consumer_idle(js):
                still_since = still_since or time.monotonic()
            else:
                still_since = None
        if not pending or time.monotonic() > deadline:
            return problems
        if still_since is not None and time.monotonic() - still_since > STUCK_S:
            return problems  # nothing left to deliver and nothing moves: it will not settle
        if pending and time.monotonic() - moved_at > STALLED_S:
            return problems  # messages held but nothing settles (longer than any redelivery)
        await asyncio.sleep(0.5)


async def consumer_idle(js) -> bool:
    try:
        info = await js.consumer_info(S.STREAM_INBOUND, S.CONSUMER_INBOUND)
    except Exception:
        return False
    return info.num_pending == 0 and info.num_ack_pending == 0


async def wait_quiet(nc: Client, timeout: float) -> dict[str, int]:
    """Wait until the shared consumer has nothing left: no pending and no unacknowledged
    message (so every redelivery after a crash has been handled). Its last figures."""
    js = nc.jetstream(timeout=10)
    deadline = time.monotonic() + timeout
    figures: dict[str, int] = {}
    quiet_since = None
    last, changed_at = None, time.monotonic()
    while time.monotonic() < deadline:
        try:
            info = await js.consumer_info(S.STREAM_INBOUND, S.CONSUMER_INBOUND)
        except Exception:
            await asyncio.sleep(0.5)
            continue
        figures = {"num_pending": info.num_pending, "num_ack_pending": info.num_ack_pending,
                   # deliveries beyond one per message: redeliveries (after a crash, a nak)
                   "redeliveries": info.delivered.consumer_seq - info.delivered.stream_seq}
        if info.num_pending == 0 and info.num_ack_pending == 0:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 1.0:
                return figures
        else:
            quiet_since = None
        now = (info.num_pending, info.num_ack_pending, info.delivered.consumer_seq)
        if now != last:
            last, changed_at = now, time.monotonic()
        elif time.monotonic() - changed_at > STALLED_S:
            break  # held messages that are neither acked nor redelivered: wedged
        await asyncio.sleep(0.25)
    return {**figures, "timed_out": 1}


async def read_stream(js, stream: str, subject: str) -> list:
    """Every message of `stream` on `subject` (wildcards allowed), in order."""
    info = await js.stream_info(stream, subjects_filter=subject)
    total = sum((info.state.subjects or {}).values())
    if total == 0:
        return []
    sub = await js.subscribe(subject, ordered_consumer=True, stream=stream)
    out = []
    try:
        while len(out) < total:
            out.append(await sub.next_msg(timeout=10))
    finally:
        await sub.unsubscribe()
    return out


def _open_dispatch(bodies: list[dict]) -> dict | None:
    """The last `dispatched` trailer unless an `undelivered` withdrew it."""
    last = None
    for b in bodies:
        if b.get("verdict") == "dispatched":
            last = b
        elif b.get("verdict") == "undelivered":
            last = None
    return last


def dispatch_problems(bodies: list[dict]) -> list[str]:
    """Every order's dispatch on the chain before its outcome, withdrawn only while open, and
    never a second one while one is open."""
    out, open_ = [], False
    for b in bodies:
        verdict = b.get("verdict")
        if b["to_stage"] != "apply" or "dispatch:rollback" in (b.get("refs") or ()):
            continue
        if verdict == "dispatched":
            if open_:
                out.append(f"a second dispatch at seq {b.get('seq')} while one is open")
            open_ = True
        elif verdict in ("undelivered", "applied") or (verdict == "failed" and open_):
            if not open_:
                out.append(f"{verdict} at seq {b.get('seq')} without an open dispatch")
            open_ = False
    return out


def chain_problems(pid: str, bodies: list[dict], exp: Expected | None) -> list[str]:
    """What is wrong with one proposal's chain: verification, contiguity, duplicates, and the
    status folded from the chain alone."""
    out = []
    broken = audit.verify_chain(pid, bodies)
    if broken is not None:
        out.append(f"chain does not verify: {broken}")
    if [b.get("seq") for b in bodies] != list(range(len(bodies))):
        out.append(f"seq not contiguous: {[b.get('seq') for b in bodies]}")
    stages = Counter(b["to_stage"] for b in bodies)
    if stages["propose"] != 1:
        out.append(f"{stages['propose']} propose trailers")
    decisions = [b for b in bodies if b["to_stage"] == "triage"
                 and b.get("verdict") in ("accept", "defer", "reject")]
    if len(decisions) != 1:  # these proposals meet exactly one triage event each
        out.append(f"{len(decisions)} triage decisions: "
                   f"{[(d.get('verdict'), d.get('cause')) for d in decisions]}")
    applied = sum(1 for b in bodies if b["to_stage"] == "apply" and b.get("verdict") == "applied")
    if applied > 1:
        out.append(f"{applied} applied trailers")
    out += dispatch_problems(bodies)
    # a dispatch withdrawn because no service was there is recorded again on the next try
    settled = [b for b in bodies if b.get("verdict") not in ("dispatched", "undelivered")
               or b is _open_dispatch(bodies)]
    seen = Counter((b["from_stage"], b["to_stage"], b.get("verdict"), b.get("cause"),
                    b.get("reason"), tuple(b.get("refs") or ())) for b in settled)
    repeated = [k for k, c in seen.items() if c > 1]
    if repeated:
        out.append(f"repeated trailers: {repeated}")
    if exp is not None:
        want = {"applied": ["propose", "triage", "apply", "apply"]}.get(  # dispatched, applied
            exp.status, ["propose", "triage"])
        if [b["to_stage"] for b in settled] != want:
            out.append(f"stages {[b['to_stage'] for b in settled]}, expected {want}")
        try:
            trailers = [trailer_decoder.decode(to_json(b)) for b in bodies]
            folded = rebuild_record(trailers, list(range(1, len(bodies) + 1)), Policy())
            if folded.status != exp.status:
                last = bodies[-1]
                out.append(f"the chain folds to {folded.status}, expected {exp.status}; last "
                           f"trailer {last['to_stage']}/{last.get('verdict')} "
                           f"refs={last.get('refs')} reason={last.get('reason')!r}")
        except Exception as exc:
            out.append(f"chain not replayable: {exc!r}")
    return out


@dataclass
class Figures:
    proposals: int = 0
    applied: int = 0
    pending: int = 0
    rejected: int = 0
    chains_verified: int = 0
    trailers: int = 0
    duplicates: int = 0  # repeated trailers, second applies, second value writes
    missing: int = 0  # acknowledged but without a chain or a record
    ledger_applies: int = 0
    service_writes: int = 0
    settle_s: float = 0.0
    consumer: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def line(self, label: str, **extra: Any) -> str:
        parts = [f"{label}:", f"proposals={self.proposals}",
                 f"applied={self.applied}", f"pending={self.pending}",
                 f"rejected={self.rejected}", f"chains_verified={self.chains_verified}",
                 f"trailers={self.trailers}", f"duplicates={self.duplicates}",
                 f"missing={self.missing}", f"ledger_applies={self.ledger_applies}",
                 f"settle={self.settle_s:.1f}s"]
        parts += [f"{k}={v}" for k, v in extra.items()]
        return " ".join(parts)


async def settle_and_check(nc: Client, expected: list[Expected],
                           rankings: RankingStore | dict[str, RankingStore] | None,
                           timeout: float = 120.0, attempted: set[str] | None = None,
                           check: bool = True) -> Figures:
    """Wait for the loop to settle, then check every invariant (see the module doc) and return
    the figures; with `check`, fail listing the first problems found."""
    started = time.monotonic()
    figures = Figures(proposals=len(expected))
    by_pid = {e.pid: e for e in expected}
    if len(by_pid) != len(expected):
        figures.problems.append("the same proposal was acknowledged twice by the publisher")
    unsettled = await wait_records(nc, expected, timeout)
    figures.consumer = await wait_quiet(nc, max(10.0, timeout - (time.monotonic() - started)))
    if unsettled:  # one more look now that the consumer is quiet
        unsettled = await wait_records(nc, [by_pid[p] for p in unsettled], 5.0)
    figures.settle_s = time.monotonic() - started
    missing = {pid for pid, why in unsettled.items() if why == "no ProposalState"}
    for pid, why in unsettled.items():
        figures.problems.append(f"{pid[:12]} ({by_pid[pid].status}): {why}")
    if figures.consumer.get("timed_out"):
        figures.problems.append(f"the consumer never went quiet: {figures.consumer}")
    for e in expected:
        figures.applied += e.status == "applied"
        figures.pending += e.status == "pending"
        figures.rejected += e.status == "rejected"

    # -- the chains --
    services = {e.svc for e in expected}
    chains = await Store(nc).all_chains()
    for (svc, pid), bodies in chains.items():
        if svc not in services:
            continue
        figures.trailers += len(bodies)
        exp = by_pid.get(pid)
        if exp is None and pid not in (attempted or ()):
            figures.problems.append(f"chain {svc}/{pid[:12]} that nobody published")
        found = chain_problems(pid, bodies, exp)
        if found:
            figures.duplicates += sum(1 for f in found if "repeated" in f or "applied trail" in f
                                      or "propose trailers" in f or "triage decisions" in f)
            figures.problems += [f"{pid[:12]}: {f}" for f in found]
        else:
            figures.chains_verified += 1
    for e in expected:
        if (e.svc, e.pid) not in chains:
            missing.add(e.pid)
            figures.problems.append(f"{e.pid[:12]} ({e.status}): acknowledged but no chain")
    figures.missing = len(missing)

    # -- the owning service: each L0 applied once, nothing else applied --
    if rankings is not None:
        if isinstance(rankings, RankingStore):
            rankings = {rankings.service: rankings}
        js = nc.jetstream(timeout=10)
        for svc, store in rankings.items():
            ledger: dict[str, dict] = {}  # the last entry per proposal id, read off its stream
            prefix = f"$KV.{store.ledger_bucket}."
            for msg in await read_stream(js, f"KV_{store.ledger_bucket}", prefix + ">"):
                if msg.data and (msg.headers or {}).get("KV-Operation") is None:
                    ledger[msg.subject[len(prefix):]] = msgspec.json.decode(msg.data)
            keys = set(ledger)
            writes = Counter()
            for msg in await read_stream(js, store.values_stream, f"$KV.{store.bucket}.>"):
                tag = (msg.headers or {}).get(PROVENANCE)
                if tag:
                    writes[tag] += 1
            figures.service_writes += sum(writes.values())
            for e in (e for e in expected if e.svc == svc):
                want = 1 if e.status == "applied" else 0
                if e.pid in keys and ledger[e.pid].get("revision") is None:
                    figures.problems.append(f"{e.pid[:12]}: ledger entry left incomplete")
                if (e.pid in keys) != bool(want) or writes[e.pid] != want:
                    figures.problems.append(f"{e.pid[:12]} ({e.status}): ledger "
                                            f"{e.pid in keys}, {writes[e.pid]} value writes")
                    figures.duplicates += writes[e.pid] > 1
                figures.ledger_applies += e.pid in keys
            strangers = [k for k in keys if k not in by_pid and k not in (attempted or ())]
            if strangers:
                figures.problems.append(f"{svc}: ledger entries for {len(strangers)} proposals "
                                        "nobody published")
    if check:
        assert not figures.problems, (
            f"{len(figures.problems)} problems, first {SHOWN}:\n"
            + "\n".join(figures.problems[:SHOWN]) + "\n" + figures.line("figures"))
    return figures


# -- a proxy that loses what a broker restart loses -------------------------------------------


class LossyProxy:
    """A TCP proxy in front of a nats-server for one client. It forwards everything, except
    that while `drop(subject)` is true it discards the server → client messages (MSG/HMSG
    frames) on that subject, as a broker that dies between taking a publish and acknowledging
    it would; `cut()` resets every connection, as a broker restart does."""

    def __init__(self, upstream_port: int):
        from improved.runtime import bus

        self.upstream = upstream_port
        self.port = bus.free_port()
        self.drop = None  # Callable[[bytes], bool] | None
        self.dropped: list[bytes] = []
        self._writers: list[asyncio.StreamWriter] = []
        self._server = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()

    def cut(self) -> None:
        for writer in self._writers:
            with_suppress(writer.close)
        self._writers.clear()

    async def _accept(self, client_r, client_w) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            client_w.close()
            return
        self._writers += [client_w, server_w]
        await asyncio.gather(self._copy(client_r, server_w), self._frames(server_r, client_w),
                             return_exceptions=True)
        for writer in (client_w, server_w):
            with_suppress(writer.close)

    @staticmethod
    async def _copy(reader, writer) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def _frames(self, reader, writer) -> None:
        buf = b""
        while data := await reader.read(65536):
            buf += data
            out = []
            while (end := buf.find(b"\r\n")) >= 0:
                line = buf[:end]
                op = line.split(b" ", 1)[0].upper()
                size = end + 2
                subject = None
                if op in (b"MSG", b"HMSG"):
                    parts = line.split()
                    size += int(parts[-1]) + 2
                    subject = parts[1]
                if len(buf) < size:
                    break
                frame, buf = buf[:size], buf[size:]
                if subject is not None and self.drop is not None and self.drop(subject):
                    self.dropped.append(subject)
                    continue
                out.append(frame)
            if out:
                writer.write(b"".join(out))
                await writer.drain()
        writer.close()


def with_suppress(fn) -> None:
    try:
        fn()
    except Exception:
        pass
