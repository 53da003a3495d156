"""What every command shares: configuration and connection arguments, a one-shot
connection to a running deployment, finding a proposal, signing as an operator, output."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import structlog

from improved.protocol import subjects as S
from improved.protocol.model import to_json
from improved.runtime import bus, keys
from improved.runtime.bus import Target
from improved.runtime.config import Config, load
from improved.runtime.store import Store

DEFAULT_URL = "nats://127.0.0.1:4222"


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
    return load(getattr(args, "config", None))


def url_of(args: argparse.Namespace, config: Config) -> bus.Target:
    """Where the command connects (--nats, else the config's nats_url, else the default) and
    as whom (the config's `[nats]` credentials and TLS files, or the environment's)."""
    return bus.target(args.nats or config.nats_url or DEFAULT_URL, config.nats)


def out(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


@asynccontextmanager
async def deployment(url: str | Target, bind: bool = True) -> AsyncIterator[Store]:
    """A one-shot connection to a running deployment, its buckets bound (nothing created)."""
    nc = await bus.connect(url, "improved-cli", persistent=False)
    try:
        store = Store(nc)
        if bind:
            await store.bind()
        yield store
    finally:
        await bus.close(nc)


async def request(url: str | Target, subject: str, body: bytes, timeout: float) -> dict[str, Any]:
    async with deployment(url, bind=False) as store:
        reply = await store.nc.request(subject, body, timeout=timeout)
        return msgspec.json.decode(reply.data)


async def find_proposal(store: Store, pid: str) -> tuple[str, str] | None:
    """(service, id) of a proposal, from its audit chain's subject: one stream-info request
    instead of listing every key of the state bucket."""
    if not S.ID_RE.match(pid):
        return None
    svc = await store.service_of(pid)
    return (svc, pid) if svc is not None else None


async def locate(url: str | Target, pid: str) -> tuple[str, Any] | None:
    """(service, record) of a proposal as its chain says — never the state cache, since what
    an operator or a voter signs names it: None without a chain whose links verify."""
    from improved.core import audit
    from improved.core.policy import Policy
    from improved.core.propose import rebuild_record
    from improved.runtime.store import decode_trailer

    async with deployment(url) as store:
        found = await find_proposal(store, pid)
        if found is None:
            return None
        chain = await store.read_chain(*found)
        if not chain or audit.verify_links(pid, [body for _, body in chain]) is not None:
            return None
        record = rebuild_record([decode_trailer(body) for _, body in chain],
                                [seq for seq, _ in chain], Policy())
        return found[0], record


def signer_of(args: argparse.Namespace) -> tuple[str, Any]:
    """(principal, private key) from --key, or from --principal's file in the key directory."""
    if args.key:
        key = keys.load_key(Path(args.key))
        principal = args.principal or Path(args.key).stem.replace("_", ":", 1)
        return principal, key
    principal = args.principal or os.environ.get("IMPROVED_PRINCIPAL")
    if not principal:
        found = sorted(keys.key_dir().glob("operator_*.pem"))
        if len(found) != 1:
            raise SystemExit("improved: say who signs: --principal operator:NAME or --key FILE")
        principal = found[0].stem.replace("_", ":", 1)
    return principal, keys.load_key(keys.key_path(principal))


async def publish_act(url: str | Target, subject: str, env) -> None:
    async with deployment(url, bind=False) as store:
        await store.js.publish(subject, to_json(env), stream=S.STREAM_INBOUND)


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", metavar="URL",
                   help=f"NATS server URL (default: config nats_url, else {DEFAULT_URL}); "
                        "credentials come from the config's [nats] files or IMPROVED_NATS_* "
                        "(a user:password in the URL still works)")
    p.add_argument("--config", metavar="FILE",
                   help="TOML configuration file (default: $IMPROVED_CONFIG)")



def add_signer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reason", required=True, help="why (recorded in the audit trail)")
    p.add_argument("--principal", metavar="operator:NAME",
                   help="who signs (default: $IMPROVED_PRINCIPAL, or the only key in "
                        "the key directory)")
    p.add_argument("--key", metavar="FILE", help="the private key file to sign with")
