"""The dashboard and the alert rules in deploy/ read what the daemon really exports: a daemon
run as an operator runs it (`improved run --metrics-port`, its own embedded nats-server) is
driven through the bus — an L0 proposal applied by a service, an L2 one left waiting for an
operator, a malformed one refused — and its `/metrics` scraped; every metric a panel or a rule
names must be among the series it serves (tests/promql.py reads the names out of the PromQL).
The rules load in Prometheus (`promtool check rules`, where promtool is installed)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from improved.client import connection
from improved.client.sdk import MeshClient
from improved.protocol.model import ApplyResult
from improved.runtime import bus
from tests.bus import eventually
from tests.cli import ENV, IMPROVED
from tests.factories import rank_proposal, skill_proposal
from tests.promql import dashboard_expressions, exported, metric_names, rule_expressions

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "improved-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "improved-alerts.yml"
# Series Prometheus writes itself for every scrape, which no daemon exports.
SCRAPE_SERIES = {"up"}


class Scrape:
    """One `/metrics` answer, read: each series' samples, and the family each series is of."""

    def __init__(self, text: str):
        families = list(text_string_to_metric_families(text))
        self.series = exported({f.name: f.type for f in families})
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in families:
            for s in family.samples:
                self.samples.setdefault(s.name, []).append((s.labels, s.value))

    def value(self, name: str, **labels: str) -> float | None:
        for have, v in self.samples.get(name, []):
            if all(have.get(k) == want for k, want in labels.items()):
                return v
        return None

    def unexported(self, expressions: list[tuple[str, str]],
                   besides: frozenset[str] = frozenset()) -> list[str]:
        """Each metric the expressions name that this scrape has no sample of."""
        return [f"{where}: {name} (in {expr!r})" for where, expr in expressions
                for name in metric_names(expr)
                if name not in besides and (name not in self.series or not self.samples.get(name))]


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
        return answer.read().decode()


async def _drive(url: str, svc: str) -> None:
    """What an operator's mesh does: an L0 change a service applies, an L2 one that waits
    for an operator, a malformed one the daemon refuses."""
    nc = await connection.connect(url, "dashboards")
    client = MeshClient(nc, svc)

    async def applier(order):
        return ApplyResult(ok=True, applied_id=f"v-{order.proposal_id[:8]}",
                           inverse={"undo": order.proposal_id}, rollbackable=True)

    sub = await client.serve_apply(applier)
    try:
        l0 = (await client.propose(rank_proposal(svc))).proposal_id

        async def applied():
            state = await client.state(l0)
            return state is not None and state.status == "applied"

        await eventually(applied, what="the L0 proposal applied")
        await client.propose(skill_proposal(svc))
        assert "error" in await client.propose_raw(b'{"service": ')
    finally:
        await sub.unsubscribe()
        await connection.close(nc)


@pytest.fixture(scope="module")
async def scrape(tmp_path_factory) -> Scrape:
    """The daemon's `/metrics` once it has applied, queued and refused, and its queue was
    recounted (the oldest wait is set then, every few seconds)."""
    port, mport = bus.free_port(), bus.free_port()
    daemon = await asyncio.to_thread(
        subprocess.Popen, [*IMPROVED, "run", "--data-dir",
                           str(tmp_path_factory.mktemp("dash") / "d"), "--port", str(port),
                           "--metrics-port", str(mport)],
        stderr=subprocess.PIPE, text=True, env=ENV)
    assert daemon.stderr is not None
    try:
        while "ready as improved:" not in (line := await asyncio.to_thread(
                daemon.stderr.readline)):
            assert line, "the daemon exited before it was ready"
        await _drive(f"nats://127.0.0.1:{port}", "dash")

        async def recounted() -> Scrape | None:
            seen = Scrape(await asyncio.to_thread(_get, mport, "/metrics"))
            waiting = seen.value("improved_review_oldest_waiting_timestamp_seconds")
            return seen if waiting else None

        return await eventually(recounted, timeout=20, what="the queue recounted")
    finally:
        daemon.terminate()
        await asyncio.to_thread(daemon.wait, 30)


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def alert_rules() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(ALERTS.read_text())
    return loaded


def test_every_dashboard_query_reads_a_metric_the_daemon_exports(scrape):
    queries = list(dashboard_expressions(dashboard()))
    assert len(queries) >= 20
    missing = scrape.unexported(queries)
    assert not missing, "the dashboard reads what the daemon does not export:\n" + \
        "\n".join(missing)


def test_every_alert_rule_reads_a_metric_the_daemon_exports(scrape):
    rules = list(rule_expressions(alert_rules()))
    missing = scrape.unexported(rules, besides=frozenset(SCRAPE_SERIES))
    assert not missing, "the alert rules read what the daemon does not export:\n" + \
        "\n".join(missing)


def test_the_metrics_say_what_the_daemon_did(scrape):
    """What the panels show after the drive: one L0 accepted and applied, with its latency;
    one L2 deferred and waiting since a moment ago; a verified checkpoint; no crisis."""
    now = time.time()
    assert scrape.value("improved_proposals_triaged_total", verdict="accept",
                        **{"class": "L0"}) == 1
    assert scrape.value("improved_proposals_triaged_total", verdict="defer",
                        **{"class": "L2"}) == 1
    assert scrape.value("improved_proposals_triaged_total", verdict="reject",
                        **{"class": "L4"}) == 0  # every class and verdict, from the start
    assert scrape.value("improved_apply_seconds_count", result="ok") == 1
    assert scrape.value("improved_apply_seconds_bucket", result="ok", le="+Inf") == 1
    assert scrape.value("improved_applies_total", result="ok") == 1
    assert scrape.value("improved_pending_reviews") == 1
    oldest = scrape.value("improved_review_oldest_waiting_timestamp_seconds")
    assert oldest is not None and now - 60 < oldest <= now
    assert scrape.value("improved_refused_total", code="invalid_json") == 1
    assert scrape.value("improved_checkpoint_verified") == 1
    last = scrape.value("improved_checkpoint_last_timestamp_seconds")
    assert last is not None and now - 120 < last <= now
    assert scrape.value("improved_checkpoint_interval_seconds") == 300
    assert scrape.value("improved_checkpoints_total", result="verified") >= 1
    assert scrape.value("improved_crisis_open") == 0
    assert scrape.value("improved_breaker_threshold") == 3
    assert scrape.value("improved_breaker_paused_until_timestamp_seconds") == 0
    assert scrape.value("improved_autonomy", state="on") == 1
    assert scrape.value("improved_rollbacks_total", result="rolled_back",
                        **{"class": "L0"}) == 0
    assert scrape.value("improved_ready") == scrape.value("improved_nats_connected") == 1


def test_the_dashboard_is_importable_with_a_prometheus_data_source_of_ones_own():
    d = dashboard()
    assert d["schemaVersion"] >= 41 and d["uid"] and d["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, \
            panel["title"]
        assert panel["targets"] and panel.get("description"), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    titles = {p["title"] for p in panels}
    for wanted in ("Proposals by class and verdict", "Waiting for an operator",
                   "Oldest waiting", "Apply latency", "Applies by result",
                   "Rollbacks by class", "Breaker paused for", "Autonomy", "Crisis",
                   "Audit chain", "Last checkpoint", "Ready", "NATS"):
        assert wanted in titles


def test_every_alert_rule_says_what_to_do():
    """The structure Prometheus reads (groups → rules → alert, expr, for, labels,
    annotations), checked without promtool; each alert a severity, a summary and a
    description."""
    rules = alert_rules()
    assert set(rules) == {"groups"}
    names = []
    for group in rules["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit"} and group["name"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels",
                                 "annotations"}, rule
            assert rule["alert"] and isinstance(rule["expr"], str) and rule["expr"].strip()
            assert rule["labels"]["severity"] in ("critical", "warning", "info")
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
            if "for" in rule:
                assert isinstance(rule["for"], str) and rule["for"][-1] in "smh"
            names.append(rule["alert"])
    assert len(names) == len(set(names))
    for wanted in ("ImprovedCrisisOpen", "ImprovedBreakerOpen", "ImprovedReviewQueueAging",
                   "ImprovedAppliesFailing", "ImprovedCheckpointStale", "ImprovedNotReady",
                   "ImprovedDown"):
        assert wanted in names


def test_the_rules_and_every_dashboard_query_load_in_prometheus(tmp_path):
    """`promtool check rules` on the rule file, and on every dashboard query made a
    recording rule (Grafana's variables given values), so a query Prometheus cannot parse
    fails here, not on an operator's screen."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH (apt-get install prometheus): the rules' "
                    "structure is checked by test_every_alert_rule_says_what_to_do only")
    checked = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    queries = [expr.replace("$__rate_interval", "5m").replace("${instance}", ".*")
               .replace("$instance", ".*") for _, expr in dashboard_expressions(dashboard())]
    recorded = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"improved:dashboard_query:{i}", "expr": q}
        for i, q in enumerate(queries)]}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(recorded))
    checked = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
