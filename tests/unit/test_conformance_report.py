"""The conformance kit's pure parts: levels are cumulative, the report's rendering, and the
probe orders it sends (the probes against live services are in
tests/integration/test_conformance.py)."""

from __future__ import annotations

from improved.client.conformance import (
    Check,
    Report,
    level_of,
    probe_order,
    probe_scheme,
    render,
)


def test_levels_are_cumulative():
    ok, bad = (lambda lv: Check(lv, "c", True, "")), (lambda lv: Check(lv, "c", False, "why"))
    assert level_of([]) is None
    assert level_of([bad("L0")]) is None
    assert level_of([ok("L0"), ok("L1"), bad("L1")]) == "L0"
    assert level_of([ok("L0"), ok("L1"), ok("L3")]) == "L1"  # L2 never probed
    assert level_of([ok(lv) for lv in ("L0", "L1", "L2", "L3", "L4")]) == "L4"


def test_render_has_a_line_per_check_and_the_verdict():
    report = Report(service="search", level="L1", checks=[
        Check("L0", "spec.get", True, "answered"),
        Check("L1", "malformed order answered", True, "refused"),
        Check("L2", "refuses without acceptance", False, "it was applied"),
    ])
    assert render(report).splitlines() == [
        "conformance of search (SPEC 09):",
        "  PASS L0 spec.get: answered",
        "  PASS L1 malformed order answered: refused",
        "  FAIL L2 refuses without acceptance: it was applied",
        "search meets L1",
        "not L2: it was applied",
    ]


def test_probe_orders_are_fresh_and_fit_their_scheme():
    a, b = probe_order("search", {"schemes": ["skill:"]}), probe_order("search", {})
    assert a.proposal_id != probe_order("search", {"schemes": ["skill:"]}).proposal_id
    assert (a.proposal.target_ref, a.proposal.scope) == ("skill:conformance-probe", "knowledge")
    assert (b.proposal.target_ref, b.proposal.scope) == ("config:conformance-probe", "operation")
    assert probe_scheme({"schemes": ["Not a scheme"]}) == "config"
