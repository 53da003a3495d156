"""The one-line error an operator sees instead of a traceback: what is wrong, naming the file,
key or entry, and the fix. `improved.cli.main` prints it after the command's name and exits
with its code: 1 when the command ran and the answer is no (refused, broken, not found), 2 when
it could not run as given (a usage error, a bad configuration, key or input file)."""

from __future__ import annotations

import argparse

REFUSED = 1
USAGE = 2


class Failure(Exception):
    def __init__(self, message: str, code: int = REFUSED):
        super().__init__(message)
        self.code = code


def command_name(args: argparse.Namespace) -> str:
    """`audit verify`, `keys new`, `show`: the words the operator typed to name the command."""
    words = [args.command]
    words += [value for key, value in sorted(vars(args).items())
              if key.endswith("_command") and isinstance(value, str)]
    return " ".join(words)
