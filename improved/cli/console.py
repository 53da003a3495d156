"""`improved console`: a small web console on 127.0.0.1 for a look at the state without reading
JSON — the review queue, one proposal (what it waits for, who signed, what will run as a diff,
its timeline of trailers and whether its chain verifies) and the whole log's verification.

It reads what the commands read, through the same functions: the queue is `improved review`'s
(`queries.review_view`), a proposal is `improved show`'s (`proposals.shown`, whose chain verdict
is the one `show` prints), the log's status is `improved audit verify`'s (`audit.verify_log`).
Each request opens its own short connection, as a command does; nothing is cached.

Read-only unless started with an operator's key (`--key FILE`, `--principal operator:NAME`):
then a pending proposal's page has approve and reject forms that sign and publish a Review
exactly as `improved approve|reject` do (`authority.review_act`, `authority.send_review`) and
wait for the daemon's verdict on the chain. A POST carries this process's CSRF token (a
random value in each form, compared in constant time); a request naming another host is
refused (a DNS-rebinding page cannot use the console); the pages carry a Content-Security-
Policy that allows no script at all.

Every field shown was written by a bus participant, so every one is HTML-escaped (`esc`), and
control characters are made visible first (`render.clean`). The page functions at the top are
pure: data in, HTML out."""

from __future__ import annotations

import argparse
import asyncio
import errno
import hmac
import html
import re
import secrets
import signal
import sys
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Literal

from improved.cli import render, verdicts
from improved.cli.common import add_connection_args, config_of, deployment, located, url_of
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

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:72rem;padding:1rem 1.5rem;
color:#1d1d1f}
a{color:#0645ad}nav a{margin-right:1rem}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:.3rem .5rem;
border-bottom:1px solid #ddd;vertical-align:top}
code,pre{font:12px/1.4 ui-monospace,monospace}pre{background:#f6f6f6;padding:.6rem;
overflow-x:auto;white-space:pre-wrap}
.ok{color:#116329}.warn{color:#9a6700}.broken{color:#b31d28}.mode{color:#555}
.add{color:#116329}.del{color:#b31d28}.hunk{color:#6f42c1}
dl{display:grid;grid-template-columns:9rem 1fr;gap:.2rem .8rem}dt{color:#555}dd{margin:0}
form{display:inline-block;margin-right:1rem}input[type=text]{width:22rem}
"""


def esc(value: object) -> str:
    """Any field as HTML text: control characters made visible, then every `<`, `>`, `&` and
    quote escaped, so nothing a bus participant wrote becomes markup."""
    return html.escape(render.clean(value), quote=True)


def page(title: str, body: str, mode: str) -> str:
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            f"<title>{esc(title)} · improved</title><style>{STYLE}</style></head><body>"
            "<nav><a href=\"/\" id=nav-queue>review queue</a>"
            "<a href=\"/audit\" id=nav-audit>audit log</a>"
            f"<span class=mode id=mode>{esc(mode)}</span></nav>{body}</body></html>")


def queue_page(rows: Sequence[Mapping[str, Any]], source: str, mode: str) -> str:
    """The review queue: one row per waiting proposal, oldest first, each linking to its page."""
    note = ("" if source == "index" else
            "<p class=warn>The review index does not hold every proposal the last checkpoint "
            "counted waiting (lost, purged, or not yet counted): this list was read from the "
            "audit chains.</p>")
    if not rows:
        return page("review queue", f"<h1>Review queue</h1>{note}"
                    "<p id=empty>Nothing waits for an operator.</p>", mode)
    trs = []
    for q in rows:
        pid = str(q["proposal_id"])
        trs.append(
            f"<tr><td><a class=proposal href=\"/p/{esc(pid)}\">{esc(render.short(pid))}</a></td>"
            f"<td>{esc(q['service'])}</td><td>{esc(q['class'])} → {esc(q['gate'])}</td>"
            f"<td>{esc(q['cause'])}</td>"
            f"<td>{esc(render.waits_for('pending', q['cause']))}</td>"
            f"<td>{esc(q['summary'])}</td><td><code>{esc(q['target'])}</code></td>"
            f"<td>{esc(render.stamp(q['waiting_since']))}</td></tr>")
    return page("review queue",
                f"<h1>Review queue</h1>{note}<p>{len(rows)} waiting for an operator, oldest "
                "first.</p><table id=queue><tr><th>proposal</th><th>service</th>"
                "<th>class → gate</th><th>cause</th><th>waits for</th><th>summary</th>"
                "<th>target</th><th>waiting since</th></tr>" + "".join(trs) + "</table>", mode)


def _diff_html(lines: Sequence[str]) -> str:
    out = []
    for line in lines:
        body = line[4:] if line.startswith("    ") else line
        cls = ("hunk" if body.startswith("@@") else
               "add" if body.startswith("+") and not body.startswith("+++") else
               "del" if body.startswith("-") and not body.startswith("---") else "")
        out.append(f"<span class={cls}>{esc(line)}</span>" if cls else esc(line))
    return "\n".join(out)


def chain_class(verdict: str) -> str:
    return ("ok" if verdict.startswith("VERIFIED") else
            "broken" if verdict.startswith("BROKEN") else "warn")


def proposal_page(view: Mapping[str, Any], facts: Mapping[str, Any], mode: str,
                  csrf: str | None) -> str:
    """One proposal: its facts, the chain's verdict, who signed, what will run (as a diff
    where the proposal it superseded is known), its timeline; with `csrf` (an operator's key
    is loaded) approve and reject forms while it is pending."""
    pid = str(facts["proposal_id"])
    decision = view.get("decision") or facts.get("decision")
    said = ""
    if isinstance(decision, Mapping):
        cause = f"/{decision.get('cause')}" if decision.get("cause") else ""
        said = (f"{decision.get('verdict')}{cause} by {decision.get('actor')} at "
                f"{render.stamp(decision.get('at'))}: {decision.get('rationale')}")
    outcome = view.get("outcome")
    applied = ""
    if isinstance(outcome, Mapping):
        applied = (f"{'applied' if outcome.get('ok') else 'failed'} under "
                   f"{outcome.get('authority')} at {render.stamp(outcome.get('at'))}"
                   + (f", schema class {outcome['schema_class']} (the service's claim)"
                      if outcome.get("schema_class") else "")
                   + (f": {outcome.get('error')}" if outcome.get("error") else ""))
    facts_rows = [
        ("id", f"<code>{esc(pid)}</code>"), ("service", esc(facts.get("service"))),
        ("target", f"<code>{esc(facts.get('target'))}</code> (scope {esc(facts.get('scope'))})"),
        ("class", f"{esc(facts.get('class'))}, gated {esc(facts.get('gate'))}"),
        ("proposer", html.escape(render.proposer_text(
            facts.get("proposer"), facts.get("origin"), bool(facts.get("verified"))),
            quote=True)),
        ("state", esc(f"{facts.get('status')} at stage {facts.get('stage')}")
         + (f", superseded by <a href=\"/p/{esc(facts['superseded_by'])}\">"
            f"{esc(render.short(str(facts['superseded_by'])))}</a>"
            if facts.get("superseded_by") else "")),
        ("waits for", esc(render.waits_for(*render.waiting(facts)))),
        *([("schema", esc(schema))] if (schema := render.schema_line(
            facts.get("schema_class"))) is not None else []),
        ("decision", esc(said) or "none yet"),
        ("outcome", esc(applied) or "none yet"),
    ]
    dl = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts_rows)
    verdict = str(view.get("chain"))
    who = render.signed(view.get("trailers") or ())
    signed = ("<ul id=signed>" + "".join(f"<li>{esc(w)}</li>" for w in who) + "</ul>"
              if who else "<p id=signed>No signed act yet.</p>")
    run = view.get("will_run")
    body = (_diff_html(render.body_lines(run, view.get("will_run_digest"),
                                         facts.get("replaced"), pid))
            if isinstance(run, Mapping) else esc(run))
    rows = "".join(
        f"<tr><td>{esc(t['seq'])}</td><td>{esc(t['stage'])}</td><td>{esc(t['verdict'])}</td>"
        f"<td>{esc(t['actor'])}</td><td>{esc(t['at'])}</td>"
        f"<td><code title=\"{esc(t['hash'])}\">{esc(t['hash'][:16])}</code></td>"
        f"<td>{esc(t['reason'])}</td></tr>"
        for t in render.timeline(view.get("trailers") or ()))
    return page(
        f"proposal {render.short(pid)}",
        f"<h1>{esc(render.short(pid))} · {esc(facts.get('summary', ''))}</h1>"
        f"<dl id=facts>{dl}</dl>"
        f"<h2>Chain</h2><p id=chain class={chain_class(verdict)}>{esc(verdict)}</p>"
        f"<h2>Who signed</h2>{signed}"
        f"{_decide(pid, facts, csrf)}"
        f"<h2>What will run</h2><pre id=body>{body}</pre>"
        "<h2>Timeline</h2><table id=timeline><tr><th>#</th><th>stage</th><th>verdict</th>"
        f"<th>actor</th><th>time</th><th>hash</th><th>reason</th></tr>{rows}</table>", mode)


def _decide(pid: str, facts: Mapping[str, Any], csrf: str | None) -> str:
    if csrf is None:
        return ""
    if facts.get("status") != "pending" or facts.get("superseded_by") or \
            facts.get("in_flight"):
        return "<h2>Decide</h2><p>Not waiting for a decision.</p>"
    forms = "".join(
        f"<form method=post action=\"/p/{esc(pid)}/{verdict}\">"
        f"<input type=hidden name=csrf value=\"{esc(csrf)}\">"
        f"<input type=text name=reason required placeholder=\"why (recorded on the chain)\" "
        f"id={verdict}-reason><button type=submit id={verdict}>{verdict}</button></form>"
        for verdict in ("approve", "reject"))
    return f"<h2>Decide</h2>{forms}"


def audit_page(code: int, lines: Sequence[str], mode: str) -> str:
    status = ("<p id=audit class=ok>The whole log verifies.</p>" if code == 0 else
              "<p id=audit class=warn>Nothing wrong was found, but who wrote the log is not "
              "checked: no trusted daemon key.</p>" if code == 3 else
              "<p id=audit class=broken>The log does not verify.</p>")
    return page("audit log", f"<h1>Audit log</h1>{status}<pre>"
                + "\n".join(esc(line) for line in lines) + "</pre>", mode)


def message_page(title: str, line: str, mode: str, back: str = "/") -> str:
    return page(title, f"<h1>{esc(title)}</h1><p id=message>{esc(line)}</p>"
                       f"<p><a href=\"{esc(back)}\">back</a></p>", mode)


# -- the server --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Console:
    """What every request needs: where to read, the configuration, the operator's key (None:
    read-only), this process's CSRF token, how long to wait for a verdict, where it listens."""

    url: Target
    config: Config
    signer: tuple[str, Ed25519PrivateKey] | None
    csrf: str
    timeout: float
    port: int

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
        path = urllib.parse.urlsplit(self.path).path
        self._answer(lambda: self._get(path))

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
            status, text = 500, message_page("error", f"{type(exc).__name__}: {exc}",
                                             self.console.mode)
        self._send(status, text)

    def _get(self, path: str) -> tuple[int, str]:
        c = self.console
        if path == "/":
            from improved.cli.queries import review_view

            rows, source = asyncio.run(review_view(c.url, c.config.policy, c.config))
            return 200, queue_page(rows, source, c.mode)
        if path == "/audit":
            from improved.cli.audit import verify_log

            lines: list[str] = []
            code = asyncio.run(verify_log(c.url, c.config, lines.append, lines.append))
            return 200, audit_page(code, lines, c.mode)
        m = _PROPOSAL.match(path)
        if m and m.group(2) is None:
            seen = asyncio.run(_shown(c.url, m.group(1), c.config))
            return 200, proposal_page(seen.view, seen.facts, c.mode,
                                      c.csrf if c.signer is not None else None)
        return 404, message_page("not found", f"nothing at {path}", c.mode)

    def _post(self, path: str) -> tuple[int, str]:
        c = self.console
        m = _PROPOSAL.match(path)
        if not m or m.group(2) is None:
            return 404, message_page("not found", f"nothing to post to at {path}", c.mode)
        if c.signer is None:
            return 403, message_page("read-only", "this console was started without an "
                                     "operator key: start it with --key FILE --principal "
                                     "operator:NAME to approve and reject", c.mode)
        form = self._form()
        token = form.get("csrf", "")
        if not hmac.compare_digest(token.encode(), c.csrf.encode()):
            return 403, message_page("refused", "the form's CSRF token is missing or not this "
                                     "console's: reload the proposal's page and submit again",
                                     c.mode)
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
                          int(port))
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
        "console", help="a local web console: the review queue, a proposal, the audit log",
        description="Serve a small web console on 127.0.0.1 (only): the review queue, each "
                    "proposal's page (what it waits for, who signed, what will run as a diff, "
                    "its timeline of trailers and whether its chain verifies, as `improved "
                    "show` says it) and the whole log's verification (`improved audit "
                    "verify`). Read-only unless started with an operator's key (--key, "
                    "--principal): then a pending proposal's page can approve or reject it, "
                    "signed and published as `improved approve|reject` do, with the daemon's "
                    "verdict shown.")
    add_connection_args(con)
    con.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="P",
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

