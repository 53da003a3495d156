"""`improved accounts add-service NAME`: a user of its own for a mesh service on the embedded
server run with --accounts, as deploy/accounts.conf gives one to each reference service."""

from __future__ import annotations

import argparse

from improved.cli.common import DATA_DIR_DEFAULT, config_of
from improved.cli.errors import USAGE, Failure
from improved.runtime import accounts as embedded


def cmd_add_service(args: argparse.Namespace) -> int:
    data_dir = config_of(args).data_dir
    if embedded.mode_in(data_dir) == "open":
        raise Failure(f"data directory {data_dir} holds a loop run without --accounts: its bus "
                      "has no users to add to", USAGE)
    path, new = embedded.add_service(data_dir, args.service)
    user = f"svc-{args.service}"
    if not new:
        print(f"{user} is a user of {data_dir} already; its password is in {path}")
    else:
        reloaded = embedded.reload(data_dir)
        print(f"{user}: a user of {data_dir} with svc-{embedded.LIKE}'s permissions for "
              f"service {args.service}; its password is in {path} (0600); "
              + ("the server running there reloaded its users" if reloaded
                 else "the server takes it at the next `improved run --accounts`"))
    print(f"connect as it with: IMPROVED_NATS_USER={user} "
          f"IMPROVED_NATS_PASSWORD_FILE={path.resolve()}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `accounts` commands to the `improved` parser."""
    group = sub.add_parser("accounts", help="users of the embedded server run with --accounts")
    cmds = group.add_subparsers(dest="accounts_command", required=True, metavar="COMMAND")
    add = cmds.add_parser(
        "add-service", help="give a mesh service a user of its own",
        description="Give service NAME the user svc-NAME on the embedded server of the data "
                    f"directory (run with --accounts): svc-{embedded.LIKE}'s permissions of "
                    "deploy/accounts.conf for its name — propose and report for itself, ask "
                    "about its own proposals, serve its own apply, measure and spec subjects, "
                    "read its own records and chains, and the reference ranking store's "
                    "buckets rank_NAME and applies_NAME — with a password of its own in "
                    "<data_dir>/accounts/svc-NAME.pw (0600). A running server reloads its "
                    "users at once. A service that needs other permissions needs its own entry "
                    "in deploy/accounts.conf, on a server of its own (deploy/README.md).")
    add.add_argument("service", metavar="NAME", help="the service's name, as its subjects have it")
    add.add_argument("--config", metavar="FILE",
                     help="TOML configuration file (default: $IMPROVED_CONFIG)")
    add.add_argument("--data-dir", metavar="DIR",
                     help=f"the embedded server's data directory (default: "
                          f"{DATA_DIR_DEFAULT})")
    add.set_defaults(func=cmd_add_service)
