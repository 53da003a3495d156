"""What `improved review` and `improved show` print for a person, and the console's pages:
pure functions of the read models. Whatever a bus participant wrote is shown, never obeyed: no
escape sequence reaches the terminal, no markup reaches the page."""

from __future__ import annotations

import msgspec

from improved.cli import console_pages as console
from improved.cli import render
from improved.cli.console_reads import Verified
from improved.cli.console_verify import Job
from improved.core import authority
from improved.testing import skill_proposal

HOSTILE = "<script>alert(1)</script>\x1b[2J\r\u202eevil"
PID = "ab" * 32
OLD = "cd" * 32


def _run(instructions: str = "Read it.", **over) -> dict:
    return authority.will_run(skill_proposal("svc", instructions=instructions, **over))


def _trailer(seq: int, to_stage: str, verdict: str | None = None, actor: str = "improved:d",
             **more) -> dict:
    return {"proposal_id": PID, "seq": seq, "from_stage": "propose", "to_stage": to_stage,
            "verdict": verdict, "actor": actor, "at": 1_796_000_000_000 + seq,
            "hash": f"{seq:064x}", "reason": more.pop("reason", "why"), **more}


def test_clean_shows_control_characters_instead_of_obeying_them():
    text = render.clean("a\x1b[2Jb\rc\u202ed\nline")
    assert "\x1b" not in text and "\r" not in text and "\u202e" not in text
    assert text == "a\\x1b[2Jb\\rc\\u202ed\\nline"
    assert render.clean("one\ntwo\tthree", keep_newlines=True) == "one\ntwo\tthree"


def test_what_a_proposal_waits_for_follows_its_status_and_cause():
    assert render.waits_for("pending", "awaiting_operator") == "an operator's signed approval"
    assert "L3 grant" in render.waits_for("pending", "no_grant")
    assert render.waits_for("applied", None) == "nothing: applied"
    assert "superseded" in render.waits_for("pending", "awaiting_operator", superseded=True)
    assert "outcome of its apply" in render.waits_for("approved", None, in_flight=True)


def test_the_body_is_a_unified_diff_against_what_it_superseded():
    old, new = _run("Read it.\nWrite three points."), _run("Read it.\nWrite five points.")
    lines = render.body_lines(new, "d" * 64, (OLD, old), PID)
    assert lines[0] == f"will run (digest {'d' * 64}):"
    assert f"as a diff against {OLD[:12]}, which it superseded" in lines[1]
    text = "\n".join(lines)
    assert f"--- {OLD[:12]}" in text and f"+++ {PID[:12]}" in text
    assert '-    "instructions": "Read it.\\nWrite three points.",' in text
    assert '+    "instructions": "Read it.\\nWrite five points.",' in text
    assert render.body_diff(old, old, "a", "b") == ["(the same body)"]


def test_without_what_it_replaced_the_body_itself_and_an_edit_is_its_own_diff():
    lines = render.body_lines(_run(), None)
    assert lines[:2] == ["will run:", "  data:"] and any('"instructions": "Read it."' in ln for ln in lines)
    edit = {"cal": None, "data": None, "lkg": [{"artefact": "app", "digest": "sha256:1",
                                                "smoke_test": "true"}], "revert": None,
            "edit": {"format": "unified", "base_digest": "sha256:0",
                     "diff": "--- a\n+++ b\n@@ -1 +1 @@\n-old\n+new"}}
    lines = render.body_lines(edit, "e" * 64)
    assert "edit (unified) against base sha256:0, its own diff" in lines[1]
    assert lines[2:7] == ["    --- a", "    +++ b", "    @@ -1 +1 @@", "    -old", "    +new"]
    assert "  artefact app: installs digest sha256:1, smoke test true" in lines
    assert lines[-1].endswith("restore every artefact above to its last-known-good, as the "
                              "owning service confirms it before the apply")


def test_who_signed_names_every_act_its_key_and_every_refusal():
    env = {"payloadType": "x", "payload": "", "signatures": [{"keyid": "ed25519:" + "9" * 64,
                                                              "sig": "s"}]}
    chain = [_trailer(0, "propose"),
             _trailer(1, "triage", "refused", "operator:mallory", envelope=env,
                      refs=["act:1", "code:unknown_key"], reason="refused (unknown_key): no"),
             _trailer(2, "triage", "approve", "operator:alice", envelope=env, refs=["act:2"]),
             _trailer(3, "apply", "dispatched", refs=["authority:operator:alice"])]
    said = render.signed(chain)
    assert said[0].startswith("refused act unknown_key at ") and "(key ed25519:999" in said[0]
    assert said[1].startswith("approve by operator:alice at ") and "(key ed25519:" in said[1]
    assert said[2].startswith("apply dispatched under operator:alice")
    assert render.signed([_trailer(0, "propose")]) == []


def test_the_timeline_is_every_trailer_in_order():
    rows = render.timeline([_trailer(0, "propose"), _trailer(1, "triage", "defer",
                                                             cause="awaiting_operator"), 7])
    assert [r["seq"] for r in rows] == ["0", "1", "?"]
    assert rows[1]["verdict"] == "defer/awaiting_operator"
    assert rows[1]["stage"] == "propose → triage" and rows[1]["hash"] == f"{1:064x}"
    assert rows[1]["at"] == "2026-11-30 00:53:20Z"
    assert rows[2]["verdict"] == "not a trailer"


def _row(**over) -> dict:
    p = skill_proposal("svc", instructions=HOSTILE)
    row = {"proposal_id": PID, "service": "svc", "summary": f"add skill {HOSTILE}",
           "votes": [], "constitution_edit": None, "class": "L2", "gate": "L2",
           "target": "skill:summarize", "cause": "awaiting_operator", "rationale": HOSTILE,
           "scope": "knowledge", "origin": HOSTILE, "analyzer": "acme.skills/1",
           "skill": None, "signals": {"counted": 1, "positive": 1, "independent_positive": 0},
           "evidence": {"derived_from": 0, "evidence_query": None, "metric": None},
           "target_files": [HOSTILE], "valid_to": None, "waiting_since": 1_796_000_000_000,
           "will_run": authority.will_run(p), "will_run_digest": "f" * 64}
    row.update(over)
    return row


def test_review_text_for_a_person_carries_no_escape_sequence():
    text = render.review_text([_row(), _row(proposal_id=OLD, cause="surfaced")])
    assert text.startswith("2 waiting for an operator, oldest first")
    assert "\x1b" not in text and "\r" not in text and "\u202e" not in text
    assert f"{PID}  svc  L2 gated L2 (awaiting_operator)" in text
    assert "waits for an operator's signed approval, since 2026-11-30 00:53:20Z" in text
    assert f"decide: improved approve {PID}" in text and "L1 is never applied" in text
    assert "independent positive" in text and f"will run (digest {'f' * 64})" in text
    assert render.review_text([]) == "nothing waits for an operator\n"


def _shown(chain_verdict: str = "VERIFIED: hashes, links, daemon signatures and signed acts, "
                                 "against daemon key 1a2b… (the checkpoint key k.pem)") -> tuple[dict, dict]:
    trailers = [_trailer(0, "propose", actor="mcp:svc-agent:1", reason=f"proposed {HOSTILE}"),
                _trailer(1, "triage", "defer", cause="awaiting_operator")]
    view = {"state": None, "decision": {"verdict": "defer", "cause": "awaiting_operator",
                                        "actor": "improved:d", "at": 1_796_000_000_000,
                                        "rationale": "L2 needs a signed operator approval"},
            "outcome": None, "learn_back": None, "quorum": None,
            "will_run": _run(HOSTILE), "will_run_digest": "f" * 64, "trailers": trailers,
            "chain": chain_verdict}
    facts = {"proposal_id": PID, "service": "svc", "summary": f"add skill {HOSTILE}",
             "target": "skill:summarize", "scope": "knowledge", "class": "L2", "gate": "L2",
             "status": "pending", "stage": "triage", "cause": "awaiting_operator",
             "superseded_by": None, "in_flight": False, "replaced": (OLD, _run("Read it."))}
    return view, facts


def test_show_text_says_class_gate_cause_signers_chain_and_the_diff():
    text = render.show_text(*_shown())
    assert text.startswith(f"{PID[:12]}  svc  add skill <script>")
    assert "\x1b" not in text and "\u202e" not in text
    for line in ("  class     L2, gated L2", "  state     pending at stage triage",
                 "  waits for an operator's signed approval", "  signed    no signed act yet",
                 "  chain     VERIFIED: hashes, links, daemon signatures and signed acts, "
                 "against daemon key 1a2b… (the checkpoint key k.pem)"):
        assert line in text.splitlines(), line
    assert any(ln.startswith("  decision  defer/awaiting_operator by improved:d at ")
               for ln in text.splitlines())
    assert f"as a diff against {OLD[:12]}" in text and "+    \"instructions\"" in text
    assert "trailers:" in text and f"{0:016x}" in text


def test_show_text_tells_unmeasured_from_held():
    view, facts = _shown()
    learn = {"verdict": "none", "signals_counted": 0, "independent": 0, "metric": "ctr",
             "baseline": 0.5}
    held = render.show_text({**view, "learn_back": {**learn, "measured": "held",
                                                    "value": 0.49}}, facts)
    assert "  measured  held: ctr 0.49 against baseline 0.5" in held
    unmeasured = render.show_text({**view, "learn_back": {**learn, "measured": "unmeasured"}},
                                  facts)
    assert "  measured  unmeasured: ctr no value against baseline 0.5" in unmeasured
    assert "measured" not in render.show_text({**view, "learn_back": learn}, facts)


def test_the_console_pages_render_hostile_fields_inert():
    """Every field a bus participant wrote is escaped: no tag, no attribute, no script."""
    mode = "read-only (no operator key)"
    queue = console.queue_page([_row()], "index", mode)
    view, facts = _shown()
    view["trailers"][1]["actor"] = '"><img src=x onerror=alert(1)>'
    proposal = console.proposal_page(view, facts, mode, csrf=None)
    for html in (queue, proposal):
        assert "<script" not in html and "<img" not in html  # text, never a tag
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
        assert "\x1b" not in html
    assert f'href="/p/{PID}"' in queue and "waits for" in queue
    assert '<p id=chain class=ok>VERIFIED: hashes, links' in proposal
    assert "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;" in proposal
    assert "<form" not in proposal  # read-only: no form at all
    assert "<span class=add>" in proposal and "<span class=del>" in proposal


def test_the_console_offers_signed_decisions_only_with_a_key_and_a_pending_proposal():
    view, facts = _shown()
    signing = console.proposal_page(view, facts, "signing as operator:alice", csrf="t0k")
    assert signing.count('<input type=hidden name=csrf value="t0k">') == 2
    assert f'action="/p/{PID}/approve"' in signing and f'action="/p/{PID}/reject"' in signing
    settled = console.proposal_page(view, {**facts, "status": "applied"}, "signing", "t0k")
    assert "<form" not in settled and "Not waiting for a decision." in settled
    broken = console.proposal_page({**view, "chain": "BROKEN: x trailer 1: hash"}, facts,
                                   "read-only", None)
    assert "<p id=chain class=broken>BROKEN: x trailer 1: hash</p>" in broken
    assert console.chain_class("UNVERIFIED writers (no trusted daemon key …): hashes and "
                               "links verified; …") == "warn"


def test_the_audit_page_and_a_message_escape_what_they_say():
    page = console.audit_page(Verified("BROKEN", 1, ["BROKEN <b>x</b>"]), Job(), "t0k",
                              "read-only")
    assert '<p id=since class="verdict broken">' in page and "BROKEN &lt;b&gt;x&lt;/b&gt;" in page
    assert "<b>" not in page.split("</style>", 1)[1].replace("<body>", "")
    message = console.message_page("refused", "<script>", "m", back="/p/x")
    assert "&lt;script&gt;" in message and "<script>" not in message


def test_a_rendered_proposal_round_trips_the_json_view():
    """The text view takes what `--format json` prints: a view that went through JSON renders
    the same."""
    view, facts = _shown()
    again = msgspec.json.decode(msgspec.json.encode(view))
    assert render.show_text(again, facts) == render.show_text(view, facts)


def test_a_pending_schema_change_shows_the_class_its_store_gave_with_hostile_text_inert():
    found = {"class": "breaking", "reason": f"orders at /qty/type: {HOSTILE}"}
    text = render.review_text([_row(schema_class=found, target="schema:svc"), _row()])
    lines = text.splitlines()
    [line] = [ln for ln in lines if "schema class:" in ln]
    assert line.startswith("  schema class: breaking (orders at /qty/type: <script>")
    assert "\x1b" not in text and "\r" not in text and "\u202e" not in text
    assert "\\x1b[2J\\r\\u202eevil)" in line
    silent = render.review_text([_row(schema_class={"class": "unknown",
                                                    "reason": "service did not answer"})])
    assert "  schema class: unknown (service did not answer)" in silent.splitlines()
    view, facts = _shown()
    assert "schema class" not in render.show_text(view, facts)
    shown = render.show_text(view, {**facts, "schema_class": {"class": "forward\x1b[2J",
                                                              "reason": HOSTILE}})
    assert shown.splitlines()[4] == ("  schema class: forward\\x1b[2J (<script>alert(1)"
                                     "</script>\\x1b[2J\\r\\u202eevil)")
    html = console.proposal_page(view, {**facts, "schema_class": {"class": "breaking",
                                                                  "reason": HOSTILE}},
                                 "read-only (no operator key)", csrf=None)
    assert "<dt>schema</dt><dd>schema class: breaking (&lt;script&gt;alert(1)" in html
    assert "<script" not in html and "\x1b" not in html


def test_show_text_says_the_schema_class_an_applied_change_recorded():
    view, facts = _shown()
    view["outcome"] = {"ok": True, "authority": "operator:alice", "at": 1_796_000_000_000,
                       "schema_class": "breaking"}
    text = render.show_text(view, {**facts, "status": "applied"})
    [line] = [ln for ln in text.splitlines() if ln.startswith("  outcome")]
    assert line.endswith(", schema class breaking (the service's claim)")


def test_who_proposed_is_the_verified_signer_or_a_declared_origin_shown_inert():
    view, facts = _shown()
    signed = render.show_text(view, {**facts, "verified": True, "proposer": "agent:svc:a",
                                     "origin": "mcp:svc-agent:1"})
    assert "  proposer: agent:svc:a (signed)\n" in signed
    unchecked = render.show_text(view, {**facts, "proposer": "agent:svc:a"})
    assert "  proposer: agent:svc:a (signed; the chain is not verified)\n" in unchecked
    hostile = render.show_text(view, {**facts, "verified": True, "origin": HOSTILE})
    assert "  proposer: unsigned (origin.actor <script>alert(1)</script>\\x1b[2J\\r\\u202eevil" \
           ", declared)\n" in hostile
    queue = render.review_text([_row(proposer="agent:svc:b\x1b[2J"), _row(origin=HOSTILE)])
    assert "  proposer: agent:svc:b\\x1b[2J (signed)\n" in queue
    assert "\x1b" not in queue and "\u202e" not in queue
    html = console.proposal_page(view, {**facts, "verified": True, "origin": HOSTILE}, "ro",
                                 csrf=None)
    assert "<dt>proposer</dt><dd>unsigned (origin.actor &lt;script&gt;" in html
    assert "<script" not in html and "\x1b" not in html
