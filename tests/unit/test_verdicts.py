"""The pure part of an operator command's wait: given the act's digest and what its chain holds,
the daemon's verdict and its one line (improved/cli/verdicts.py)."""

from __future__ import annotations

from improved.cli import verdicts

PID = "ab" * 32
DIGEST = "cd" * 32
OTHER = "ef" * 32


STAGE = {"rollback": "apply", "crisis_resolved": "learn-back"}  # else triage


def trailer(verdict: str, *refs: str, reason: str = "", **kw) -> dict:
    """A trailer as the daemon writes it: at its verdict's stage (a grant names its skill)."""
    refs += ("skill:s:1",) if verdict in ("grant", "revoke") else ()
    return {"proposal_id": PID, "to_stage": STAGE.get(verdict, "triage"), "verdict": verdict,
            "reason": reason, "actor": kw.pop("actor", "improved:x"), "refs": list(refs), **kw}


def test_no_trailer_for_the_act_is_no_verdict_yet():
    chain = [trailer("approve", f"act:{OTHER}", actor="operator:bob"), trailer("accept")]
    assert verdicts.of_act(DIGEST, chain, "approve of x", PID) is None
    assert verdicts.of_act(DIGEST, [], "approve of x", PID) is None


def test_the_trailer_carrying_the_act_is_the_verdict_whatever_else_the_chain_holds():
    chain = [trailer("refused", f"act:{OTHER}", "code:replayed", reason="signed act refused "
                     "(replayed): used"),
             trailer("approve", f"act:{DIGEST}", "act_seq:9", actor="operator:alice"),
             {"verdict": "dispatched", "refs": ["dispatch:apply"]}]
    v = verdicts.of_act(DIGEST, chain, f"approve of {PID} signed by operator:alice", PID)
    assert v is not None and v.accepted and v.exit_code == 0
    assert v.line.startswith(f"accepted: approve of {PID} signed by operator:alice: approved")
    assert f"improved show {PID}" in v.line and "\n" not in v.line


def test_a_refusal_names_its_cause_and_what_to_do():
    chain = [trailer("refused", f"act:{DIGEST}", "act_seq:4", "code:unknown_key",
                     reason="signed act refused (unknown_key): no trusted key ed25519:12")]
    v = verdicts.of_act(DIGEST, chain, "approve of x signed by operator:bob", PID)
    assert v is not None and not v.accepted and v.exit_code == 1 and v.code == "unknown_key"
    assert v.line == ("refused: approve of x signed by operator:bob (unknown_key): no trusted "
                      "key ed25519:12; " + verdicts.FIXES["unknown_key"])
    in_flight = verdicts.of_act(DIGEST, [trailer(
        "refused", f"act:{DIGEST}", "code:apply_in_flight",
        reason="signed act refused (apply_in_flight): dispatched at 5")], "reject of x", PID)
    assert in_flight is not None and f"improved rollback {PID}" in in_flight.line
    unknown = verdicts.of_act(DIGEST, [trailer("refused", f"act:{DIGEST}", "code:new_code",
                                               reason="r")], "x", PID)
    assert unknown is not None and not unknown.accepted and "(new_code)" in unknown.line


def test_grants_votes_rollbacks_and_crisis_resolutions():
    for verdict, words in (("grant", "granted"), ("revoke", "revoked"),
                           ("rollback", "inverse goes to its service"),
                           ("crisis_resolved", "applies resume"),
                           ("vote", "counted: approve by agent-a (session s): 1 of 3")):
        v = verdicts.of_act(DIGEST, [trailer(verdict, f"act:{DIGEST}",
                                             reason="approve by agent-a (session s): 1 of 3")],
                            "the act", PID)
        assert v is not None and v.accepted and words in v.line, (verdict, v)
    grant_refused = verdicts.of_act(DIGEST, [trailer(
        "refused", f"act:{DIGEST}", "code:not_applied_at_l2",
        reason="signed act refused (not_applied_at_l2): proposal p is pending at L2")],
        "grant of s:1", "s:1")
    assert grant_refused is not None and "--proposal" in grant_refused.line


def test_junk_refs_are_no_verdict_and_no_error():
    chain = [{"verdict": "approve", "refs": "act:" + DIGEST}, {"refs": [3, None]}, {}]
    assert verdicts.of_act(DIGEST, chain, "x", PID) is None


def test_no_verdict_in_time_says_it_was_published_and_where_to_look():
    line = verdicts.no_verdict("approve of x", 10.0, f"improved show {PID}")
    assert line.startswith("no verdict within 10 s: approve of x was published")
    assert f"`improved show {PID}`" in line


def test_propose_says_the_decision_its_cause_and_the_fix():
    registered = {"to_stage": "propose", "verdict": None}
    waits = trailer("defer", cause="awaiting_operator", gate_class="L2",
                    reason="L2 needs an operator")
    v = verdicts.of_triage(PID, "pending", [registered, waits], "skill:x")
    assert v.accepted and v.line.startswith(f"{PID} pending: defer/awaiting_operator at L2")
    assert f"improved approve|reject {PID}" in v.line
    applied = verdicts.of_triage(PID, "pending", [registered, trailer(
        "accept", gate_class="L0", reason="L0 applies automatically")], "rank:x")
    assert applied.accepted and "its service applies it" in applied.line


def test_a_typo_in_the_scheme_is_named_not_the_class():
    rejected = trailer("reject", cause="class_mismatch", gate_class="L0",
                       reason="L0 is below the minimum L2 for rnk: targets; re-propose at the "
                              "right class")
    v = verdicts.of_triage(PID, "rejected", [rejected], "rnk:search/results")
    assert not v.accepted and v.exit_code == 1 and v.code == "class_mismatch"
    assert "the target scheme rnk: is not one SPEC 09 lists (did you mean rank:?)" in v.line
    assert "fix the target's scheme" in v.line
    # a known scheme at too low a class is about the class
    known = verdicts.of_triage(PID, "rejected", [trailer(
        "reject", cause="class_mismatch", gate_class="L0",
        reason="L0 is below the minimum L4 for code: targets")], "code:src/x.py")
    assert "re-propose at the right class" in known.line and "scheme" not in known.line


def test_a_reversal_inherits_or_is_triaged():
    rid = "12" * 32
    assert verdicts.of_reversal(rid, [{"to_stage": "propose"}]) is None
    ok = verdicts.of_reversal(rid, [{"to_stage": "propose"},
                                    {"to_stage": "triage", "verdict": "inherit",
                                     "actor": "operator:alice"}])
    assert ok is not None and ok.accepted and "operator:alice" in ok.line and rid in ok.line
    no = verdicts.of_reversal(rid, [{"to_stage": "triage", "verdict": "defer",
                                     "cause": "awaiting_operator", "reason": "r"}])
    assert no is not None and not no.accepted


def test_a_resumed_apply_is_applied_failed_or_still_unreachable():
    def apply(verdict: str, *refs: str) -> dict:
        return {"to_stage": "apply", "verdict": verdict, "refs": list(refs)}

    assert verdicts.of_apply(PID, [apply("dispatched")]) is None
    ok = verdicts.of_apply(PID, [apply("dispatched"), apply("applied")])
    assert ok is not None and ok.accepted
    failed = verdicts.of_apply(PID, [apply("failed", "error:bad diff")])
    assert failed is not None and not failed.accepted and "bad diff" in failed.line
    gone = verdicts.of_apply(PID, [apply("undelivered", "error:no responders")])
    assert gone is not None and not gone.accepted and f"improved retry {PID}" in gone.line


def test_a_verify_says_what_it_checked_against_which_key_and_what_it_could_not():
    """One vocabulary for `audit verify` and `show`: BROKEN whatever the keys (exit 1),
    VERIFIED naming the key and where it was found (0), UNVERIFIED writers without a trusted
    daemon key, never broken (3)."""
    from improved.cli.verdicts import chain_said, is_sound, log_said

    key = {"ed25519:" + "ab" * 32: "the checkpoint key /s/improved/checkpoint.pem"}
    line, code = log_said(17, False, key)
    assert code == 0 and line == (
        "VERIFIED 17 chains: hashes, links, daemon signatures and signed acts, against daemon "
        "key ed25519:abababab… (the checkpoint key /s/improved/checkpoint.pem)")
    line, code = log_said(17, False, {})
    assert code == 3 and line.startswith("UNVERIFIED writers (no trusted daemon key: ")
    assert "hashes and links of 17 chains verified" in line
    assert log_said(17, True, {})[1] == log_said(17, True, key)[1] == 1
    assert log_said(17, False, key, runtimes_unverified=1)[1] == 3
    assert chain_said(None, key).startswith("VERIFIED: hashes, links, daemon signatures")
    assert chain_said(None, {}).startswith("UNVERIFIED writers (no trusted daemon key: ")
    assert chain_said("x trailer 2: hash", key) == "BROKEN: x trailer 2: hash"
    assert is_sound(chain_said(None, {})) and not is_sound(chain_said("x", key))
