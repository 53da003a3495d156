"""The one-line error an operator sees instead of a traceback: what is wrong, naming the file,
key or entry, and the fix. `improved.cli.main` prints it after the command's name and exits
with its code. The exit codes, the same for every `improved` command:

    0    done
    1    the command ran and the answer is no: refused, rejected, not found, BROKEN
         (something forged, altered or missing)
    2    it could not run as given: a usage error or bad flag value, a bad configuration,
         key or input file, nothing reachable at the URL, a missing extra
    3    UNVERIFIED: nothing wrong was found, but what needs a trust anchor (a trusted
         daemon key) was not checked
    130  interrupted (Ctrl-C)
    141  its output was closed early (`improved status | head -1`): quietly, as a shell
         pipeline's command killed by SIGPIPE (128 + 13)"""

from __future__ import annotations

import argparse

OK = 0
REFUSED = 1
USAGE = 2
UNVERIFIED = 3
INTERRUPTED = 130
BROKEN_PIPE = 141
DAEMON_EXTRA = "pip install 'improved[daemon]'"


class Failure(Exception):
    def __init__(self, message: str, code: int = REFUSED):
        super().__init__(message)
        self.code = code


class MissingExtra(Exception):
    """A command that needs an extra the install lacks, said in one line: `improved run needs
    the daemon extra: pip install 'improved[daemon]'`, `improved mcp needs the agents extra:
    pip install 'improved[agents]'`; exit 2."""

    code = USAGE

    def __init__(self, command: str, extra: str = "daemon"):
        super().__init__(f"improved {command} needs the {extra} extra: "
                         f"pip install 'improved[{extra}]'")


# what the daemon extra installs: a command that imports one of them needs it
DAEMON_MODULES = frozenset({"anyio", "prometheus_client"})
# what the agents extra installs (the MCP SDK and the HTTP server it serves with)
AGENTS_MODULES = frozenset({"mcp", "mcp_types", "uvicorn", "starlette", "pydantic"})


def missing_daemon_module(exc: ModuleNotFoundError) -> bool:
    """The import failed for want of the daemon extra, not for a fault of this package."""
    return (exc.name or "").partition(".")[0] in DAEMON_MODULES


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The extra whose absence failed the import (`daemon`, `agents`), or None: a fault of
    this package, not of the install."""
    top = (exc.name or "").partition(".")[0]
    return "agents" if top in AGENTS_MODULES else "daemon" if top in DAEMON_MODULES else None


def daemon_extra_note(command: str) -> str | None:
    """The line `COMMAND --help` adds on an install without the daemon extra; None with it."""
    return extra_note(command, "daemon", DAEMON_MODULES)


def extra_note(command: str, extra: str, modules: frozenset[str]) -> str | None:
    """The line `COMMAND --help` adds on an install without `extra`; None with it."""
    from importlib.util import find_spec

    for module in sorted(modules):
        try:
            found = find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            return str(MissingExtra(command, extra))
    return None


def command_name(args: argparse.Namespace) -> str:
    """`audit verify`, `keys new`, `show`: the words the operator typed to name the command."""
    words = [args.command]
    words += [value for key, value in sorted(vars(args).items())
              if key.endswith("_command") and isinstance(value, str)]
    return " ".join(words)

