"""The console's pages as HTML, pure: data in, a page out. Every field shown was written by a
bus participant, so every one is HTML-escaped (`esc`), control characters made visible first
(`render.clean`); the pages carry no script (the server's Content-Security-Policy allows
none), and a running verify's page reloads itself by a meta refresh."""

from __future__ import annotations

import html
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from improved.cli import render
from improved.cli.console_reads import CLASSES, PER_PAGE, STATUSES, Listed, Mesh, Verified

if TYPE_CHECKING:
    from improved.cli.console_verify import Job

REFRESH_S = 2  # how often the audit page reloads while a full verify runs

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
form.filters input[type=text]{width:12rem}.pages a{margin-right:1rem}
.verdict{font-weight:600;font-size:1.1em}
"""


def esc(value: object) -> str:
    """Any field as HTML text: control characters made visible, then every `<`, `>`, `&` and
    quote escaped, so nothing a bus participant wrote becomes markup."""
    return html.escape(render.clean(value), quote=True)


def page(title: str, body: str, mode: str, refresh: int | None = None) -> str:
    """The frame of every page: its title, the navigation, what the console may do."""
    again = f"<meta http-equiv=refresh content={int(refresh)}>" if refresh else ""
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            f"{again}<title>{esc(title)} · improved</title><style>{STYLE}</style></head><body>"
            "<nav><a href=\"/\" id=nav-proposals>proposals</a>"
            "<a href=\"/queue\" id=nav-queue>review queue</a>"
            "<a href=\"/mesh\" id=nav-mesh>mesh</a>"
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


def message_page(title: str, line: str, mode: str, back: str = "/") -> str:
    return page(title, f"<h1>{esc(title)}</h1><p id=message>{esc(line)}</p>"
                       f"<p><a href=\"{esc(back)}\">back</a></p>", mode)


def _select(name: str, chosen: str, options: Sequence[str], anything: str) -> str:
    """A drop-down of `options`, `chosen` selected; its first choice, `anything`, is none."""
    opts = "".join(f"<option value=\"{esc(o)}\"{' selected' if o == chosen else ''}>"
                   f"{esc(o or anything)}</option>" for o in ("", *options))
    return f"<select name={name} id=filter-{name}>{opts}</select>"


def _filter_form(listed: Listed) -> str:
    f = listed.filters
    return ("<form method=get action=\"/\" class=filters id=filters>"
            + _select("status", f.status, STATUSES, "any status")
            + f"<input type=text name=service id=filter-service placeholder=\"any service\" "
              f"value=\"{esc(f.service)}\">"
            + _select("class", f.change_class, CLASSES, "any class")
            + (f"<input type=hidden name=n value=\"{f.per_page}\">" if f.per_page != PER_PAGE else "")
            + "<button type=submit id=filter>filter</button> <a href=\"/\">all</a></form>")


def proposals_page(listed: Listed, mesh_line: str, mode: str) -> str:
    """Every proposal the retained records hold, the most recently moved first, a page at a
    time, each linking to its page; what the filters and the page are is in the query."""
    f = listed.filters
    trs = "".join(
        f"<tr><td><a class=proposal href=\"/p/{esc(s.proposal_id)}\">"
        f"{esc(render.short(s.proposal_id))}</a></td><td>{esc(s.service)}</td>"
        f"<td>{esc(s.change_class)} → {esc(s.gate_class)}</td>"
        f"<td class=status>{esc(s.status)}</td><td>{esc(s.stage)}</td>"
        f"<td>{esc(s.summary_text)}</td><td><code>{esc(s.target_ref)}</code></td>"
        f"<td>{esc(render.stamp(s.updated_at))}</td></tr>" for s in listed.rows)
    first = (f.page - 1) * f.per_page + 1
    shown = (f"<p id=count>{first}–{first + len(listed.rows) - 1} of {listed.matching}, the "
             "most recently moved first.</p>" if listed.rows else
             "<p id=empty>No proposal matches.</p>" if listed.matching == 0 else
             f"<p id=empty>Nothing on page {f.page}: {listed.matching} match.</p>")
    links = "".join(
        f"<a href=\"/?{esc(f.query(page=to))}\" id={name}>{label}</a>"
        for name, to, label, there in (("newer", f.page - 1, "← newer", listed.newer),
                                       ("older", f.page + 1, "older →", listed.older))
        if there)
    table = ("<table id=proposals><tr><th>proposal</th><th>service</th><th>class → gate</th>"
             "<th>status</th><th>stage</th><th>summary</th><th>target</th><th>moved</th></tr>"
             + trs + "</table>") if listed.rows else ""
    return page("proposals",
                f"<p id=mesh-line>{mesh_line} <a href=\"/mesh\">the mesh</a></p>"
                "<h1>Proposals</h1>" + _filter_form(listed) + shown + table
                + f"<p class=pages>{links}</p>"
                "<p class=mode>As the retained records say (a closed proposal's leave after "
                "<code>records_ttl_days</code>; its page still reads its chain). Waiting for "
                "an operator: <a href=\"/queue\">the review queue</a>.</p>", mode)


def mesh_line(found: Mesh) -> str:
    """The mesh's state in one line of HTML, for the front page."""
    s = found.status
    crisis = (f"<span class=broken>CRISIS {esc(s['crisis'])}</span>" if s.get("crisis")
              else "<span class=ok>no crisis</span>")
    breaker = esc(s.get("breaker"))
    return (f"{crisis} · autonomy {esc(s.get('autonomy'))} · breaker "
            f"<span class={'ok' if breaker == 'closed' else 'warn'}>{breaker}</span>")


def mesh_page(found: Mesh, mode: str) -> str:
    """The mesh's state: crisis, breaker, autonomy (as `improved status` reads them), the
    keys trusted, and the last checkpoint with its age."""
    s = found.status
    rows = [
        ("crisis", f"<span id=crisis class={'broken' if s.get('crisis') else 'ok'}>"
                   f"{esc(s.get('crisis') or 'none')}</span>"),
        ("breaker", f"<span id=breaker>{esc(s.get('breaker'))}</span>"
                    f" ({esc(s.get('autonomous_rollbacks_in_window'))} autonomous rollbacks "
                    "in the window)"),
        ("autonomy", f"<span id=autonomy>{esc(s.get('autonomy'))}</span>"
                     + (f"; holds autonomous applies: {esc(s['holds_autonomous_applies'])}"
                        if s.get("holds_autonomous_applies") else "")),
        ("autonomy chain", f"<span id=autonomy-chain>{esc(s.get('autonomy_chain'))}</span>"),
        ("log", f"{esc(s.get('trailers'))} trailers; {esc(s.get('retained_records'))} retained "
                "records"),
        ("last checkpoint", _checkpoint_html(found.checkpoint)),
    ]
    dl = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows)
    daemons = ("<ul id=daemons>" + "".join(f"<li><code>{esc(k)}</code></li>"
                                          for k in found.daemons) + "</ul>"
               if found.daemons else "<p id=daemons class=warn>None: no trailer's writer can "
               "be checked here (name the daemons' checkpoint keys in [trust] daemons, or "
               "run where the daemon's key is).</p>")
    keys = "".join(
        f"<h3>{esc(role)}</h3>" + ("<ul>" + "".join(
            f"<li>{esc(who)} <code>{esc(kid)}</code></li>" for who, kid in listed) + "</ul>"
            if listed else "<p>none</p>")
        for role, listed in found.keys.items())
    return page("mesh", f"<h1>Mesh</h1><dl id=mesh>{dl}</dl>"
                        f"<h2>Trusted daemon keys</h2>{daemons}"
                        f"<h2>Keys in force</h2><p>as {esc(found.keys_from)} records them</p>"
                        f"<div id=keys>{keys}</div>", mode)


def _checkpoint_html(cp: Mapping[str, Any] | None, now: float | None = None) -> str:
    if cp is None:
        return "<span id=checkpoint>none on the stream yet</span>"
    if "unreadable" in cp:
        return f"<span id=checkpoint class=broken>{esc(cp['unreadable'])}</span>"
    age = ((now if now is not None else time.time()) * 1000 - cp["at"]) / 1000
    trusted = ("<span class=ok>signed by a trusted daemon key</span>" if not cp["trusted"]
               else f"<span class=warn>{esc(cp['trusted'])}</span>")
    return (f"<span id=checkpoint>{esc(cp['count'])} trailers up to stream sequence "
            f"{esc(cp['last_seq'])}, signed at {esc(render.stamp(cp['at']))} "
            f"(<span id=checkpoint-age>{esc(_age(age))}</span> ago) by "
            f"<code>{esc(str(cp['keyid'])[:20])}…</code></span>; {trusted}")


def _age(seconds: float) -> str:
    """A duration as a person reads it: 42 s, 3.5 min, 2.0 h, 1.2 d."""
    seconds = max(seconds, 0.0)
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


VERDICT_CLASS = {"VERIFIED": "ok", "BROKEN": "broken"}
MEANING = {"VERIFIED": "nothing forged, altered or missing; every writer checked against a trusted "
                 "daemon key",
           "BROKEN": "something was forged, altered or is missing",
           "UNVERIFIED": "nothing wrong found, but no trusted daemon key here to check who "
                         "wrote each trailer",
           "NOT RUN": "the verify could not run"}


def _verdict_html(found: Verified, id_: str) -> str:
    word = found.verdict
    return (f"<p id={id_} class=\"verdict {VERDICT_CLASS.get(word, 'warn')}\">{esc(word)}"
            f"</p><p>{esc(MEANING.get(word, ''))}</p>"
            f"<pre id={id_}-lines>" + "\n".join(esc(line) for line in found.lines) + "</pre>")


def audit_page(since: Verified, job: Job, csrf: str, mode: str,
               now: float | None = None) -> str:
    """The log's state: verified since the last checkpoint on every load; the whole log only
    on request (a POST), its progress while it runs (the page reloads itself) and its
    verdict when done."""
    now = now if now is not None else time.time()
    ask = ("<form method=post action=\"/audit/verify\">"
           f"<input type=hidden name=csrf value=\"{esc(csrf)}\">"
           "<button type=submit id=full-verify>verify the whole log</button></form>")
    if job.started is None:
        whole = ("<p id=full-state>Not run from this console yet. It reads every trailer "
                 "of the log (at a long history, for a long time).</p>" + ask)
    elif job.running:
        whole = (f"<p id=full-state class=warn>Running since {esc(render.stamp(job.started * 1000))}"
                 f" ({esc(_age(now - job.started))}): <span id=full-read>{job.read}</span> "
                 "trailers read so far. This page reloads itself.</p>")
    else:
        assert job.result is not None and job.finished is not None
        whole = (f"<p id=full-state>Finished at {esc(render.stamp(job.finished * 1000))}, "
                 f"in {esc(_age(job.finished - job.started))}.</p>"
                 + _verdict_html(job.result, "full") + ask)
    return page("audit log",
                "<h1>Audit log</h1><h2>Since the last checkpoint</h2>"
                + _verdict_html(since, "since")
                + f"<h2>The whole log</h2>{whole}", mode,
                refresh=REFRESH_S if job.running else None)
