"""`demo` and `bench` run a daemon next to the reference services (improved_reference); they
live in improved_demo and improved_bench, found through the `improved.commands` entry points,
so nothing in `improved` imports them."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from importlib.metadata import entry_points

from improved.cli.errors import USAGE, Failure
from improved.client.config import RECORDS_STORAGE


def reference_command(name: str) -> Callable[..., int]:
    """The command `name` (`demo`, `bench`) of the `improved.commands` entry points."""
    for ep in entry_points(group="improved.commands"):
        if ep.name == name:
            command: Callable[..., int] = ep.load()  # demo takes argv, bench the Namespace
            return command
    raise Failure("the reference package is not installed (pip install improved)", USAGE)


def cmd_demo(args: argparse.Namespace) -> int:
    argv = ["--pace", str(args.pace)] + (["--data-dir", args.data_dir] if args.data_dir else [])
    return reference_command("demo")(argv)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `reference` commands to the `improved` parser."""
    bench = sub.add_parser(
        "bench", help="measure the loop against the broker's own limit",
        description="Start (or connect to) NATS, daemon process(es) and a reference applier; "
                    "from a separate publisher process, drive N proposals at concurrency C "
                    "through the whole loop (a mix of L0, L3 with a grant, L2 approved by a "
                    "signing bench operator, and proposals rejected at triage; one independent "
                    "learn-back signal per applied proposal); report end-to-end proposals/s "
                    "with the clock stopped when the last outcome is read back from JetStream, "
                    "audited transitions/s, p50/p99 per stage, the writes per proposal, CPU "
                    "per proposal of the daemon, the broker, the applier and the publisher, "
                    "the broker's ceiling for the loop's write pattern (pipelined and in "
                    "atomic batches) measured in the same run, `audit verify` and `audit "
                    "rebuild` timed through the CLI, and the daemons' peak RSS. Nothing is "
                    "left under the temp dir.")
    bench.add_argument("--nats", metavar="URL", help="use this server instead of an embedded one")
    bench.add_argument("-n", type=int, default=2000, help="proposals (2000)")
    bench.add_argument("-c", "--concurrency", type=int, default=200,
                       help="proposals in flight at once (200)")
    bench.add_argument("--mix", default="l3=0.7,l0=0.1,l2=0.1,reject=0.1",
                       help="weights of l0, l3 (with grant), l2 (approved), reject "
                            "(default l3=0.7,l0=0.1,l2=0.1,reject=0.1)")
    bench.add_argument("--replicas", type=int, default=1, help="daemon processes (1)")
    bench.add_argument("--stream-replicas", type=int, default=1, metavar="R",
                       help="the daemons' `replicas`: JetStream replicas of every stream and "
                            "bucket (1; 3 on a 3-node cluster given with --nats)")
    bench.add_argument("--broker-pid", type=int, action="append", default=[], metavar="PID",
                       help="with --nats: a server process whose CPU counts as the broker's "
                            "(once per node)")
    bench.add_argument("--sync", default="always",
                       help="embedded server fsync: always (durable, default) or e.g. 2m")
    bench.add_argument("--records", choices=("file", "memory"), default=RECORDS_STORAGE,
                       help=f"the daemons' records_storage ({RECORDS_STORAGE}, the default's)")
    bench.add_argument("--applier", choices=("ranking", "instant"), default="ranking",
                       help="the owning service: ranking = the persisting reference stores "
                            "(RankingStore for rank: L0, SkillsStore for skill: L2/L3, in "
                            "JetStream KV; default), instant = answers at once, writes nothing")
    bench.add_argument("--verify-acceptance", action="store_true",
                       help="the applier checks every order's acceptance on the audit chain "
                            "first, as an L2+ conformant service does")
    bench.add_argument("--paced", action="store_true",
                       help="also publish the mix at 25, 50 and 90%% of the measured peak "
                            "rate and report publish→decision and publish→applied by class")
    bench.add_argument("--paced-n", type=int, default=2000, metavar="N",
                       help="proposals in each paced run (2000: enough that the p99 is the "
                            "same from one run to the next)")
    bench.add_argument("--no-learn-back", dest="learn_back", action="store_false",
                       help="send no learn-back signals (the loop then ends at the apply)")
    bench.add_argument("--timeout", type=float, default=300.0, help="give up after (300 s)")
    bench.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    bench.set_defaults(func=lambda args: reference_command("bench")(args))

    demo = sub.add_parser(
        "demo", help="walk through the whole loop in about ten seconds",
        description="Start everything embedded (a nats-server, the daemon, a skills store, a "
                    "ranking store, a knowledge store, a doc store and an artefact store) and "
                    "walk through the loop: a skill "
                    "proposed at L1, its first execution approved by a demo operator, a grant, a "
                    "trusted re-execution, a refinement sent back to L2, a self-confirmed change "
                    "deferred, a forbidden target rejected, a rollback, a CAL batch and a doc "
                    "edit applied and undone by their inverses, an L4 binary swap "
                    "refused whole, then applied and reverted without a second approval — "
                    "printing a timeline and ending with every audit chain verified.")
    demo.add_argument("--pace", type=float, default=0.4, metavar="SECONDS",
                      help="pause between steps (0.4)")
    demo.add_argument("--data-dir", metavar="DIR",
                      help="keep the demo's store here (a new or empty directory)")
    demo.set_defaults(func=cmd_demo)
