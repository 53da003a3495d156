"""Agent tool surfaces and service conformance: `tools list|grant|upgrade|revoke`,
`conformance`."""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time

import msgspec

from improved.cli.common import (
    add_connection_args,
    add_signer_args,
    config_of,
    out,
    request,
    signer_of,
    url_of,
)
from improved.protocol import subjects as S
from improved.protocol.model import to_json
from improved.runtime import bus


def cmd_conformance(args: argparse.Namespace) -> int:
    from improved.runtime import conformance

    if not args.mesh and len(args.service) != 1:
        print("improved conformance: name one SERVICE, or give --mesh (with any services "
              "to probe besides those that answer discovery)", file=sys.stderr)
        return 2
    bad = [s for s in args.service if not S.SERVICE_RE.match(s)]
    if bad:
        print(f"improved conformance: service name {bad[0]!r} must match "
              f"{S.SERVICE_RE.pattern}", file=sys.stderr)
        return 2

    async def probe():
        nc = await bus.connect(url_of(args, config_of(args)), "improved-conformance")
        try:
            if args.mesh:
                return await conformance.probe_mesh(nc, args.service, timeout=args.timeout)
            return await conformance.probe(nc, args.service[0], timeout=args.timeout)
        finally:
            await bus.close(nc)

    report = asyncio.run(probe())
    if isinstance(report, conformance.MeshReport):
        print(conformance.render_mesh(report))
        return 0 if report.level is not None else 1
    print(conformance.render(report))
    return 0 if report.level is not None else 1


def cmd_tools_list(args: argparse.Namespace) -> int:
    reply = asyncio.run(request(url_of(args, config_of(args)), S.tools_list(args.runtime), b"{}",
                                 args.timeout))
    out(reply)
    return 1 if "error" in reply else 0


def cmd_tools_grant(args: argparse.Namespace) -> int:
    """Sign a per-call grant for one gated tool of a runtime; print the envelope for the agent
    (or, with --call, make the call with it and print the result)."""
    from improved.core import tools

    url = url_of(args, config_of(args))
    try:
        call_args = json.loads(args.args)
    except json.JSONDecodeError as exc:
        print(f"improved tools grant: --args is not JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(call_args, dict):
        print("improved tools grant: --args is a JSON object", file=sys.stderr)
        return 2
    principal, key = signer_of(args)
    catalog = asyncio.run(request(url, S.tools_list(args.runtime), b"{}", args.timeout))
    entry = next((t for t in catalog.get("tools", []) if t.get("name") == args.tool), None)
    if entry is None:
        print(f"improved tools grant: runtime {args.runtime} lists no tool {args.tool!r}",
              file=sys.stderr)
        return 1
    env = tools.sign_grant(key, principal, entry["grant_token"], args.tool, call_args,
                           args.reason, int(time.time() * 1000), int(args.ttl * 1000),
                           nonce=secrets.token_hex(16), runtime=args.runtime)
    if not args.call:
        out(msgspec.to_builtins(env))
        return 0
    body = to_json({"tool": args.tool, "args": call_args, "grant": env})
    reply = asyncio.run(request(url, S.tools_call(args.runtime), body, args.timeout))
    out(reply)
    return 0 if reply.get("ok") else 1


def cmd_tools_upgrade(args: argparse.Namespace) -> int:
    """Sign a session-scoped policy upgrade of a runtime; print it with its id."""
    from improved.core import scopes, tools

    if not args.tool and not args.cls:
        print("improved tools upgrade: name the tools (--tool) or classes (--class) it covers",
              file=sys.stderr)
        return 2
    scope = None
    if args.path or args.set or args.origin:
        scope = scopes.CapabilityScope(paths=args.path, sets=args.set, origins=args.origin)
        try:
            scopes.check_scope(scope, "--path/--origin")
        except ValueError as exc:
            print(f"improved tools upgrade: {exc}", file=sys.stderr)
            return 2
    principal, key = signer_of(args)
    try:
        env = tools.sign_upgrade(key, principal, args.runtime, args.session, args.reason,
                                 int(time.time() * 1000), int(args.ttl * 1000),
                                 nonce=secrets.token_hex(16), tools=args.tool,
                                 classes=args.cls, scope=scope)
    except msgspec.ValidationError as exc:
        print(f"improved tools upgrade: {exc}", file=sys.stderr)
        return 2
    out({"upgrade_id": tools.upgrade_id(env), "envelope": msgspec.to_builtins(env)})
    return 0


def cmd_tools_revoke(args: argparse.Namespace) -> int:
    """Sign the revocation of a session upgrade and send it to the runtime."""
    from improved.core import tools

    principal, key = signer_of(args)
    try:
        env = tools.sign_revocation(key, principal, args.runtime, args.upgrade_id, args.reason,
                                    int(time.time() * 1000))
    except msgspec.ValidationError as exc:
        print(f"improved tools revoke: {exc}", file=sys.stderr)
        return 2
    reply = asyncio.run(request(url_of(args, config_of(args)), S.tools_revoke(args.runtime),
                                to_json({"revocation": env}), args.timeout))
    out(reply)
    return 0 if reply.get("ok") else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `tools` commands to the `improved` parser."""
    conf = sub.add_parser(
        "conformance", help="which SPEC 09 conformance level a live service (or the mesh) meets",
        description="Probe a live service over NATS (spec.get, its apply subject, and for "
                    "higher levels its skills read and last-known-good check) with orders a "
                    "conformant service refuses, and report the level it meets (L0–L4) and "
                    "why not the next. With --mesh, every service that answers the "
                    "improved.spec.discover broadcast (and any SERVICE named) is probed, and the "
                    "mesh meets the lowest level of the services in the loop (SPEC 09). "
                    "Changes nothing. Exit 1 when not even L0.")
    add_connection_args(conf)
    conf.add_argument("service", metavar="SERVICE", nargs="*",
                      help="the service to probe (with --mesh: any besides those discovered)")
    conf.add_argument("--mesh", action="store_true",
                      help="probe every service that advertises, and report the mesh's level")
    conf.add_argument("--timeout", type=float, default=2.0, help="per request (2 s)")
    conf.set_defaults(func=cmd_conformance)

    tls = sub.add_parser(
        "tools", help="an agent runtime's tool surface (SPEC 09 §3.1)",
        description="List a runtime's tool catalog, or sign a per-call grant that mounts one "
                    "gated tool for exactly one call.")
    tls_sub = tls.add_subparsers(dest="tools_command", required=True, metavar="ACTION")
    tlist = tls_sub.add_parser(
        "list", help="the catalog: every tool, its class, whether it is mounted",
        description="Ask <runtime>.tools.list: every tool with its class (L0/L2/L4); a tool "
                    "above the runtime's ceiling shows gated_authority, mountable false and "
                    "its grant_token.")
    add_connection_args(tlist)
    tlist.add_argument("runtime", metavar="RUNTIME")
    tlist.add_argument("--timeout", type=float, default=5.0, help="seconds (5)")
    tlist.set_defaults(func=cmd_tools_list)
    tgrant = tls_sub.add_parser(
        "grant", help="sign a grant for one call of a gated tool",
        description="Look the tool's grant_token up in the runtime's catalog and sign a "
                    "per-call grant (DSSE, your operator key) bound to that token, the "
                    "runtime and the digest of exactly these arguments; it runs once. Prints "
                    "the envelope for the agent to present, or makes the call with --call.")
    add_connection_args(tgrant)
    tgrant.add_argument("runtime", metavar="RUNTIME")
    tgrant.add_argument("tool", metavar="TOOL")
    tgrant.add_argument("--args", default="{}", help="the call's arguments, a JSON object")
    tgrant.add_argument("--ttl", type=float, default=300.0, help="seconds the grant lives (300)")
    tgrant.add_argument("--call", action="store_true", help="make the call now with the grant")
    tgrant.add_argument("--timeout", type=float, default=5.0, help="seconds (5)")
    add_signer_args(tgrant)
    tgrant.set_defaults(func=cmd_tools_grant)
    tup = tls_sub.add_parser(
        "upgrade", help="sign a session-scoped upgrade: gated tools without per-call grants",
        description="Sign (DSSE, your operator key) a policy upgrade that lets one session of "
                    "one runtime call the tools (--tool) or classes (--class) it names without "
                    "a per-call grant, optionally within a narrower scope (--path, --set, "
                    "--origin), for --ttl seconds (at most 24 h) or until revoked. Prints "
                    "{upgrade_id, envelope}: the agent sends the envelope as `upgrade` with "
                    "its `session` on each call.")
    add_connection_args(tup)
    tup.add_argument("runtime", metavar="RUNTIME")
    tup.add_argument("--session", required=True, help="the session id the upgrade is for")
    tup.add_argument("--tool", action="append", help="a tool it covers (repeatable)")
    tup.add_argument("--class", dest="cls", action="append", choices=["L2", "L4"],
                     help="a class of tools it covers (repeatable)")
    tup.add_argument("--path", action="append", help="narrow to these path globs (repeatable)")
    tup.add_argument("--set", action="append", help="narrow to these sets (repeatable)")
    tup.add_argument("--origin", action="append", help="narrow to these origins (repeatable)")
    tup.add_argument("--ttl", type=float, default=3600.0, help="seconds it lives (3600)")
    add_signer_args(tup)
    tup.set_defaults(func=cmd_tools_upgrade)
    trev = tls_sub.add_parser(
        "revoke", help="end a session upgrade before it lapses",
        description="Sign the revocation of the upgrade UPGRADE_ID (as `tools upgrade` "
                    "printed it) and send it to <runtime>.tools.revoke; every replica of the "
                    "runtime refuses the upgrade from then on.")
    add_connection_args(trev)
    trev.add_argument("runtime", metavar="RUNTIME")
    trev.add_argument("upgrade_id", metavar="UPGRADE_ID")
    trev.add_argument("--timeout", type=float, default=5.0, help="seconds (5)")
    add_signer_args(trev)
    trev.set_defaults(func=cmd_tools_revoke)
