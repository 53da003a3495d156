"""`improved demo`: the whole loop, embedded and in-process, walked through for a newcomer.

One call starts everything: a `nats-server` with JetStream on a free port in a temporary
directory, the daemon (trusting a freshly generated key for `operator:demo`), the reference
skills store as service `skills`, the reference ranking store as service `search`, the
knowledge store as `memory`, the doc store as `docs` and the artefact store as `deploy`. Then
it walks the loop step by step — L1 surfaces, L2 waits for a signed approval, a grant makes L3
automatic for exactly one content hash, feedback collapse, a forbidden target, a rollback, a
CAL batch and a doc edit undone by their stores' inverses, an L4 swap — and ends by verifying
every audit chain. Each event is one line of a plain-text timeline.

Every wait is bounded: a state that does not arrive prints a FAILED line and the walk goes on;
`run` returns 1 if any step failed. Everything is stopped and the temporary directory removed
afterwards, on failure and on Ctrl-C too. With `--data-dir` the store is kept, so the same
mesh can be inspected later with `improved run --data-dir DIR` and the operator commands.

While the demo runs, the daemon's and the services' logs (structlog) go to `improved.log` in the
data directory instead of the terminal, so they do not interleave with the timeline.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import structlog

from improved.core import audit
from improved.protocol import subjects as S
from improved_demo.cast import SKILL
from improved_demo.mesh import Mesh
from improved_demo.ranking_scenes import RankingScenes
from improved_demo.skill_scenes import SkillScenes
from improved_demo.store_scenes import StoreScenes
from improved_demo.timeline import StepFailed, Timeline

__all__ = ["SKILL", "Demo", "main", "parser", "run"]

STEP_TIMEOUT = 5.0  # how long one expected state may take to arrive
STEP_BUDGET = 30.0  # a whole step, whatever happens inside it
DEFAULT_PACE = 0.4


class Demo(SkillScenes, RankingScenes, StoreScenes):
    """The walk: every scene in order on the mesh it starts, each line on the timeline, and
    the verdict at the end (every audit chain verified, then what to try next)."""

    def __init__(self, out: TextIO, pace: float):
        timeline = Timeline(out)
        super().__init__(Mesh(timeline, STEP_TIMEOUT), timeline, STEP_TIMEOUT)
        self.pace = max(0.0, pace)

    async def start(self, root: Path) -> None:
        """The whole mesh (`Mesh.start`)."""
        await self.mesh.start(root)

    async def stop(self) -> None:
        """Everything the mesh started, stopped (`Mesh.stop`)."""
        await self.mesh.stop()

    # -- the verification ----------------------------------------------------------------------

    async def step_audit(self) -> None:
        chains = await self.mesh.reader.all_chains()
        trailers = sum(len(bodies) for bodies in chains.values())
        kinds = {"proposal": 0, "grant": 0, "autonomy": 0, "other": 0}
        first_break = None
        for (svc, cid), bodies in sorted(chains.items()):
            kind = ("grant" if svc == S.GRANT_CHAINS else
                    "autonomy" if svc == S.AUTONOMY_CHAIN else
                    "other" if svc in S.MESH_CHAINS else "proposal")
            kinds[kind] += 1
            brk = audit.verify_chain(cid, bodies)
            if brk is not None and first_break is None:
                first_break = brk
        self.event("read", f"{len(chains)} chains from IMPROVE_AUDIT: {kinds['proposal']} "
                   f"proposals, {kinds['grant']} grant, {kinds['autonomy']} autonomy, "
                   f"{kinds['other']} checkpoint and policy")
        self.expect(first_break is None, f"first break: {first_break}")
        self.expect(len(chains) > 0, "no chains at all")
        self.ok(f"{len(chains)} chains, {trailers} trailers: all verified")

    STEPS: tuple[tuple[str, str, str], ...] = (
        ("step_l1", "L1: a skill is proposed, never applied",
         "An L1 proposal only surfaces an idea: it is recorded and shown to operators, and "
         "nothing is ever sent to a service."),
        ("step_l2", "L2: first execution waits for a signed approval",
         "A skill's first execution needs an operator: the proposal waits until a DSSE "
         "envelope signed by a trusted key approves it, and then runs under that principal."),
        ("step_grant", "Grant: trust exactly this content",
         "A grant binds <name>:<sha256> of the skill's definition, so the operator trusts this "
         "exact text, not the name."),
        ("step_l3", "L3: re-execution under the grant applies by itself",
         "The same content proposed at L3 finds its grant and is applied by the policy "
         "(rec:policy) without asking anyone."),
        ("step_refine", "A refinement is new content: back to L2",
         "One added sentence makes a new hash, which no grant covers, so the proposal waits "
         "for an operator again (no_grant)."),
        ("step_collapse", "Feedback collapse: no grading your own homework",
         "An L0 ranking change would apply automatically, but not while every positive signal "
         "comes from the proposer's own session; an independent evaluator releases it."),
        ("step_forbidden", "Forbidden targets: whatever the class",
         "The constitution's forbidden list is checked first, on normalised paths, so "
         "`notes/../` cannot smuggle it in."),
        ("step_rollback", "Undo: the operator rolls the ranking change back",
         "Every apply recorded the inverse the service returned; a signed rollback applies it "
         "and counts toward the circuit breaker."),
        ("step_remeasure", "Learn-back: measured again, regressed, rolled back",
         "A change carries the metric as it was and when to look again; at review_after the "
         "daemon asks the owning service to measure, and a regression proposes the inverse "
         "recorded at the apply."),
        ("step_knowledge", "OMS knowledge: a CAL batch and a doc edit, applied and undone",
         "A curator merges duplicate facts with a CAL batch and edits a guide with a diff; "
         "each store applies it under the approver's capability, in its namespace or on the "
         "doc's current head, and returns an inverse the rollback replays."),
        ("step_l4", "L4: last-known-good, all or none, and a reversal made in advance",
         "A binary swap lists its artefacts with digests and smoke tests; the owning service "
         "swaps all of them or none, and the reversal is recorded before the apply, so undoing "
         "it needs no second signature."),
        ("step_schema", "Schema changes: forward applies, backward is refused",
         "The owning service classifies a JSON Schema change against the schema it holds; a "
         "change carries the revert to that schema or is rejected."),
        ("step_audit", "The audit chains",
         "Every transition left a hash-chained trailer; re-deriving every hash and link needs "
         "nothing but the stream's contents."),
    )

    async def walk(self) -> None:
        for n, (method, title, sentence) in enumerate(self.STEPS, 1):
            if n > 1 and self.pace:
                await asyncio.sleep(self.pace)
            self.timeline.header(n, title, sentence)
            try:
                await asyncio.wait_for(getattr(self, method)(), STEP_BUDGET)
            except StepFailed as exc:
                self.timeline.failed(str(exc))
            except TimeoutError:
                self.timeline.failed(f"the step did not finish within {STEP_BUDGET:g}s")
            except Exception as exc:
                self.timeline.failed(f"{type(exc).__name__}: {exc}")

    def epilogue(self, kept: Path | None) -> None:
        self.timeline.say()
        if self.timeline.failures:
            self.timeline.say(self.timeline.paint(f"RESULT: {len(self.timeline.failures)} check(s) FAILED", "1;31"))
        else:
            self.timeline.say(self.timeline.paint("RESULT: every step behaved as the loop promises", "1;32"))
        self.timeline.say()
        self.timeline.say("Try it yourself:")
        rows: list[tuple[str, str]] = []
        if kept is not None:  # every command names the kept store: it is not the default one
            where = f"--data-dir {kept}"
            rows.append((f"improved run {where}", "serve this mesh again (port 4222)"))
        else:
            self.timeline.say("  (this mesh's store was temporary and is gone now: keep one "
                              "with --data-dir, and the commands below work on it from any "
                              "directory)")
            where = "--data-dir DIR"
            rows.append((f"improved demo {where}", "keep the mesh's store this time"))
            rows.append((f"improved run {where}", "serve it again (port 4222)"))
        rows.append((f"improved review {where}", "the queue waiting for an operator"))
        example = self.ids.get("refined") if kept is not None else None
        rows.append((f"improved show {example or 'ID'} {where}",
                     "the refinement that waits (no_grant)" if example else
                     "state, decision, outcome, trailers"))
        rows.append((f"improved audit verify {where}",
                     "every hash and link, and who wrote them: against this mesh's daemon key"))
        width = max((len(cmd) for cmd, _ in rows if len(cmd) < 64), default=0)
        for cmd, why in rows:
            if len(cmd) > width:
                self.timeline.say(f"  {cmd}")
                self.timeline.say(f"  {'':<{width}}  # {why}")
            else:
                self.timeline.say(f"  {cmd:<{width}}  # {why}")


def _prepare(data_dir: Path | None) -> Path | str:
    """The directory to run in: a new temporary one, or `data_dir` if it is new or empty (the
    walk needs a fresh mesh: an old grant, rollback or breaker would change what it shows);
    otherwise the reason it cannot be used."""
    if data_dir is None:
        return Path(tempfile.mkdtemp(prefix="improved-demo-"))
    root = Path(data_dir).expanduser().resolve()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        return (f"{root} is not an empty directory; the demo needs a fresh mesh (give a new "
                "or empty --data-dir)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {root}: {exc}"
    return root


def _log_to(path: Path) -> Callable[[], None]:
    """Send structlog output to `path` while the demo runs; returns the undo."""
    old = structlog.get_config()
    fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by the undo
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=fh),
        cache_logger_on_first_use=False,
    )

    def undo() -> None:
        structlog.configure(**old)
        fh.close()

    return undo


def _log_tail(path: Path, n: int = 5) -> list[str]:
    """The last warnings and errors of the demo's log, to explain a failure."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    worse = [line for line in lines if '"level": "warning"' in line
             or '"level": "error"' in line or '"level":"warning"' in line
             or '"level":"error"' in line]
    return [line[:300] for line in worse[-n:]]


async def run(out: TextIO, *, data_dir: Path | None = None, pace: float = 0.0) -> int:
    """Walk the loop on an embedded mesh; 0 when every step behaved as promised and every
    audit chain verified, 1 otherwise."""
    demo = Demo(out, pace)
    timeline = demo.timeline
    keep = data_dir is not None
    root = _prepare(data_dir)
    if isinstance(root, str):
        timeline.say(f"improved demo: {root}")
        return 1
    log_path = root / "improved.log"
    undo_logging = _log_to(log_path)
    timeline.say(timeline.paint("improved demo: the self-improve loop, end to end, in one process",
                         "1"))
    timeline.say("  Everything below runs embedded: a nats-server, the daemon and three reference "
             "services (a skills store, a ranking store, an artefact store).")
    try:
        try:
            await demo.start(root)
        except Exception as exc:
            timeline.failed(f"could not start the mesh: {type(exc).__name__}: {exc}")
        else:
            await demo.walk()
        if timeline.failures:
            tail = _log_tail(log_path)
            if tail:
                timeline.say()
                timeline.say("Last warnings in the daemon's log:")
                for line in tail:
                    timeline.say(f"  {line}")
        demo.epilogue(root if keep else None)
        if keep:
            timeline.say(f"  (logs of this run: {log_path})")
    finally:
        await demo.stop()
        undo_logging()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return 1 if timeline.failures else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="improved demo",
        description="Walk through the self-improve loop on an embedded mesh in about ten "
                    "seconds: a nats-server, the daemon and three reference services start "
                    "in-process; a skill goes L1 -> L2 (signed approval) -> grant -> L3 "
                    "(automatic), a refinement is gated again, a ranking change meets the "
                    "feedback-collapse guard, a forbidden target is rejected, an operator rolls "
                    "back, an L4 swap is refused whole, then applied and reverted, and every "
                    "audit chain is verified. Exit 0 when every step behaved as promised.")
    p.add_argument("--pace", type=float, default=DEFAULT_PACE, metavar="SECONDS",
                   help="pause between steps (default %(default)s)")
    p.add_argument("--data-dir", type=Path, metavar="DIR",
                   help="keep the mesh's store in DIR (new or empty) instead of a temporary "
                        "directory that is removed afterwards")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.pace < 0:
        parser().error("--pace must not be negative")
    try:
        return asyncio.run(run(sys.stdout, data_dir=args.data_dir, pace=args.pace))
    except KeyboardInterrupt:
        print("\nimproved demo: interrupted; everything it started was stopped",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
