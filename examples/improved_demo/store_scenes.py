"""The walk's scenes on the other stores: a CAL batch and a doc edit applied and undone by
their stores' inverses, an L4 swap against its last-known-good with a reversal made in advance,
and schema changes classified by the store that holds the schema."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from improved.client.sdk import MeshClient
from improved.core import authority
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import (
    AnalyzerRef,
    Origin,
    Proposal,
    ProposalEdit,
    Summary,
)
from improved_demo.cast import (
    CURATOR,
    DEPLOYER,
    GUIDE,
    GUIDE_V1,
    GUIDE_V2,
    MERGE,
    NAMESPACE,
    OPERATOR,
    orders_schema,
)
from improved_demo.scenes import Scenes, short
from improved_demo.timeline import StepFailed
from improved_reference import diffs
from improved_reference.artefact_store import digest_of
from improved_reference.doc_store import digest as doc_digest


class StoreScenes(Scenes):
    """The knowledge, doc and artefact stores' scenes, steps 10 to 12."""

    def knowledge_proposal(self, service: str, target: str, template: str,
                           **body: Any) -> Proposal:
        return Proposal(
            service=service, target_ref=target, change_class="L2", scope="knowledge",
            origin=Origin(actor=CURATOR, service=service),
            analyzer=AnalyzerRef(id="curator.duplicate_sweep/1"),
            summary=Summary(template_id=template, args={"target": target}),
            created_at=self.now_ms(), **body)

    async def approved_and_undone(self, client: MeshClient, pid: str, show: Callable[[], Any],
                                  what: str, inverse: Callable[[Any], str]) -> Any:
        """Approve `pid`, wait for its outcome, show the change, then roll it back by the
        inverse the service returned; the outcome."""
        svc = client.service
        await self.decision(client, pid)
        await self.review(svc, pid, "approve", f"the {what} looks right")
        try:
            out = await self.wait(f"the apply outcome of {short(pid)}",
                                  lambda: client.outcome(pid))
        except StepFailed as exc:
            raise await self.why_not(S.audit(svc, pid), exc) from None
        self.expect(out.ok and out.rollbackable, f"the apply failed or is not rollbackable: "
                    f"{out.error}")
        self.event("apply", f"{svc}: {await show()}; authority {out.authority}")
        self.event("inverse", inverse(out.inverse))
        await self.review(svc, pid, "rollback", f"undo the {what}")
        try:
            await self.status(client, pid, "rolled_back")
        except StepFailed as exc:
            raise await self.why_not(S.audit(svc, pid), exc) from None
        self.event("rollback", f"{svc}: {await show()}")
        return out

    async def step_knowledge(self) -> None:
        async def facts() -> str:
            live = await self.mesh.memory.recall(NAMESPACE)
            return f"{len(live)} live fact(s): " + ", ".join(
                sorted(repr(g["object"]) for g in live.values()))

        self.event("memory", f"{NAMESPACE}: {await facts()}")
        pid = await self.propose(self.mesh.memory_client, self.knowledge_proposal(
            "memory", "entity:fitness/user:john-smith", "merge_duplicate_facts",
            proposal_cal=MERGE, namespace=NAMESPACE))

        def plan(inverse: Any) -> str:
            [step] = inverse["cal_inverse"]
            return (f"supersede {step['target'][:19]}… and reinstate "
                    + ", ".join(a[:19] + "…" for a in step["restore_from"])
                    + ": the grains the batch really wrote, so a rollback can replay it")

        out = await self.approved_and_undone(self.mesh.memory_client, pid, facts, "merge", plan)
        [step] = out.inverse["cal_inverse"]
        live = await self.mesh.memory.recall(NAMESPACE)
        self.expect(sorted(live) == sorted(step["restore_from"]),
                    f"expected the 2 duplicates back, found {sorted(live)}")
        pid = await self.propose(self.mesh.docs_client, self.knowledge_proposal(
            "docs", f"doc:{GUIDE}", "edit_doc", proposal_edit=ProposalEdit(
                format="unified", base_digest=doc_digest(GUIDE_V1),
                diff=diffs.make(GUIDE_V1, GUIDE_V2, GUIDE))))

        async def guide() -> str:
            text = await self.mesh.docs.document(GUIDE) or ""
            return f"{GUIDE} line 3 reads {text.splitlines()[2]!r}"

        def reverse(inverse: Any) -> str:
            edit = inverse["edit"]
            return (f"the reverse diff on base {edit['base_digest'][:19]}… (the new head): a "
                    "later edit would make it refused, never applied over")

        await self.approved_and_undone(self.mesh.docs_client, pid, guide, "edit", reverse)
        self.expect(await self.mesh.docs.document(GUIDE) == GUIDE_V1, f"{GUIDE} is not back")
        self.ok("a CAL batch and a doc edit applied under the operator's approval, each undone "
                "by the inverse its store returned")

    def swap_proposal(self, new: dict[str, str]) -> Proposal:
        return Proposal(
            service="deploy", target_ref="binary:deploy", change_class="L4", scope="operation",
            origin=Origin(actor=DEPLOYER, service="deploy"),
            analyzer=AnalyzerRef(id="acme.release/1"),
            summary=Summary(template_id="swap_binary", args={"n": len(new)}),
            proposal_data={"artefacts": new},
            lkg=[{"artefact": name, "digest": "sha256:" + canonical.sha256_hex(text.encode()),
                  "smoke_test": "json"} for name, text in new.items()],
            created_at=self.now_ms())

    async def step_l4(self) -> None:
        before = await self.mesh.deploy.manifest()
        bad = await self.propose(self.mesh.deploy_client, self.swap_proposal(
            {"app": '{"release": 2}', "config": "{ not json"}))
        await self.decision(self.mesh.deploy_client, bad)
        await self.review("deploy", bad, "approve", "release 2")
        out = await self.outcome(self.mesh.deploy_client, bad)
        self.event("apply", f"ok={out.ok}: {out.error}")
        self.expect(not out.ok and await self.mesh.deploy.manifest() == before,
                    "a swap with a failing artefact changed something")
        self.event("lkg", "app and config both still at their last-known-good: all or none")

        good = await self.propose(self.mesh.deploy_client, self.swap_proposal(
            {"app": '{"release": 2}', "config": '{"workers": 8}'}))
        await self.decision(self.mesh.deploy_client, good)
        await self.review("deploy", good, "approve", "release 2, fixed")
        out = await self.outcome(self.mesh.deploy_client, good)
        self.expect(out.ok, f"the healthy swap failed: {out.error}")
        chain = await self.chain("deploy", good)
        verdicts = [t.get("verdict") for t in chain]
        self.expect(verdicts.index("lkg_verified") < verdicts.index("applied"),
                    "the reversal was not recorded before the apply")
        # the reversal travels on the chain (the `revert:` ref of the lkg_verified trailer)
        checked = chain[verdicts.index("lkg_verified")]
        reversal = next(r[len("revert:"):] for r in checked["refs"] if r.startswith("revert:"))
        rid = out.revert_proposal_id
        if rid is None:
            raise StepFailed("the healthy swap's outcome names no revert_proposal_id")
        self.event("apply", f"{out.applied_id}; reversal recorded before the apply: "
                   f"revert_proposal_id {short(rid)}")
        await self.mesh.deploy_client.publish(msgspec.json.decode(reversal))
        rev = await self.outcome(self.mesh.deploy_client, rid)
        self.expect(rev.ok and rev.authority == OPERATOR,
                    f"the reversal did not run under {OPERATOR}: {rev.error or rev.authority}")
        await self.status(self.mesh.deploy_client, good, "rolled_back")
        self.expect(await self.mesh.deploy.manifest() == before, "the reversal left a new version")
        self.event("revert", f"{short(rid)} inherited the approval of "
                   f"{OPERATOR}: no second signature; both artefacts back")
        self.ok("L4: unhealthy swap refused whole; healthy swap applied, then reverted through "
                "its revert_proposal_id without a second approval")

    def schema_proposal(self, qty_maximum: int, revert: bool = True) -> Proposal:
        """`orders` with `qty` bounded by `qty_maximum`, and the revert to the seeded schema."""
        new = orders_schema(qty_maximum)
        return Proposal(
            service="deploy", target_ref="schema:deploy", change_class="L4", scope="operation",
            origin=Origin(actor=DEPLOYER, service="deploy"),
            analyzer=AnalyzerRef(id="acme.release/1"),
            summary=Summary(template_id="schema_change", args={"artefact": "orders"}),
            proposal_data={"artefacts": {"orders": new}},
            lkg=[{"artefact": "orders", "digest": digest_of(new.encode()),
                  "smoke_test": "json_schema"}],
            revert={"restore": {"orders": digest_of(orders_schema(100).encode())}} if revert else None,
            created_at=self.now_ms())

    async def step_schema(self) -> None:
        await self.mesh.deploy.seed({"orders": orders_schema(100)})
        bare = await self.propose(self.mesh.deploy_client, self.schema_proposal(1000, revert=False))
        d = await self.decision(self.mesh.deploy_client, bare)
        self.expect(d.verdict == "reject" and "schema_revert" in d.rationale,
                    "a schema change without its revert was not rejected")
        for maximum, ok in ((10, False), (1000, True)):
            p = self.schema_proposal(maximum)
            pid = await self.propose(self.mesh.deploy_client, p)
            await self.decision(self.mesh.deploy_client, pid)
            await self.review("deploy", pid, "approve", f"qty up to {maximum}",
                              authority.will_run_digest(p))
            out = await self.outcome(self.mesh.deploy_client, pid)
            self.event("apply", f"ok={out.ok}: {out.error or out.applied_id}")
            self.expect(out.ok == ok and (ok or (out.error or "").startswith("schema_backward")),
                        f"qty maximum {maximum}: expected ok={ok}, got {out.error}")
        self.ok("schema: no revert, rejected; a change that only takes away, refused though "
                "approved; a forward-compatible one, applied")
