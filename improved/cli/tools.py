"""Agent tool surfaces and service conformance: `tools list|grant|upgrade|call|revoke`,
`conformance`."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from improved.cli.common import (
    add_connection_args,
    add_signer_args,
    config_of,
    load_signing_key,
    out,
    read_input,
    request,
    signer_of,
    url_of,
)
from improved.cli.errors import USAGE, Failure
from improved.client import connection, credentials
from improved.protocol import subjects as S
from improved.protocol.model import Envelope, to_json

SESSION_KEY_HELP = ("the session's own Ed25519 key (`improved keys new` makes one; `improved "
                    "keys show FILE` prints its public half): the upgrade is bound to it, and "
                    "each call under the upgrade must carry a proof signed by it, so the "
                    "upgrade is useless to anyone who only copies the envelope")


def session_public_key(text: str) -> str:
    """`--session-key FILE|PUBKEY` of `tools upgrade`: base64 of the raw public key, from the
    session's key file or given as such; a Failure (usage) saying which it is not."""
    from improved.core import tools

    if Path(text).is_file():
        return tools.public_key_b64(load_signing_key(Path(text)))
    try:
        tools.parse_public_key(text)
    except ValueError as exc:
        raise Failure(f"--session-key {text!r} is neither a key file nor a public key: {exc} "
                      "(`improved keys show FILE` prints one)", USAGE) from None
    return text


def _envelope(path: str, what: str) -> Envelope:
    """A DSSE envelope from FILE (or `-`): bare, or as `tools upgrade` prints it."""
    raw = read_input(path, what)
    try:
        obj: Any = json.loads(raw)
        if isinstance(obj, dict) and "envelope" in obj:
            obj = obj["envelope"]
        return msgspec.convert(obj, Envelope)
    except (ValueError, msgspec.ValidationError) as exc:
        raise Failure(f"the {what} {path} is not a DSSE envelope (as `improved tools upgrade` "
                      f"or `tools grant` prints it): {exc}", USAGE) from None


def cmd_conformance(args: argparse.Namespace) -> int:
    from improved.client import conformance

    if not args.mesh and len(args.service) != 1:
        print("improved conformance: name one SERVICE, or give --mesh (with any services "
              "to probe besides those that answer discovery)", file=sys.stderr)
        return 2
    bad = [s for s in args.service if not S.SERVICE_RE.match(s)]
    if bad:
        print(f"improved conformance: service name {bad[0]!r} must match "
              f"{S.SERVICE_RE.pattern}", file=sys.stderr)
        return 2

    async def probe() -> conformance.Report | conformance.MeshReport:
        nc = await connection.connect(url_of(args, config_of(args)), "improved-conformance")
        try:
            if args.mesh:
                return await conformance.probe_mesh(nc, args.service, timeout=args.timeout)
            return await conformance.probe(nc, args.service[0], timeout=args.timeout)
        finally:
            await connection.close(nc)

    report = asyncio.run(probe())
    if isinstance(report, conformance.MeshReport):
        print(conformance.render_mesh(report))
        if not report.reports:
            return 2  # nothing answered discovery and nothing was named: nothing to probe
        none_met = report.level is None and bool(report.participants)
        return 1 if none_met or any(conformance.failed(r) for r in report.reports) else 0
    print(conformance.render(report))
    return 1 if report.level is None or conformance.failed(report) else 0


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
    if too_long("grant", args.ttl, tools.MAX_GRANT_MS):
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


def too_long(what: str, ttl_s: float, most_ms: int) -> bool:
    """Whether `--ttl` asks for a grant or upgrade every runtime would refuse
    `window_too_long`; if so, say so in one line: nothing is signed."""
    if ttl_s * 1000 <= most_ms:
        return False
    print(f"improved tools {what}: --ttl {ttl_s:g} is too long: a{'n' if what[0] in 'aeiou' else ''} "
          f"{what} lives at most {most_ms // 1000} s ({most_ms // 3_600_000} h); nothing signed",
          file=sys.stderr)
    return True


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
    if too_long("upgrade", args.ttl, tools.MAX_UPGRADE_MS):
        return 2
    session_key = session_public_key(args.session_key)
    principal, key = signer_of(args)
    try:
        env = tools.sign_upgrade(key, principal, args.runtime, args.session, args.reason,
                                 int(time.time() * 1000), int(args.ttl * 1000),
                                 nonce=secrets.token_hex(16), tools=args.tool,
                                 classes=args.cls, scope=scope, session_key=session_key)
    except msgspec.ValidationError as exc:
        print(f"improved tools upgrade: {exc}", file=sys.stderr)
        return 2
    out({"upgrade_id": tools.upgrade_id(env), "envelope": msgspec.to_builtins(env)})
    return 0


def cmd_tools_call(args: argparse.Namespace) -> int:
    """Call one tool of a runtime, with a grant, or under a session upgrade with a proof
    signed by the session's key; print the reply."""
    from improved.core import tools

    try:
        call_args = json.loads(args.args)
    except json.JSONDecodeError as exc:
        raise Failure(f"--args is not JSON: {exc}", USAGE) from None
    if not isinstance(call_args, dict):
        raise Failure("--args is a JSON object", USAGE)
    if (args.upgrade is None) != (args.session_key is None):
        raise Failure("--upgrade and --session-key go together: the proof of a call under an "
                      "upgrade is signed by the session's key", USAGE)
    body: dict[str, Any] = {"tool": args.tool, "args": call_args}
    if args.grant is not None:
        body["grant"] = _envelope(args.grant, "grant file")
    if args.upgrade is not None:
        env = _envelope(args.upgrade, "upgrade file")
        if not Path(args.session_key).is_file():
            raise Failure(f"--session-key {args.session_key}: give the session's private key "
                          "file (`improved keys new` wrote it); a public key cannot sign the "
                          "proof", USAGE)
        key = load_signing_key(Path(args.session_key))
        try:
            act = msgspec.json.decode(base64.b64decode(env.payload), type=tools.SessionUpgrade)
        except (ValueError, msgspec.MsgspecError) as exc:
            raise Failure(f"the upgrade file {args.upgrade} does not hold a session upgrade: "
                          f"{exc}", USAGE) from None
        if act.session_key is not None and act.session_key != tools.public_key_b64(key):
            raise Failure(f"--session-key {args.session_key} is not the key the upgrade is "
                          f"bound to ({act.session_key})", USAGE)
        body.update(session=args.session or act.session, upgrade=env,
                    proof=tools.sign_proof(key, args.runtime, args.tool, call_args,
                                           tools.upgrade_id(env), int(time.time() * 1000),
                                           nonce=secrets.token_hex(16)))
    elif args.session is not None:
        body["session"] = args.session
    try:
        payload = to_json(body)
    except (TypeError, msgspec.EncodeError) as exc:
        raise Failure(f"the call cannot be sent: {exc}", USAGE) from None
    reply = asyncio.run(request(url_of(args, config_of(args)), S.tools_call(args.runtime),
                                payload, args.timeout))
    out(reply)
    return 0 if reply.get("ok") else 1


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


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `tools` commands to the `improved` parser."""
    conf = sub.add_parser(
        "conformance", help="which SPEC 09 conformance level a live service (or the mesh) meets",
        description="Probe a live service over NATS (spec.get, its apply subject, and for "
                    "higher levels its skills read and last-known-good check) with orders a "
                    "conformant service refuses, and report the level it meets (L0–L4) and "
                    "why not the next. With --mesh, every service that answers the "
                    "improved.spec.discover broadcast (and any SERVICE named) is probed, and the "
                    "mesh meets the lowest level of the services in the loop (SPEC 09), and "
                    "each service's levels are listed: what passed, what failed, what could "
                    "not be probed and why. Changes nothing. Exit 0 when every level probed "
                    "passed, 1 when one failed (or a service meets none), 2 when it could "
                    "not run.")
    add_connection_args(conf)
    conf.add_argument("service", metavar="SERVICE", nargs="*",
                      help="the service to probe (with --mesh: any besides those discovered)")
    conf.add_argument("--mesh", action="store_true",
                      help="probe every service that advertises, and report the mesh's level")
    conf.add_argument("--timeout", type=float, default=2.0, help="per request (2 s)")
    # the probes are ApplyOrders, which only the daemon's user may send
    conf.set_defaults(func=cmd_conformance, as_user=credentials.DAEMON)
    _register_tools(sub)


def _register_tools(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`improved tools list|grant|upgrade|call|revoke`."""
    tls = sub.add_parser(
        "tools", help="an agent runtime's tool surface (SPEC 09 §3.1)",
        description="List a runtime's tool catalog, sign a per-call grant that mounts one "
                    "gated tool for exactly one call or a session upgrade bound to the "
                    "session's key, call a tool, revoke an upgrade.")
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
    tgrant.add_argument("--ttl", type=float, default=300.0,
                        help="seconds the grant lives (300; at most 86400, 24 h)")
    tgrant.add_argument("--call", action="store_true", help="make the call now with the grant")
    tgrant.add_argument("--timeout", type=float, default=5.0, help="seconds (5)")
    add_signer_args(tgrant)
    tgrant.set_defaults(func=cmd_tools_grant)
    _register_session_commands(tls_sub)


def _register_session_commands(
        tls_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`improved tools upgrade|call|revoke`: what a session upgrade and its calls need."""
    tup = tls_sub.add_parser(
        "upgrade", help="sign a session-scoped upgrade: gated tools without per-call grants",
        description="Sign (DSSE, your operator key) a policy upgrade that lets one session of "
                    "one runtime call the tools (--tool) or classes (--class) it names without "
                    "a per-call grant, optionally within a narrower scope (--path, --set, "
                    "--origin), for --ttl seconds (at most 24 h) or until revoked, bound to "
                    "the session's own key (--session-key): each call under the upgrade "
                    "carries a proof signed by that key for that very call, so the envelope "
                    "alone (it is on the runtime's public chain once used) calls nothing. "
                    "Prints {upgrade_id, envelope}: the agent sends the envelope as `upgrade` "
                    "with its `session` and a `proof` on each call (`improved tools call`).")
    add_connection_args(tup)
    tup.add_argument("runtime", metavar="RUNTIME")
    tup.add_argument("--session", required=True, help="the session id the upgrade is for")
    tup.add_argument("--session-key", required=True, metavar="FILE|PUBKEY",
                     help=SESSION_KEY_HELP + "; give its key file or its base64 public key")
    tup.add_argument("--tool", action="append", help="a tool it covers (repeatable)")
    tup.add_argument("--class", dest="cls", action="append", choices=["L2", "L4"],
                     help="a class of tools it covers (repeatable)")
    tup.add_argument("--path", action="append", help="narrow to these path globs (repeatable)")
    tup.add_argument("--set", action="append", help="narrow to these sets (repeatable)")
    tup.add_argument("--origin", action="append", help="narrow to these origins (repeatable)")
    tup.add_argument("--ttl", type=float, default=3600.0, help="seconds it lives (3600)")
    add_signer_args(tup)
    tup.set_defaults(func=cmd_tools_upgrade)
    tcall = tls_sub.add_parser(
        "call", help="call one tool of a runtime (with a grant, or under a session upgrade)",
        description="Send one call to <runtime>.tools.call and print the reply: a mounted "
                    "tool as is, a gated one with --grant FILE (as `tools grant` printed it), "
                    "or under a session upgrade with --upgrade FILE (as `tools upgrade` "
                    "printed it) and --session-key FILE, the session's private key, which "
                    "signs the call's proof (this runtime, this tool, these arguments, the "
                    "upgrade, now, a random nonce; used once). Exit 1 when the call is "
                    "refused or the tool fails.")
    add_connection_args(tcall)
    tcall.add_argument("runtime", metavar="RUNTIME")
    tcall.add_argument("tool", metavar="TOOL")
    tcall.add_argument("--args", default="{}", help="the call's arguments, a JSON object")
    tcall.add_argument("--grant", metavar="FILE", help="a grant envelope for this call")
    tcall.add_argument("--upgrade", metavar="FILE",
                       help="a session upgrade (`tools upgrade` output, or - for stdin)")
    tcall.add_argument("--session-key", metavar="FILE",
                       help=SESSION_KEY_HELP + "; the private key file, to sign the proof")
    tcall.add_argument("--session", help="the session id (default: the upgrade's)")
    tcall.add_argument("--timeout", type=float, default=5.0, help="seconds (5)")
    tcall.set_defaults(func=cmd_tools_call)
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
