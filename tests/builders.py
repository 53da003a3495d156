"""Pure builders for the core's tests: proposals and last-known-good reports at a fixed clock
(`NOW`), with no broker, no wall clock and no randomness. The end-to-end tests build their wire
messages with `tests.factories` instead."""

from __future__ import annotations

from improved.core import lkg
from improved.core.audit import Draft, seal
from improved.core.boundary import Attested
from improved.core.policy import Policy
from improved.core.record import ProposalRecord, fold
from improved.protocol.model import AnalyzerRef, Origin, Proposal, Summary

NOW = 1_700_000_000_000
ORIGIN_ACTOR = "mcp:aaa:1"
TRIAGER = "improved:test"
SKILL = {"name": "greet", "description": "say hello", "instructions": "wave"}

QUORUM_POLICY = Policy(quorum=True)
DIGEST_A, DIGEST_B = "sha256:" + "a" * 64, "sha256:" + "b" * 64
CONSTITUTION = "_spec/2026-04-20-00-constitution.md"
CHANGELOG_DIFF = (
    f"--- a/{CONSTITUTION}\n+++ b/{CONSTITUTION}\n@@ -1 +1 @@\n-version: 5\n+version: 6\n"
    "--- a/_spec/CHANGELOG.md\n+++ b/_spec/CHANGELOG.md\n@@ -1 +1,2 @@\n # Changelog\n"
    "+- v6: IV.2 amended\n")


def said(value, svc: str = "svc") -> Attested:
    """`value` as the owning service's own answer (`core.boundary`: signed by its key)."""
    return Attested(value, f"service:{svc}", "signature")


def make_proposal(**overrides) -> Proposal:
    """An L2 skill proposal of service "svc", created a minute before `NOW`."""
    fields = dict(
        service="svc",
        target_ref="skill:greet",
        change_class="L2",
        scope="knowledge",
        origin=Origin(actor=ORIGIN_ACTOR, service="svc"),
        analyzer=AnalyzerRef(id="pub.analyzer/1"),
        summary=Summary(template_id="new_skill", args={"name": "greet"}),
        created_at=NOW - 60_000,
        proposal_data={"skill": SKILL},
    )
    fields.update(overrides)
    if fields["change_class"] == "L4" and fields["scope"] != "charter":
        # L4 lists every artefact it touches (SPEC 09 §7)
        fields.setdefault("lkg", [{"artefact": "main", "digest": "sha256:" + "a" * 64,
                                   "smoke_test": "nonempty"}])
    return Proposal(**fields)


def l4(**overrides) -> Proposal:
    """An L4 binary swap of two artefacts, `a` and `b`, each with its last-known-good."""
    fields = dict(
        service="deploy", target_ref="binary:deploy", change_class="L4", scope="operation",
        origin=Origin(actor="agentd:run-1:3", service="agentd"),
        analyzer=AnalyzerRef(id="pub.swapper/1"),
        summary=Summary(template_id="swap", args={}), created_at=NOW - 1000,
        proposal_data={"artefacts": {"a": "new a", "b": "new b"}},
        lkg=[{"artefact": "a", "digest": DIGEST_A, "smoke_test": "nonempty"},
             {"artefact": "b", "digest": DIGEST_B, "smoke_test": "json"}],
    )
    fields.update(overrides)
    return Proposal(**fields)


def report(rc_b: int = 0) -> lkg.LkgReport:
    """The last-known-good check of `l4()`'s artefacts; `b`'s smoke test exits with `rc_b`."""
    return lkg.LkgReport(ok=rc_b == 0, artefacts=[
        lkg.LkgArtefact(artefact="a", lkg_digest="sha256:" + "1" * 64, smoke_test="nonempty",
                        rc=0),
        lkg.LkgArtefact(artefact="b", lkg_digest="sha256:" + "2" * 64, smoke_test="json",
                        rc=rc_b)])


def committed(record: ProposalRecord, draft: Draft, at: int = NOW,
              seq: int | None = None) -> ProposalRecord:
    """What the engine's commit makes of `draft` on `record`, without the broker: the trailer
    sealed at `at` and folded in at stream sequence `seq` (the next one by default)."""
    seq = record.chain.stream_seq + 1 if seq is None else seq
    return fold(record, seal(draft, record, at), seq)
