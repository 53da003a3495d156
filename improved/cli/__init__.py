"""`improved`: the daemon and the operator's terminal.

    improved run [--nats URL] [--config FILE] [--data-dir DIR] [--port N] [--accounts]
    improved accounts add-service NAME
    improved provision [--nats URL] [--config FILE] [--replicas N]
    improved propose FILE|-
    improved show ID
    improved audit verify [ID]
    improved keys new --principal operator:NAME
    improved review
    improved approve|reject ID --reason … [--timeout S] [--no-wait]
    improved retry ID
    improved grant NAME:SHA256 --proposal ID --reason … | revoke NAME:SHA256 --reason …
    improved revert ID
    improved vote ID approve|dissent --session S --read …
    improved conformance SERVICE
    improved tools list|grant RUNTIME …
    improved skill hash FILE
    improved console [--port P] [--key FILE --principal operator:NAME]
    improved mcp --service SVC --agent NAME [--key FILE] [--http PORT]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from improved.cli import (
    accounts,
    audit,
    authority,
    console,
    mcp,
    proposals,
    provision,
    reference,
    run,
    tools,
)
from improved.cli.common import OneLineParser, configure_logging
from improved.cli.errors import (
    BROKEN_PIPE,
    INTERRUPTED,
    USAGE,
    Failure,
    MissingExtra,
    command_name,
    missing_extra,
)
from improved.client import connection
from improved.client.connection import ConfigError
from improved.client.credentials import AccountsError
from improved.client.streams import StoreError

GROUPS = (run, accounts, provision, proposals, audit, authority, tools, console, mcp,
          reference)


def parser() -> argparse.ArgumentParser:
    """The `improved` parser: each command group adds its own commands."""
    top = OneLineParser(
        prog="improved",
        description="The self-improve daemon of a service mesh: proposals pass observe → propose "
                    "→ triage → apply → learn-back over NATS JetStream, gated by their L0–L4 "
                    "class, with every transition in a hash-chained audit trail.",
    )
    top.add_argument("--log-level", default="info",
                     help="debug, info, warning or error (default: info)")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for group in GROUPS:
        group.register(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    """Run one command; every error it raises is one line on stderr and an exit code
    (`improved.cli.errors`), never a traceback."""
    try:
        args = parser().parse_args(argv)
        configure_logging(args.log_level)
        code = run_command(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the exit
        return code
    except KeyboardInterrupt:
        return INTERRUPTED
    except BrokenPipeError:
        # the reader went away (`improved status | head -1`): say nothing more, as the Python
        # docs advise — stdout to devnull, so the flush at exit cannot fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE


def run_command(args: argparse.Namespace) -> int:
    """The command `args` names, its known errors said in one line."""
    try:
        command: Callable[[argparse.Namespace], int] = args.func  # set by each subcommand
        return command(args)
    except Failure as exc:
        print(f"improved {command_name(args)}: {exc}", file=sys.stderr)
        return exc.code
    except ConfigError as exc:
        print(f"improved: {exc}", file=sys.stderr)
        return USAGE
    except (connection.BusError, StoreError, AccountsError) as exc:
        print(f"improved: {exc}", file=sys.stderr)
        return USAGE
    except ModuleNotFoundError as exc:
        extra = missing_extra(exc)
        if extra is None:
            raise
        print(MissingExtra(command_name(args), extra), file=sys.stderr)
        return MissingExtra.code
