"""Every path a change touches is checked in canonical form, through the real bus: each
disguise of a forbidden path, in each place a proposal can name a path, is rejected at triage
and no order reaches the owning service (constitution VI; issue: guards that cannot be
sidestepped). One table, one test."""

from __future__ import annotations

import asyncio

import pytest

from improved import testing
from improved.client.sdk import MeshClient
from improved.protocol.model import Proposal, ProposalEdit
from improved_reference.ranking_store import RankingStore
from tests.factories import rank_proposal

CONSTITUTION = "_spec/2026-04-20-00-constitution.md"
EDIT = ("--- a/docs/guide.md\n+++ b/docs/guide.md\n@@ -1 +1 @@\n-a\n+b\n"
        f"--- a/{CONSTITUTION}\n+++ b/{CONSTITUTION}\n@@ -1 +1 @@\n-version: 5\n+version: 6\n")


def l0_files(svc: str, path: str) -> Proposal:
    """An L0 ranking change that declares it also touches `path` (applied automatically if
    the guard let it through)."""
    return rank_proposal(svc, target_files=[path])


def target(svc: str, ref: str, change_class: str = "L2", scope: str = "code") -> Proposal:
    return rank_proposal(svc, target_ref=ref, change_class=change_class, scope=scope)


def doc_edit(svc: str, _path: str) -> Proposal:
    return testing.proposal(svc, "doc:docs/guide.md", template="edit_doc",
                            analyzer="acme.docs/1",
                            proposal_edit=ProposalEdit(format="unified-diff",
                                                       base_digest="sha256:" + "0" * 64,
                                                       diff=EDIT))


def l4_artefact(svc: str, path: str) -> Proposal:
    return testing.proposal(svc, f"binary:{svc}", "L4", template="swap",
                            analyzer="acme.swap/1", scope="operation",
                            proposal_data={"artefacts": {path: "new"}},
                            lkg=[{"artefact": path, "digest": "sha256:" + "a" * 64,
                                  "smoke_test": "nonempty"}])


CASES = [
    # (how the path is named, the disguised path, the cause it must be rejected with)
    ("target_files", "%5Fspec/2026-04-20-00-constitution.md", "forbidden_target"),
    ("target_files", "%255Fspec%2F2026-04-20-00-constitution.md", "forbidden_target"),
    ("target_files", "_SPEC/2026-04-20-00-Constitution.MD", "forbidden_target"),
    ("target_files", "＿spec/２０２６-04-20-00-constitution.md", "forbidden_target"),
    ("target_files", "notes/../_spec/2026-04-20-00-constitution.md", "forbidden_target"),
    ("target_files", "_spec\\2026-04-20-00-constitution.md", "forbidden_target"),
    ("target_files", "file:///srv/cosmix/_spec/2026-04-20-00-constitution.md",
     "forbidden_target"),
    ("target_files", "$HOME/.config/cosmix/harness.toml", "forbidden_target"),
    ("target_files", "~alice/.config/cosmix/harness.toml", "forbidden_target"),
    ("target_files", "_spec/2026-04-20-00-constitution.md\x00.txt", "invalid"),
    ("target_files", "_spec/2026-04-20-00-constitution.md%00", "invalid"),
    ("target_files", "_spec/2026-04-20-00-\u200dconstitution.md", "invalid"),
    ("code:", "%5Fspec/2026-04-20-00-constitution.md", "forbidden_target"),
    ("config:", "~/.config/cosmix/%68arness.toml", "forbidden_target"),
    ("rank:", "_spec/CHANGELOG.md", "forbidden_target"),
    ("doc edit", CONSTITUTION, "forbidden_target"),
    ("lkg artefact", "src/crates/cosmix-mcp/bin/mcp", "forbidden_target"),
    ("lkg artefact", "src/crates/COSMIX-MCP%2Fbin/mcp", "forbidden_target"),
]


def build(svc: str, where: str, path: str) -> Proposal:
    if where == "target_files":
        return l0_files(svc, path)
    if where == "code:":
        return target(svc, f"code:{path}", change_class="L4", scope="code")
    if where == "config:":
        return target(svc, f"config:{path}", scope="operation")
    if where == "rank:":
        return target(svc, f"rank:{path}", change_class="L0", scope="knowledge")
    if where == "doc edit":
        return doc_edit(svc, path)
    return l4_artefact(svc, path)


@pytest.mark.parametrize(("where", "path", "cause"), CASES,
                         ids=[f"{w}-{i}" for i, (w, _, _) in enumerate(CASES)])
async def test_no_disguise_of_a_forbidden_path_gets_past_triage(daemon, nc, svc, where, path,
                                                              cause):
    store = RankingStore(nc, svc)
    await store.start()
    client = MeshClient(nc, svc)
    try:
        reply = await client.propose(build(svc, where, path))
        decision = await client.triage(reply.proposal_id)
        assert reply.status == "rejected", (where, path, decision)
        assert (decision.verdict, decision.cause) == ("reject", cause), decision.rationale
        await asyncio.sleep(0.1)
        assert store.orders == 0
    finally:
        await store.stop()
