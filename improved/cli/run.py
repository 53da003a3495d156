"""`improved run`: the daemon, with an embedded nats-server unless a URL is given."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
from pathlib import Path

from improved.cli.common import add_connection_args, config_of
from improved.cli.errors import USAGE, Failure, daemon_extra_note
from improved.client import connection, credentials
from improved.client.answers import DAEMON_INBOX
from improved.client.config import Config
from improved.client.connection import NatsSettings


def configured(args: argparse.Namespace) -> Config:
    """The configuration file (or the defaults) with the command's flags over it. Under
    --accounts services are bound to their subjects (deploy/accounts.conf lets each publish
    on its own only), and the daemon is told so."""
    from msgspec.structs import replace

    config = config_of(args)
    if args.port is not None:  # 0 was made a free port by `cmd_run`
        config = replace(config, port=args.port)
    if args.metrics_port is not None:
        config = replace(config, metrics_port=args.metrics_port)
    if args.accounts:
        config = replace(config, accounts=True)
    if config.accounts:
        config = replace(config, trust=replace(config.trust, subjects_bound=True))
    return config


def embedded_accounts(config: Config) -> str:
    """What the embedded server's configuration adds for its users: on the open bus the
    daemon's own user, whose inboxes no one else may touch (`runtime.open_bus`); under
    accounts the data directory's credentials, made on the first start. A data directory run
    one way is refused the other: the two keep their streams apart."""
    from improved.runtime import accounts, open_bus

    where = config.data_dir
    found = accounts.mode_in(where)
    if config.accounts:
        if found == "open":
            raise Failure(f"data directory {where} holds a loop run without --accounts: its "
                          "streams are in the server's global account, which a server with "
                          "accounts does not serve; give --accounts a new --data-dir, or leave "
                          "--accounts out", USAGE)
        return accounts.prepare(where)
    if found == "accounts":
        raise Failure(f"data directory {where} was run with --accounts: give --accounts (or "
                      "accounts = true) again; without it anyone on the bus may publish "
                      f"anything, and the loop kept there would not be seen (remove "
                      f"{credentials.directory(where)} only to start that directory afresh, open)",
                      USAGE)
    return open_bus.prepare(where)


def data_dir_made(where: Path) -> None:
    """The data directory, made if missing; a Failure (usage) naming it when it cannot be one
    (a file, a path under a file, a place this user may not write), before anything starts."""
    if where.exists() and not where.is_dir():
        raise Failure(f"the data directory {where} is a file, not a directory: give --data-dir "
                      "(or data_dir in the config) a directory", USAGE)
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Failure(f"cannot make the data directory {where}: {exc.strerror or exc}; give "
                      "--data-dir (or data_dir in the config) a directory this user may "
                      "write", USAGE) from None


def as_user(config: Config, url: str, user: str) -> connection.Target:
    """The embedded server of `config`, as one of its data directory's users."""
    return connection.target(url, NatsSettings(user=user, password_file=credentials.password_file(
        config.data_dir, user)))


def open_bus_daemon(config: Config, url: str) -> connection.Target:
    """The embedded open bus as its daemon, `improved`, with the data directory's password."""
    from improved.runtime import open_bus

    return connection.target(url, NatsSettings(user=open_bus.DAEMON_USER,
                                               password_file=open_bus.password_file(
                                                   config.data_dir)))


# The collector's generation thresholds in the daemon's process. Every message allocates
# short-lived objects, almost none in cycles; at Python's default (700 allocations) the young
# generation is scanned hundreds of times a second under load, a tenth of the daemon's CPU.
GC_THRESHOLDS = (20_000, 20, 20)


def ready(line: str) -> None:
    """Say the daemon is ready; what it made to start (modules, config, keys) is kept out of
    every later collection (`gc.freeze`): it lives as long as the process."""
    gc.freeze()
    print(line, file=sys.stderr, flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    # here, not at the top: the base install has no daemon extra, and says so in one line
    from improved.cli.provision import provisioned
    from improved.runtime import bus, metrics
    from improved.runtime.daemon import run_until_stopped, stop_on_signals

    if args.port == 0:  # a free port, chosen once (a SIGHUP reads the flags again), printed
        args.port = bus.free_port()  # by the start as where the server listens
    config = configured(args)
    data_dir_made(config.data_dir)
    url = args.nats or config.nats_url
    if config.accounts and url is not None:
        raise Failure("--accounts (accounts = true) gives the embedded server its users; a "
                      "server named by --nats, $IMPROVED_NATS_URL or nats_url has its own "
                      "(deploy/accounts.conf): leave one of them out", USAGE)
    server = None
    if url is None:
        server = bus.EmbeddedServer(config.data_dir, config.port, config.sync,
                                    embedded_accounts(config))
        url = server.start()
        users = (f"; users and permissions of deploy/accounts.conf, credentials in "
                 f"{credentials.directory(config.data_dir)}" if config.accounts else "")
        print(f"improved: embedded nats-server (JetStream, sync={config.sync}) listening on "
              f"{url}; store {config.data_dir.resolve() / 'jetstream'}{users}", file=sys.stderr,
              flush=True)

    async def main() -> int:
        stop = stop_on_signals()
        if config.accounts:  # the daemon's user may not make the streams: provisioning may
            notes, changes = await provisioned(as_user(config, where.where, credentials.ADMIN),
                                               config.replicas, config.records_storage)
            for note in notes:
                print(f"improved: {note}", file=sys.stderr, flush=True)
            print(f"improved: provisioned as {credentials.ADMIN}: "
                  + (f"{len(changes)} changed" if changes else "nothing changed"),
                  file=sys.stderr, flush=True)
        nc = await connection.connect(
            where, "improved",
            inbox_prefix=DAEMON_INBOX if server is not None and not config.accounts else None)
        return await run_until_stopped(
            nc, config, stop=stop, reread=lambda: configured(args),
            on_ready=lambda d: ready(f"improved: ready as {d.actor} on {where.where} "
                                     f"(pid {os.getpid()}); data directory "
                                     f"{config.data_dir.resolve()}"))

    gc.set_threshold(*GC_THRESHOLDS)
    try:
        # the credential files are read here, once
        where = (as_user(config, url, credentials.DAEMON) if config.accounts
                 else open_bus_daemon(config, url) if server is not None
                 else connection.target(url, config.nats))
        return asyncio.run(main())
    except metrics.EndpointError as exc:  # the daemon's metrics port: one line, as for a bus
        print(f"improved: {exc}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.stop()


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `run` commands to the `improved` parser."""
    run = sub.add_parser(
        "run", help="run the daemon",
        description="Run the daemon until SIGTERM/SIGINT, then drain and exit 0. Without --nats "
                    "(nor $IMPROVED_NATS_URL, nor nats_url in the config) it starts an embedded nats-server with "
                    "JetStream under --data-dir and prints where it listens. Streams, the "
                    "consumer and the buckets are created if missing, so starting twice "
                    "against the same server is safe; with deploy/accounts.conf the daemon's "
                    "user may not create or change them, so run `improved provision` with the "
                    "provisioning credential first. --accounts gives the embedded server the "
                    "users and permissions of deploy/accounts.conf, with passwords of the data "
                    "directory's own (<data_dir>/accounts/<user>.pw, 0600, made on the first "
                    "start), provisions as improved-admin, runs the daemon as improved with "
                    "services bound to their subjects; every command pointed at the data "
                    "directory finds its credential there. SIGHUP re-reads the configuration file's "
                    "trust store ([trust.operators], [trust.quorum], [trust.signers], "
                    "act_max_age_s) without a restart and logs what changed; a file that does "
                    "not load changes nothing (one error line). Everything else in it is read "
                    "at start only.",
        epilog=daemon_extra_note("run"))
    add_connection_args(run)
    run.add_argument("--port", type="port or free", metavar="N",
                     help="embedded server port (default: config port, else 4222; 0: a free "
                          "port, printed when it listens)")
    run.add_argument("--accounts", action="store_true",
                     help="embedded server: the users and permissions of deploy/accounts.conf, "
                          "credentials under <data_dir>/accounts (default: config accounts, "
                          "else off: anyone on the bus may publish anything)")
    run.add_argument("--metrics-port", type="port or free", metavar="N",
                     help="serve Prometheus /metrics, /healthz and /readyz on this port (0: a "
                          "free port, logged; default: config metrics_port, else off)")
    run.set_defaults(func=cmd_run)
