"""`improved console`: a small web console on 127.0.0.1 for a look at the loop and the mesh
without reading JSON — every proposal (filtered, paged), the review queue, one proposal (what it
waits for, who signed, what will run as a diff, its timeline of trailers and whether its chain
verifies), the mesh's state and the log's verification.

It reads what the commands read, through the same functions: the proposals are the retained
records' (`console_reads.proposals`), the queue is `improved review`'s (`queries.review_view`),
a proposal is `improved show`'s (`proposals.shown`, whose chain verdict is the one `show`
prints), the mesh is `improved status`'s with the keys `audit verify` trusts
(`console_reads.mesh`), the log's state on each load is `improved audit verify --since`'s, and
the whole log's verify runs only when asked, in the background, one at a time
(`console_verify`). Each request opens its own short connection, as a command does; nothing is
cached.

Read-only unless started with an operator's key (`--key FILE`, `--principal operator:NAME`):
then a pending proposal's page has approve and reject forms that sign and publish a Review
exactly as `improved approve|reject` do (`authority.review_act`, `authority.send_review`) and
wait for the daemon's verdict on the chain. A POST carries this process's CSRF token (a
random value in each form, compared in constant time); a request naming another host is
refused (a DNS-rebinding page cannot use the console); the pages carry a Content-Security-
Policy that allows no script at all, and never name a path of the host. The pages themselves
are `console_pages`: pure, every field escaped."""

from __future__ import annotations

import argparse
import asyncio
import errno
import hmac
import re
import secrets
import signal
import sys
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Literal

from improved.cli import console_reads, verdicts
from improved.cli.common import add_connection_args, config_of, deployment, located, url_of
from improved.cli.console_pages import (
    audit_page,
    mesh_line,
    mesh_page,
    message_page,
    proposal_page,
    proposals_page,
    queue_page,
)
from improved.cli.console_verify import FullVerify, full_verify
from improved.cli.errors import USAGE, Failure
from improved.client import connection
from improved.client.config import Config
from improved.client.connection import Target
from improved.client.streams import StoreError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from improved.cli.proposals import Shown

HOST = "127.0.0.1"
DEFAULT_PORT = 8765
FORM_LIMIT = 16 * 1024  # bytes of a POSTed form
CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src 'none'; form-action 'self'; "
       "frame-ancestors 'none'; base-uri 'none'")


@dataclass(frozen=True)
class Console:
    """What every request needs: where to read, the configuration, the operator's key (None:
    read-only), this process's CSRF token, how long to wait for a verdict, where it listens,
    and the whole log's verify, run on request."""

    url: Target
    config: Config
    signer: tuple[str, Ed25519PrivateKey] | None
    csrf: str
    timeout: float
    port: int
    full: FullVerify

    @property
    def mode(self) -> str:
        return (f"signing as {self.signer[0]}" if self.signer is not None else
                "read-only (no operator key)")

    def hosts(self) -> set[str]:
        return {f"{HOST}:{self.port}", f"localhost:{self.port}"}


_PROPOSAL = re.compile(r"^/p/([0-9a-f]{4,64})(?:/(approve|reject))?/?\Z")


class Handler(BaseHTTPRequestHandler):
    console: Console  # set on the subclass `serve` makes
    server_version = "improved-console"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write(f"improved console: {self.command} {self.path} "
                         f"{args[1] if len(args) > 1 else ''}\n")

    def _send(self, status: int, text: str) -> None:
        """A page; for 303 (after a POST) `text` is where to go."""
        if status == 303:
            self.send_response(status)
            self.send_header("Location", text)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _fail(self, status: int, title: str, line: str) -> None:
        self._send(status, message_page(title, line, self.console.mode))

    def _host_ok(self) -> bool:
        if self.headers.get("Host", "") not in self.console.hosts():
            self._fail(421, "wrong host", "this console answers only on "
                       f"http://{HOST}:{self.console.port}/")
            return False
        return True

    def do_GET(self) -> None:
        if not self._host_ok():
            return
        parts = urllib.parse.urlsplit(self.path)
        self._answer(lambda: self._get(parts.path, parts.query))

    def do_POST(self) -> None:
        if not self._host_ok():
            return
        path = urllib.parse.urlsplit(self.path).path
        self._answer(lambda: self._post(path))

    def _answer(self, handle: Any) -> None:
        """Run a request's handler; what goes wrong is a page with one line, never a trace."""
        try:
            status, text = handle()
        except Failure as exc:
            status, text = 404 if exc.code == 1 else 400, message_page(
                "not found" if exc.code == 1 else "bad request", str(exc), self.console.mode)
        except (connection.BusError, StoreError) as exc:
            status, text = 502, message_page("no broker", str(exc), self.console.mode)
        except Exception as exc:  # a request never takes the console down
            sys.stderr.write(f"improved console: {self.path}: {type(exc).__name__}: {exc}\n")
            status, text = 500, message_page("error", console_reads.hidden(
                f"{type(exc).__name__}: {exc}", console_reads.private_paths(
                    self.console.config)), self.console.mode)
        self._send(status, text)

    def _get(self, path: str, query: str) -> tuple[int, str]:
        c = self.console
        if path == "/":
            filters = console_reads.filters_of(query)
            listed = asyncio.run(console_reads.proposals(c.url, filters))
            found = asyncio.run(console_reads.mesh(c.url, c.config))
            return 200, proposals_page(listed, mesh_line(found), c.mode)
        if path == "/queue":
            from improved.cli.queries import review_view

            rows, source = asyncio.run(review_view(c.url, c.config.policy, c.config))
            return 200, queue_page(rows, source, c.mode)
        if path == "/mesh":
            return 200, mesh_page(asyncio.run(console_reads.mesh(c.url, c.config)), c.mode)
        if path == "/audit":
            since = asyncio.run(console_reads.since_checkpoint(c.url, c.config))
            return 200, audit_page(since, c.full.state(), c.csrf, c.mode)
        m = _PROPOSAL.match(path)
        if m and m.group(2) is None:
            seen = asyncio.run(_shown(c.url, m.group(1), c.config))
            return 200, proposal_page(seen.view, seen.facts, c.mode,
                                      c.csrf if c.signer is not None else None)
        return 404, message_page("not found", f"nothing at {path}", c.mode)

    def _post(self, path: str) -> tuple[int, str]:
        c = self.console
        if path == "/audit/verify":
            if not self._token_ok(self._form()):
                return 403, self._refused("/audit")
            c.full.start()  # one at a time: while one runs, the page shows it
            return 303, "/audit"
        m = _PROPOSAL.match(path)
        if not m or m.group(2) is None:
            return 404, message_page("not found", f"nothing to post to at {path}", c.mode)
        if c.signer is None:
            return 403, message_page("read-only", "this console was started without an "
                                     "operator key: start it with --key FILE --principal "
                                     "operator:NAME to approve and reject", c.mode)
        form = self._form()
        if not self._token_ok(form):
            return 403, self._refused(f"/p/{m.group(1)}")
        reason = form.get("reason", "").strip()
        if not reason:
            return 400, message_page("bad request", "give a reason (it is recorded on the "
                                     "chain)", c.mode, f"/p/{m.group(1)}")
        from improved.cli.authority import review_act, send_review

        verdict: Literal["approve", "reject"] = \
            "approve" if m.group(2) == "approve" else "reject"

        svc, record = located(c.url, m.group(1))
        act = review_act(record, verdict, c.signer[0], c.signer[1], reason)
        found = asyncio.run(send_review(c.url, svc, act, c.timeout))
        back = f"/p/{act.pid}"
        if found is None:
            return 504, message_page("no verdict", verdicts.no_verdict(
                act.what, c.timeout, f"improved show {act.pid}"), c.mode, back)
        return (200 if found.accepted else 409,
                message_page("accepted" if found.accepted else "refused", found.line, c.mode,
                             back))

    def _token_ok(self, form: dict[str, str]) -> bool:
        return hmac.compare_digest(form.get("csrf", "").encode(), self.console.csrf.encode())

    def _refused(self, back: str) -> str:
        return message_page("refused", "the form's CSRF token is missing or not this "
                            "console's: reload the page and submit again", self.console.mode,
                            back)

    def _form(self) -> dict[str, str]:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise Failure("a form with a bad Content-Length", USAGE) from None
        if length < 0 or length > FORM_LIMIT:
            raise Failure(f"a form larger than {FORM_LIMIT} bytes", USAGE)
        data = self.rfile.read(length).decode("utf-8", "replace")
        return {k: v[0] for k, v in urllib.parse.parse_qs(data).items() if v}


async def _shown(url: Target, text: str, config: Config) -> Shown:
    from improved.cli.proposals import shown

    async with deployment(url) as store:
        return await shown(store, text, config)


async def _reachable(url: Target) -> None:
    async with deployment(url, bind=False):
        pass


def bind(port: int) -> ThreadingHTTPServer:
    """The listening socket on 127.0.0.1 only; a port that is taken is a Failure (exit 2)."""
    try:
        server = ThreadingHTTPServer((HOST, port), Handler)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise Failure(f"port {port} on {HOST} is taken: stop what listens there or give "
                          "another --port", USAGE) from None
        raise Failure(f"cannot listen on {HOST}:{port}: {exc.strerror or exc}; give another "
                      "--port", USAGE) from None
    server.daemon_threads = True
    return server


def cmd_console(args: argparse.Namespace) -> int:
    from improved.cli.common import signer_of

    config = config_of(args)
    url = url_of(args, config)
    signer = signer_of(args) if args.key or args.principal else None
    server = bind(args.port)
    try:
        asyncio.run(_reachable(url))  # no broker is one line now, not a page per request
        port = server.server_address[1]
        console = Console(url, config, signer, secrets.token_urlsafe(32), args.timeout,
                          int(port), full_verify(url, config))
        server.RequestHandlerClass = type("ConsoleHandler", (Handler,), {"console": console})
        print(f"improved console on http://{HOST}:{port}/ ({console.mode}"
              + ("" if signer else "; --key FILE --principal operator:NAME to approve and "
                 "reject") + "); Ctrl-C stops it", flush=True)

        def stop(*_: object) -> None:
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, stop)
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `improved console` to the `improved` parser."""
    con = sub.add_parser(
        "console", help="a local web console: proposals, the review queue, the mesh, the log",
        description="Serve a small web console on 127.0.0.1 (only): every proposal the "
                    "retained records hold, newest first, filtered by status, service and "
                    "class and paged; the review queue; each proposal's page (what it waits "
                    "for, who signed, what will run as a diff, its timeline of trailers and "
                    "whether its chain verifies, as `improved show` says it); the mesh "
                    "(crisis, breaker, autonomy, trusted keys, the last checkpoint's age); "
                    "and the log, verified since the last checkpoint on every load (`improved "
                    "audit verify --since`) and whole on request, in the background. "
                    "Read-only unless started with an operator's key (--key, --principal): "
                    "then a pending proposal's page can approve or reject it, signed and "
                    "published as `improved approve|reject` do, with the daemon's verdict "
                    "shown.")
    add_connection_args(con)
    con.add_argument("--port", type="port or free", default=DEFAULT_PORT, metavar="P",
                     help=f"the port on 127.0.0.1 (default {DEFAULT_PORT}; 0 picks a free one)")
    con.add_argument("--principal", metavar="operator:NAME",
                     help="sign approvals and rejections as this operator, with its key from "
                          "the key directory (without it or --key: read-only)")
    con.add_argument("--key", metavar="FILE",
                     help="the operator's private key file to sign with (without it or "
                          "--principal: read-only)")
    con.add_argument("--timeout", type=float, default=verdicts.DEFAULT_TIMEOUT_S, metavar="S",
                     help="seconds to wait for the daemon's verdict on an act "
                          f"({verdicts.DEFAULT_TIMEOUT_S:g})")
    con.set_defaults(func=cmd_console)

