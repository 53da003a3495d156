"""The walk's ranking scenes: feedback collapse held until an independent signal, forbidden
targets refused whatever the class, an operator's rollback, and a re-measurement that regressed
and rolled back by itself."""

from __future__ import annotations

import time
from typing import Any

from improved.core.breaker import AUTONOMY_ID, from_trailer
from improved.protocol import subjects as S
from improved.protocol.model import (
    AnalyzerRef,
    MetricSnapshot,
    Origin,
    Proposal,
    Signal,
    Summary,
    to_json,
)
from improved_demo.cast import (
    EVALUATOR,
    FORBIDDEN,
    NEW,
    PRIOR,
    RANK_KEY,
    SNIPPET_KEY,
    TUNER,
    TUNER_AGAIN,
)
from improved_demo.scenes import Scenes, short
from improved_demo.timeline import StepFailed


class RankingScenes(Scenes):
    """The ranking store's scenes, steps 6 to 9."""

    def rank_proposal(self, change_class: str, key: str, value: Any, **over: Any) -> Proposal:
        fields: dict[str, Any] = dict(
            service="search", target_ref=f"rank:{key}", change_class=change_class,
            scope="knowledge", origin=Origin(actor=TUNER, service="search"),
            analyzer=AnalyzerRef(id="acme.tuner/1"),
            summary=Summary(template_id="adjust_rank", args={"item": key, "delta": value}),
            proposal_data={"set": {"key": key, "value": value}}, created_at=self.now_ms(),
        )
        fields.update(over)
        return Proposal(**fields)

    async def step_collapse(self) -> None:
        before = self.mesh.search.orders
        self_signal = Signal(kind="refine", actor=TUNER_AGAIN, service="search", positive=True,
                             at=int(time.time() * 1000))
        proposal = self.rank_proposal("L0", RANK_KEY, NEW, signals=[self_signal])
        self.event("evidence", f"its only positive signal comes from {TUNER_AGAIN}, the "
                   f"proposer's own session ({TUNER.rsplit(':', 1)[0]})")
        pid = await self.propose(self.mesh.search_client, proposal)
        self.ids["rank"] = pid
        d = await self.decision(self.mesh.search_client, pid)
        self.expect((d.verdict, d.cause) == ("defer", "feedback_collapse"),
                    f"expected defer feedback_collapse, got {d.verdict} {d.cause}")
        await self.no_orders(self.mesh.search, before, "the ranking store")
        claim = await self.mesh.evaluator.refine(Signal(
            kind="check", actor="operator:alice", service="billing", positive=True,
            at=int(time.time() * 1000), proposal_id=pid), service="search")
        self.event("signal", "an unsigned positive check claiming operator:alice of billing: "
                   f"counted={claim.counted}, independent={claim.independent} (no verified "
                   "identity: a string anyone can write)")
        self.expect(claim.counted and not claim.independent,
                    "an unsigned claim was counted as independent")
        await self.no_orders(self.mesh.search, before, "the ranking store")
        reply = await self.mesh.evaluator.refine(Signal(
            kind="check", actor=EVALUATOR, service="evaluator", positive=True,
            at=int(time.time() * 1000), proposal_id=pid), key=self.mesh.evaluator_key)
        self.event("signal", f"{EVALUATOR} signs a positive check with the key the trust store "
                   f"binds to it: counted={reply.counted}, independent={reply.independent}")
        self.expect(reply.counted and reply.independent,
                    "the evaluator's signal was not counted as independent")
        await self.status(self.mesh.search_client, pid, "applied")
        outcome = await self.mesh.search_client.outcome(pid)
        if outcome is None or not outcome.ok:
            raise StepFailed("no successful apply outcome")
        value = await self.mesh.search.value(RANK_KEY)
        self.event("apply", f"search set {RANK_KEY} {PRIOR} -> {value}, authority "
                   f"{outcome.authority}, inverse {to_json(outcome.inverse).decode()}")
        self.expect(value == NEW, f"expected {RANK_KEY} = {NEW}, found {value!r}")
        self.ok("feedback_collapse held it until a verified independent signal; then applied")

    async def step_forbidden(self) -> None:
        before = self.mesh.search.orders
        for cls, note in (("L0", "would auto-apply"), ("L4", "an operator could approve")):
            proposal = self.rank_proposal(cls, "search.freshness", 0.7, target_files=[
                "ranking/freshness.toml", FORBIDDEN])
            self.event("sneak", f"an {cls} change ({note}) lists target_files {FORBIDDEN!r}")
            pid = await self.propose(self.mesh.search_client, proposal)
            self.ids[f"forbidden-{cls}"] = pid
            d = await self.decision(self.mesh.search_client, pid)
            self.expect((d.verdict, d.cause) == ("reject", "forbidden_target"),
                        f"expected reject forbidden_target, got {d.verdict} {d.cause}")
            await self.status(self.mesh.search_client, pid, "rejected")
        await self.no_orders(self.mesh.search, before, "the ranking store")
        self.ok("rejected forbidden_target at L0 and at L4: the path is normalised first")

    async def step_rollback(self) -> None:
        pid = self.ids.get("rank")
        if pid is None:
            raise StepFailed("no ranking change from step 6 to roll back")
        await self.review("search", pid, "rollback", "title boost hurt click-through")
        try:
            await self.status(self.mesh.search_client, pid, "rolled_back")
        except StepFailed as exc:
            raise await self.why_not(S.audit("search", pid), exc) from None
        chain = await self.chain("search", pid)
        # the rollback asked, its order's dispatch recorded (by the daemon), the outcome
        tail = ", ".join("dispatched" if t.get("verdict") == "dispatched"
                         else f"{t.get('verdict')} by {t.get('actor')}" for t in chain[-3:])
        self.event("rollback", f"{short(pid)}: {tail}")
        value = await self.mesh.search.value(RANK_KEY)
        self.event("value", f"{RANK_KEY} is {value} again (it was {NEW})")
        self.expect(value == PRIOR, f"expected {RANK_KEY} back at {PRIOR}, found {value!r}")
        _, body = await self.mesh.reader.chain_head(S.autonomy_audit(AUTONOMY_ID))
        counted = len(from_trailer(body).rollbacks)
        p = self.mesh.config.policy
        self.event("breaker", f"{counted} rollback of an autonomous apply on the autonomy chain; "
                   f"{p.breaker_threshold} within {p.breaker_window_days:g} days pause autonomy "
                   f"for {p.breaker_pause_hours:g} h")
        self.expect(counted >= 1, "the autonomous rollback was not counted for the breaker")
        self.ok("rolled_back: the recorded inverse restored the prior value")

    async def step_remeasure(self) -> None:
        metric_key, baseline, worse = "metrics.ctr", 0.31, 0.22
        values = await self.mesh.nc_search.jetstream().key_value(self.mesh.search.values_bucket)
        await values.put(metric_key, to_json(baseline))
        due = self.now_ms() + 800
        proposal = self.rank_proposal("L0", SNIPPET_KEY, 0.8, metric_snapshot=MetricSnapshot(
            metric="ctr", baseline=baseline, query=metric_key, review_after=due))
        pid = await self.propose(self.mesh.search_client, proposal)
        await self.status(self.mesh.search_client, pid, "applied")
        self.event("snapshot", f"ctr was {baseline} at the proposal; the owning service is asked "
                   f"again at review_after (+0.8 s) on search.improve.measure")
        await values.put(metric_key, to_json(worse))
        self.event("world", f"meanwhile click-through fell to {worse}")
        try:
            await self.status(self.mesh.search_client, pid, "rolled_back")
        except StepFailed as exc:
            raise await self.why_not(S.audit("search", pid), exc) from None
        chain = await self.chain("search", pid)
        verdict = next((t for t in chain if t.get("verdict") in ("held", "regressed",
                                                                 "unmeasured")), None)
        self.expect(verdict is not None and verdict["verdict"] == "regressed",
                    f"expected a regressed measurement, found {verdict and verdict['verdict']}")
        refs = dict(r.split(":", 1) for r in (verdict or {}).get("refs", []) if ":" in r)
        self.event("measured", f"{short(pid)} measured by {refs.get('measured_by', '?')}: "
                   f"value {refs.get('value', '?')} against baseline {refs.get('baseline', '?')} "
                   f"-> regressed; rollback proposal "
                   f"{short(refs.get('rollback_proposal', '?'))}")
        value = await self.mesh.search.value(SNIPPET_KEY)
        self.expect(value is None, f"expected {SNIPPET_KEY} removed again, found {value!r}")
        self.event("value", f"{SNIPPET_KEY} is unset again: the recorded inverse was applied")
        self.ok("re-measured at review_after, regressed, rolled back by its recorded inverse")
