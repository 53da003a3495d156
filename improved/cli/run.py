"""`improved run`: the daemon, with an embedded nats-server unless a URL is given."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from improved.cli.common import add_connection_args, config_of
from improved.runtime import bus
from improved.runtime.config import Config


def configured(args: argparse.Namespace) -> Config:
    """The configuration file (or the defaults) with the command's flags over it."""
    from msgspec.structs import replace

    config = config_of(args)
    if args.data_dir:
        config = replace(config, data_dir=Path(args.data_dir))
    if args.port:
        config = replace(config, port=args.port)
    if args.metrics_port is not None:
        config = replace(config, metrics_port=args.metrics_port)
    return config


def cmd_run(args: argparse.Namespace) -> int:
    from improved.runtime.daemon import run_until_stopped, stop_on_signals

    config = configured(args)
    url = args.nats or config.nats_url
    server = None
    if url is None:
        server = bus.EmbeddedServer(config.data_dir, config.port, config.sync)
        url = server.start()
        print(f"improved: embedded nats-server (JetStream, sync={config.sync}) listening on "
              f"{url}; store {config.data_dir.resolve() / 'jetstream'}", file=sys.stderr,
              flush=True)

    async def main() -> int:
        stop = stop_on_signals()
        nc = await bus.connect(where, "improved")
        return await run_until_stopped(
            nc, config, stop=stop, reread=lambda: configured(args),
            on_ready=lambda d: print(f"improved: ready as {d.actor} on {where.where} "
                                     f"(pid {os.getpid()})", file=sys.stderr, flush=True))

    try:
        where = bus.target(url, config.nats)  # the credential files are read here, once
        return asyncio.run(main())
    finally:
        if server is not None:
            server.stop()


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `run` commands to the `improved` parser."""
    run = sub.add_parser(
        "run", help="run the daemon",
        description="Run the daemon until SIGTERM/SIGINT, then drain and exit 0. Without --nats "
                    "(nor $IMPROVED_NATS_URL, nor nats_url in the config) it starts an embedded nats-server with "
                    "JetStream under --data-dir and prints where it listens. Streams, the "
                    "consumer and the state bucket are created if missing, so starting twice "
                    "against the same server is safe; with deploy/accounts.conf the daemon's "
                    "user may not create or change them, so run `improved provision` with the "
                    "provisioning credential first. SIGHUP re-reads the configuration file's "
                    "trust store ([trust.operators], [trust.quorum], [trust.signers], "
                    "act_max_age_s) without a restart and logs what changed; a file that does "
                    "not load changes nothing (one error line). Everything else in it is read "
                    "at start only.")
    add_connection_args(run)
    run.add_argument("--data-dir", metavar="DIR",
                     help="where the embedded server keeps JetStream (default: .improved)")
    run.add_argument("--port", type=int, metavar="N",
                     help="embedded server port (default: 4222)")
    run.add_argument("--metrics-port", type=int, metavar="N",
                     help="serve Prometheus /metrics, /healthz and /readyz on this port "
                          "(default: config metrics_port, else off)")
    run.set_defaults(func=cmd_run)
