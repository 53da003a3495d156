"""`improved`: the daemon and the operator's terminal.

    improved run [--nats URL] [--config FILE] [--data-dir DIR] [--port N]
    improved propose FILE|-
    improved show ID
    improved audit verify [ID]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import msgspec
import structlog

from . import audit, bus
from . import subjects as S
from .config import Config, ConfigError, load
from .store import Store

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


def _config(args: argparse.Namespace) -> Config:
    return load(getattr(args, "config", None))


def _url(args: argparse.Namespace, config: Config) -> str:
    return args.nats or config.nats_url or DEFAULT_URL


def out(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


# -- run -----------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from .daemon import run_until_stopped

    config = _config(args)
    if args.data_dir:
        config = replace(config, data_dir=Path(args.data_dir))
    if args.port:
        config = replace(config, port=args.port)
    url = args.nats or config.nats_url
    server = None
    if url is None:
        server = bus.EmbeddedServer(config.data_dir, config.port, config.sync)
        url = server.start()
        print(f"improved: embedded nats-server (JetStream, sync={config.sync}) listening on "
              f"{url}; store {config.data_dir.resolve() / 'jetstream'}", file=sys.stderr,
              flush=True)

    async def main() -> int:
        nc = await bus.connect(url, "improved")
        return await run_until_stopped(
            nc, config, on_ready=lambda d: print(f"improved: ready as {d.actor} on {url}",
                                                 file=sys.stderr, flush=True))

    try:
        return asyncio.run(main())
    finally:
        if server is not None:
            server.stop()


# -- client commands ------------------------------------------------------------------------------


async def _request(url: str, subject: str, body: bytes, timeout: float) -> dict[str, Any]:
    nc = await bus.connect(url, "improved-cli", persistent=False)
    try:
        reply = await nc.request(subject, body, timeout=timeout)
        return msgspec.json.decode(reply.data)
    finally:
        await nc.close()


def cmd_propose(args: argparse.Namespace) -> int:
    config = _config(args)
    data = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    try:
        svc = msgspec.json.decode(data).get("service")
    except (msgspec.DecodeError, AttributeError):
        print("improved propose: the file is not a JSON object", file=sys.stderr)
        return 2
    if not isinstance(svc, str) or not S.SERVICE_RE.match(svc):
        print("improved propose: the proposal needs a valid `service`", file=sys.stderr)
        return 2
    reply = asyncio.run(_request(_url(args, config), S.propose_request(svc), data, args.timeout))
    out(reply)
    return 1 if "error" in reply else 0


async def _find(store: Store, pid: str) -> tuple[str, str] | None:
    for key in await store.keys():
        svc, _, kid = key.partition(".")
        if kid == pid:
            return svc, kid
    return None


async def _show(url: str, pid: str) -> int:
    nc = await bus.connect(url, "improved-cli", persistent=False)
    try:
        store = Store(nc)
        await store.bind()
        found = await _find(store, pid)
        if found is None:
            print(f"improved show: no proposal {pid}", file=sys.stderr)
            return 1
        svc, pid = found
        view: dict[str, Any] = {}
        for name, subject in (("state", S.proposal_state(svc, pid)),
                              ("decision", S.triage_decision(svc, pid)),
                              ("outcome", S.apply_outcome(svc, pid)),
                              ("learn_back", S.learn_back(svc, pid))):
            data = await store.last(subject)
            view[name] = msgspec.json.decode(data) if data else None
        chain = [body for _, body in await store.read_chain(svc, pid)]
        view["trailers"] = chain
        brk = audit.verify_chain(pid, chain)
        view["chain"] = "verified" if brk is None else f"BROKEN: {brk}"
        out(view)
        return 0
    finally:
        await nc.close()


def cmd_show(args: argparse.Namespace) -> int:
    return asyncio.run(_show(_url(args, _config(args)), args.id))


async def _verify(url: str, pid: str | None) -> int:
    nc = await bus.connect(url, "improved-cli", persistent=False)
    try:
        store = Store(nc)
        chains = await read_all_chains(store, pid)
        broken = 0
        trailers = 0
        for (_, cpid), bodies in sorted(chains.items()):
            trailers += len(bodies)
            brk = audit.verify_chain(cpid, bodies)
            if brk is not None:
                broken += 1
                print(f"BROKEN {brk}")
        if pid is not None and not chains:
            print(f"improved audit verify: no chain for {pid}", file=sys.stderr)
            return 1
        print(f"{len(chains) - broken}/{len(chains)} chains verified, {trailers} trailers"
              + (f", {broken} broken" if broken else ""))
        return 1 if broken else 0
    finally:
        await nc.close()


async def read_all_chains(store: Store, pid: str | None = None) -> dict[tuple[str, str],
                                                                          list[dict]]:
    """Every chain (or one), read once through an ordered consumer, in stream order."""
    info = await store.js.stream_info(S.STREAM_AUDIT)
    chains: dict[tuple[str, str], list[dict]] = {}
    if info.state.messages == 0:
        return chains
    subject = S.audit("*", pid) if pid else S.AUDIT_FILTER
    if pid:
        filtered = await store.js.stream_info(S.STREAM_AUDIT, subjects_filter=subject)
        if not filtered.state.subjects:
            return chains
    sub = await store.js.subscribe(subject, ordered_consumer=True, stream=S.STREAM_AUDIT)
    try:
        while True:
            msg = await sub.next_msg(timeout=5)
            svc, cpid = S.token(msg.subject, 2), S.token(msg.subject, 3)
            chains.setdefault((svc, cpid), []).append(msgspec.json.decode(msg.data))
            if msg.metadata.num_pending == 0:
                return chains
    finally:
        await sub.unsubscribe()


def cmd_audit_verify(args: argparse.Namespace) -> int:
    return asyncio.run(_verify(_url(args, _config(args)), args.id))


# -- parser -----------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="improved",
        description="The self-improve daemon of a service mesh: proposals pass observe → propose "
                    "→ triage → apply → learn-back over NATS JetStream, gated by their L0–L4 "
                    "class, with every transition in a hash-chained audit trail.",
    )
    top.add_argument("--log-level", default="info",
                     help="debug, info, warning or error (default: info)")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--nats", metavar="URL",
                       help=f"NATS server URL (default: config nats_url, else {DEFAULT_URL})")
        p.add_argument("--config", metavar="FILE",
                       help="TOML configuration file (default: $IMPROVED_CONFIG)")

    run = sub.add_parser(
        "run", help="run the daemon",
        description="Run the daemon until SIGTERM/SIGINT, then drain and exit 0. Without --nats "
                    "(and no nats_url in the config) it starts an embedded nats-server with "
                    "JetStream under --data-dir and prints where it listens. Streams, the "
                    "consumer and the state bucket are created if missing, so starting twice "
                    "against the same server is safe.")
    common(run)
    run.add_argument("--data-dir", metavar="DIR",
                     help="where the embedded server keeps JetStream (default: .improved)")
    run.add_argument("--port", type=int, metavar="N",
                     help="embedded server port (default: 4222)")
    run.set_defaults(func=cmd_run)

    prop = sub.add_parser(
        "propose", help="submit a proposal (JSON) and print its id and status",
        description="Send a Proposal (DESIGN §3.2) to <service>.improve.propose and print the "
                    "reply: {proposal_id, status}, or the error naming the bad field. Exits 1 "
                    "on an error reply.")
    common(prop)
    prop.add_argument("file", metavar="FILE|-", help="the proposal JSON, or - for stdin")
    prop.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (10)")
    prop.set_defaults(func=cmd_propose)

    show = sub.add_parser(
        "show", help="show a proposal: state, decision, outcome, trailers",
        description="Print a proposal's retained records (state, triage decision, apply "
                    "outcome, learn-back) and its audit trailers, and whether the chain "
                    "verifies.")
    common(show)
    show.add_argument("id", metavar="ID", help="the 64-hex proposal id")
    show.set_defaults(func=cmd_show)

    aud = sub.add_parser("audit", help="verify the audit chains",
                         description="Audit chain tools.")
    aud_sub = aud.add_subparsers(dest="audit_command", required=True, metavar="ACTION")
    verify = aud_sub.add_parser(
        "verify", help="re-derive every hash and link; name the first break",
        description="Read every audit chain (or one proposal's) from the broker, re-derive "
                    "each trailer's hash and its link to the previous one, and print the first "
                    "break of each broken chain. Exits 1 if any chain is broken.")
    common(verify)
    verify.add_argument("id", metavar="ID", nargs="?", help="only this proposal's chain")
    verify.set_defaults(func=cmd_audit_verify)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"improved: {exc}", file=sys.stderr)
        return 2
    except bus.BusError as exc:
        print(f"improved: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
