"""The walk's skill scenes: L1 surfaces an idea, L2 waits for a signed approval, a grant
trusts exactly one content hash, L3 then applies by itself, and a refinement (new content) is
gated again."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import (
    AnalyzerRef,
    GrantCommand,
    Origin,
    Proposal,
    Summary,
    to_json,
)
from improved_demo.cast import (
    AGENT,
    EXTRA_SENTENCE,
    OPERATOR,
    SKILL,
)
from improved_demo.scenes import SETTLE, Scenes, short, short_identity
from improved_demo.timeline import StepFailed


class SkillScenes(Scenes):
    """The skill store's scenes, steps 1 to 5."""

    def skill_proposal(self, change_class: str, skill: dict[str, Any] | None = None,
                       **over: Any) -> Proposal:
        fields: dict[str, Any] = dict(
            service="skills", target_ref="skill:summarize", change_class=change_class,
            scope="knowledge", origin=Origin(actor=AGENT, service="skills"),
            analyzer=AnalyzerRef(id="acme.skills/1"),
            summary=Summary(template_id="new_skill", args={"name": "summarize"}),
            proposal_data={"skill": dict(skill or SKILL)}, created_at=self.now_ms(),
        )
        fields.update(over)
        return Proposal(**fields)

    async def step_l1(self) -> None:
        before = self.mesh.skills.orders
        pid = await self.propose(self.mesh.skills_client, self.skill_proposal("L1"))
        self.ids["l1"] = pid
        d = await self.decision(self.mesh.skills_client, pid)
        self.expect((d.verdict, d.gate_class) == ("accept", "L1"),
                    f"expected accept/L1, got {d.verdict}/{d.gate_class}")
        await self.no_orders(self.mesh.skills, before, "the skills store")
        state = await self.mesh.skills_client.state(pid)
        self.expect(state is not None and state.status == "pending",
                    f"expected status pending, got {state and state.status}")
        self.ok("accept/L1: surfaced for review, status pending; the skills store got no order")

    async def step_l2(self) -> None:
        before = self.mesh.skills.orders
        pid = await self.propose(self.mesh.skills_client, self.skill_proposal("L2"))
        self.ids["l2"] = pid
        d = await self.decision(self.mesh.skills_client, pid)
        self.expect((d.verdict, d.cause, d.gate_class) == ("defer", "awaiting_operator", "L2"),
                    f"expected defer awaiting_operator/L2, got {d.verdict} {d.cause}/"
                    f"{d.gate_class}")
        l1 = self.ids.get("l1")
        if l1:
            async def superseded() -> list[dict[str, Any]] | None:
                chain = await self.chain("skills", l1)
                return chain if chain and chain[-1].get("verdict") == "superseded" else None

            await self.wait(f"the supersession of {short(l1)}", superseded)
            self.event("supersede", f"{short(l1)} (the L1) is superseded by {short(pid)}: same "
                       "dedup_key, newer content")
        self.event("waiting", f"{short(pid)} is pending, awaiting_operator; nothing is applied")
        await self.no_orders(self.mesh.skills, before, "the skills store")
        await self.review("skills", pid, "approve", "first execution looks right")
        try:
            outcome = await self.wait(f"the apply outcome of {short(pid)}",
                                      lambda: self.mesh.skills_client.outcome(pid))
        except StepFailed as exc:
            raise await self.why_not(S.audit("skills", pid), exc) from None
        self.expect(outcome.ok, f"the apply failed: {outcome.error}")
        self.event("apply", f"skills stored {short_identity(outcome.applied_id)}, authority "
                   f"{outcome.authority}, inverse {to_json(outcome.inverse).decode()}")
        await self.status(self.mesh.skills_client, pid, "applied")
        self.expect(outcome.authority == OPERATOR,
                    f"expected authority {OPERATOR}, got {outcome.authority}")
        await asyncio.sleep(SETTLE)
        self.expect(self.mesh.skills.orders == before + 1,
                    f"the skills store got {self.mesh.skills.orders - before} orders; expected 1")
        self.ok(f"approved by {OPERATOR} and applied once (1 order), status applied")

    async def step_grant(self) -> None:
        identity = canonical.skill_identity(SKILL)
        self.identity = identity
        name, sha = identity.split(":")
        self.event("identity", f"canonical.skill_identity(definition) = {identity}")
        await self.signed(S.GRANTS, "grant", GrantCommand(
            op="grant", skill=identity, principal=OPERATOR, reason="trusted after review",
            at=int(time.time() * 1000), proposal_id=self.ids["l2"]))
        self.event("operator", f"{OPERATOR} signs a grant for {short_identity(identity)}, "
                   f"naming {short(self.ids['l2'])} (its approved L2) -> {S.GRANTS}")
        try:
            await self.wait(f"an active grant for {short_identity(identity)}",
                            lambda: self.mesh.skills.check_grant_active(identity))
        except StepFailed as exc:
            raise await self.why_not(S.grant_audit(sha), exc) from None
        self.event("grant", f"active, retained on {S.grant_record(name, sha[:12])}...; the "
                   "skills store sees it too")
        self.ok(f"grant summarize:<sha256> recorded for exactly {short_identity(identity)}")

    async def step_l3(self) -> None:
        before, writes = self.mesh.skills.orders, self.mesh.skills.applies
        pid = await self.propose(self.mesh.skills_client, self.skill_proposal("L3"))
        self.ids["l3"] = pid
        d = await self.decision(self.mesh.skills_client, pid)
        self.expect((d.verdict, d.gate_class) == ("accept", "L3"),
                    f"expected accept/L3, got {d.verdict} {d.cause}/{d.gate_class}")
        outcome = await self.wait(f"the apply outcome of {short(pid)}",
                                  lambda: self.mesh.skills_client.outcome(pid))
        self.expect(outcome.ok, f"the apply failed: {outcome.error}")
        chain = await self.chain("skills", pid)
        applied = [t for t in chain if t.get("to_stage") == "apply"]
        observer = applied[-1]["observer_type"] if applied else None
        how = ("already stored under its hash: adopted, not written twice"
               if self.mesh.skills.applies == writes else "written")
        self.event("apply", f"skills applied {short_identity(outcome.applied_id)} ({how}), "
                   f"observer {observer}, authority {outcome.authority}")
        self.expect(observer == "rec:policy", f"expected observer rec:policy, got {observer}")
        self.expect(outcome.authority == "policy:auto",
                    f"expected authority policy:auto, got {outcome.authority}")
        await self.status(self.mesh.skills_client, pid, "applied")
        self.expect(self.mesh.skills.orders == before + 1,
                    f"the skills store got {self.mesh.skills.orders - before} orders; expected 1")
        self.ok("no operator involved: rec:policy auto-applied it under policy:auto")

    async def step_refine(self) -> None:
        before = self.mesh.skills.orders
        refined = await self.mesh.skills.refine(
            self.identity, {"instructions": SKILL["instructions"] + EXTRA_SENTENCE},
            service="skills", origin_actor=AGENT, analyzer_id="acme.skills/1",
            created_at=self.now_ms())
        proposal = msgspec.structs.replace(refined, change_class="L3")  # it asks for L3
        if proposal.proposal_data is None:
            raise StepFailed("the refinement carries no definition")
        new_identity = canonical.skill_identity(proposal.proposal_data["skill"])
        self.event("refine", f"instructions + {EXTRA_SENTENCE.strip()!r} -> "
                   f"{short_identity(new_identity)} (granted: {short_identity(self.identity)})")
        pid = await self.propose(self.mesh.skills_client, proposal)
        self.ids["refined"] = pid
        d = await self.decision(self.mesh.skills_client, pid)
        self.expect((d.verdict, d.cause, d.gate_class) == ("defer", "no_grant", "L2"),
                    f"expected defer no_grant/L2, got {d.verdict} {d.cause}/{d.gate_class}")
        await self.no_orders(self.mesh.skills, before, "the skills store")
        self.ok("a new hash has no grant: gated as L2 (no_grant), waiting for an operator")
