"""What every command shares: configuration and connection arguments, a one-shot
connection to a running deployment, finding a proposal, signing as an operator, output."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec
import structlog

from improved.cli import ids
from improved.cli.errors import USAGE, Failure
from improved.client import connection, credentials, keys
from improved.client.config import Config, load
from improved.client.connection import Target
from improved.client.deployment import Deployment
from improved.client.keys import load_key
from improved.protocol import subjects as S
from improved.protocol.model import Envelope, to_json

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from nats.aio.client import Client

    from improved.core.record import ProposalRecord

DEFAULT_URL = "nats://127.0.0.1:4222"
DATA_DIR_DEFAULT = ("$IMPROVED_DATA_DIR, else the config's data_dir, else "
                    "$XDG_STATE_HOME/improved, i.e. ~/.local/state/improved")


def configure_logging(level: str, json_logs: bool | None = None) -> None:
    """JSON lines, or a console renderer when attached to a terminal."""
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    renderer = (structlog.processors.JSONRenderer() if json_logs
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def config_of(args: argparse.Namespace) -> Config:
    """The configuration file (or the defaults), its data_dir replaced by --data-dir: the data
    directory is --data-dir, else $IMPROVED_DATA_DIR, else the config's data_dir, else
    $XDG_STATE_HOME/improved (`client.config.load`), never the working directory."""
    config = load(getattr(args, "config", None))
    if getattr(args, "data_dir", None):
        config = msgspec.structs.replace(config, data_dir=Path(args.data_dir))
    return config


def url_of(args: argparse.Namespace, config: Config) -> connection.Target:
    """Where the command connects (--nats, else $IMPROVED_NATS_URL, else the config's
    nats_url, else the embedded server running in the data directory, else the default) and
    as whom: the config's `[nats]` credentials and TLS files, or the environment's; with
    none, to the embedded server of the data directory run with --accounts, as the user the
    command needs (`as_user`, set by its parser: the operator unless it says otherwise),
    with its password file there."""
    return credentials.target(args.nats or config.nats_url, config.data_dir,
                              getattr(args, "as_user", credentials.OPERATOR), config.nats,
                              DEFAULT_URL)


def out(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


@asynccontextmanager
async def connected(url: str | Target) -> AsyncIterator[Client]:
    """A one-shot connection to a running deployment, closed on the way out."""
    nc = await connection.connect(url, "improved-cli", persistent=False)
    try:
        yield nc
    finally:
        await connection.close(nc)


@asynccontextmanager
async def deployment(url: str | Target, bind: bool = True) -> AsyncIterator[Deployment]:
    """A one-shot connection to a running deployment, its buckets found (nothing created)."""
    async with connected(url) as nc:
        store = Deployment(nc)
        if bind:
            await store.bind()
        yield store


async def request(url: str | Target, subject: str, body: bytes, timeout: float) -> dict[str, Any]:
    """One request and its JSON reply (an object); nobody serving `subject`, no answer in
    time, or an answer that is no JSON object, is a Failure naming the subject."""
    from nats.errors import NoRespondersError

    async with deployment(url, bind=False) as store:
        try:
            reply = await store.nc.request(subject, body, timeout=timeout)
        except NoRespondersError:
            raise Failure(f"nothing serves {subject}: start what answers it (the daemon, or "
                          "the runtime or service the subject names), or check --nats") from None
        except TimeoutError:
            raise Failure(f"no answer on {subject} within {timeout:g} s: is what serves it "
                          "busy or stuck? try again with a longer --timeout") from None
        try:
            return msgspec.json.decode(reply.data, type=dict[str, Any])
        except msgspec.MsgspecError as exc:
            raise Failure(f"the answer on {subject} is no JSON object ({exc})") from None


def read_input(path: str, what: str) -> bytes:
    """The bytes of FILE, or stdin for `-`; a Failure (usage) naming the file otherwise."""
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise Failure(f"cannot read the {what} {path}: {exc.strerror or exc}; give the path "
                      f"of a {what}, or - to read it from stdin", USAGE) from None


def json_object(data: bytes, path: str, what: str) -> dict[str, Any]:
    """The JSON object FILE holds; a Failure (usage) naming the file and, for bad JSON, the
    line and column where the parser stopped and what it expected there."""
    where = "stdin" if path == "-" else path
    try:
        doc = json.loads(data)
    except UnicodeDecodeError as exc:
        raise Failure(f"{where} is not UTF-8 text (byte {exc.start}): a {what} is a JSON "
                      "object", USAGE) from None
    except json.JSONDecodeError as exc:
        raise Failure(f"{where}, line {exc.lineno}, column {exc.colno}: not JSON: {exc.msg}; "
                      f"a {what} is a JSON object", USAGE) from None
    if not isinstance(doc, dict):
        raise Failure(f"{where} holds a JSON {_json_kind(doc)}, not an object: a {what} is a "
                      "JSON object", USAGE)
    return doc


def _json_kind(value: object) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


async def chain_record(store: Deployment, svc: str, pid: str) -> ProposalRecord | None:
    """The record of proposal `pid` as its chain says — never its retained records: None
    without a chain whose links verify, or with one whose registration cannot be read."""
    from improved.client.chain_writer import decode_trailer
    from improved.core import audit
    from improved.core.policy import Policy
    from improved.core.propose import rebuild_record

    chain = await store.read_chain(svc, pid)
    if not chain or audit.verify_links(pid, [body for _, body in chain]) is not None:
        return None
    try:
        return rebuild_record([decode_trailer(body) for _, body in chain],
                              [seq for seq, _ in chain], Policy())
    except ValueError:  # no registration it can read
        return None


async def locate(url: str | Target, text: str) -> tuple[str, ProposalRecord] | None:
    """(service, record) of the proposal `text` names (a full id or a unique prefix,
    `cli.ids`) as its chain says (`chain_record`), since what an operator or a voter signs
    names it: None without a chain whose links verify. The record carries the full id."""
    async with deployment(url) as store:
        svc, pid = await ids.resolve(store, text)
        record = await chain_record(store, svc, pid)
        return None if record is None else (svc, record)


def located(url: str | Target, text: str) -> tuple[str, ProposalRecord]:
    """`locate` for a command that acts on the proposal: a Failure (exit 1) without one."""
    found = asyncio.run(locate(url, text))
    if found is None:
        raise Failure(f"no proposal {text} whose audit chain verifies")
    return found


async def full_id(url: str | Target, text: str) -> str:
    """The full id `text` names; a full id as given, without connecting."""
    if ids.is_full(text):
        return text
    async with deployment(url, bind=False) as store:
        return await ids.full_id(store, text)


def signer_of(args: argparse.Namespace) -> tuple[str, Ed25519PrivateKey]:
    """(principal, private key) from --key, or from --principal's file in the key directory."""
    if args.key:
        if args.principal:
            operator_named(args.principal)
        key = load_signing_key(Path(args.key))
        principal = args.principal or Path(args.key).stem.replace("_", ":", 1)
        return principal, key
    principal = args.principal or os.environ.get("IMPROVED_PRINCIPAL")
    if not principal:
        found = sorted(keys.key_dir().glob("operator_*.pem"))
        if len(found) != 1:
            raise Failure(f"say who signs: --principal operator:NAME or --key FILE (the key "
                          f"directory {keys.key_dir()} holds {len(found)} operator keys, not "
                          "one)", USAGE)
        principal = found[0].stem.replace("_", ":", 1)
    operator_named(principal)
    path = keys.key_path(principal)
    if not path.exists():
        raise Failure(f"no key for {principal} at {path} (the key directory is $IMPROVED_KEYS, "
                      f"else ~/.config/improved/keys): make one with `improved keys new "
                      f"--principal {principal}`, or give --key FILE", USAGE)
    return principal, load_signing_key(path)


def operator_named(principal: str) -> None:
    """A Failure (usage) unless `principal` is operator:NAME, suggesting the one meant: the
    daemon counts an act only under such a name."""
    if not principal.startswith("operator:") or principal == "operator:":
        name = principal.rpartition(":")[2] or "NAME"
        raise Failure(f"{principal!r} is not an operator: a principal is operator:NAME (did "
                      f"you mean --principal operator:{name}?)", USAGE)


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """An Ed25519 private key from a PEM file; a Failure (usage) naming the file otherwise."""
    try:
        return load_key(path)
    except OSError as exc:
        raise Failure(f"cannot read key file {path}: {exc.strerror or exc}; give the file "
                      "`improved keys new` wrote", USAGE) from None
    except (ValueError, TypeError) as exc:
        why = str(exc) if str(exc).startswith(str(path)) else f"{path} is not a PEM private key"
        raise Failure(f"{why}; give the unencrypted Ed25519 PEM file `improved keys new` wrote",
                      USAGE) from None


async def publish_on(store: Deployment, subject: str, env: Envelope) -> None:
    """A signed act onto the inbound stream, where the daemon's consumer takes it."""
    await store.js.publish(subject, to_json(env), stream=S.STREAM_INBOUND)


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", metavar="URL",
                   help=f"NATS server URL (default: $IMPROVED_NATS_URL, else config "
                        f"nats_url, else the server running in --data-dir, else {DEFAULT_URL}); "
                        "credentials come from the config's [nats] files or IMPROVED_NATS_* "
                        "(a user:password in the URL still works), else, for the server of "
                        "--data-dir run with --accounts, from DIR/accounts")
    p.add_argument("--config", metavar="FILE",
                   help="TOML configuration file (default: $IMPROVED_CONFIG)")
    p.add_argument("--data-dir", metavar="DIR",
                   help=f"the data directory (default: {DATA_DIR_DEFAULT}): where "
                        "`improved run` keeps its embedded server, its checkpoint key and "
                        "its last checkpoint; a command without a URL uses the server "
                        "running there, and when that runs with --accounts, its user's "
                        "password file in DIR/accounts")



def port_type(free: bool = False) -> Callable[[str], int]:
    """The argparse type of every port flag: 1 to 65535, and 0 where the command takes it
    for a free port (`free`); anything else is a usage error naming the flag and the range."""
    low, zero = (0, " (0: a free port)") if free else (1, "")

    def port(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            number = -1
        if not low <= number <= 65535:
            raise argparse.ArgumentTypeError(f"a port is {low} to 65535{zero}, not {text!r}")
        return number

    return port


class OneLineParser(argparse.ArgumentParser):
    """argparse, its usage errors said in one line (with where the help is), exit 2; every
    subcommand's parser is one too (argparse makes them of the parent's class). A port flag
    names its type: `type="port"` (1 to 65535) or `type="port or free"` (0 too: a free one)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("type", "port", port_type())
        self.register("type", "port or free", port_type(free=True))

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: {message}; see `{self.prog} --help`\n")


def add_signer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reason", required=True, help="why (recorded in the audit trail)")
    p.add_argument("--principal", metavar="operator:NAME",
                   help="who signs (default: $IMPROVED_PRINCIPAL, or the only key in "
                        "the key directory)")
    p.add_argument("--key", metavar="FILE", help="the private key file to sign with")
