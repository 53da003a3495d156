"""The PromQL name reader the dashboard test relies on (tests/promql.py): it must find every
metric an expression selects, and take nothing else for one — or a dashboard naming a metric
the daemon does not export would pass, or a correct one fail."""

from __future__ import annotations

import pytest

from tests.promql import dashboard_expressions, exported, metric_names, rule_expressions


@pytest.mark.parametrize("expr, names", [
    ("improved_ready", ["improved_ready"]),
    ("up{job=\"improved\"} == 0", ["up"]),
    # functions and aggregations are followed by `(`; ranges and Grafana variables are not names
    ("sum by (class, verdict) (rate(improved_proposals_triaged_total[$__rate_interval]))",
     ["improved_proposals_triaged_total"]),
    ("sum(rate(improved_applies_total{result=~\"failed|unreachable\"}[15m])) by (result)",
     ["improved_applies_total"]),
    ("histogram_quantile(0.95, sum by (le, result) "
     "(rate(improved_apply_seconds_bucket{instance=~\"${instance}\"}[5m])))",
     ["improved_apply_seconds_bucket"]),
    # binary operators, keywords, bool, vector matching with its label lists
    ("a_total / ignoring(result) group_left(class) b_total and on (instance) c or d unless e",
     ["a_total", "b_total", "c", "d", "e"]),
    ("time() - improved_checkpoint_last_timestamp_seconds > bool 3 * interval_seconds",
     ["improved_checkpoint_last_timestamp_seconds", "interval_seconds"]),
    ("x offset 5m", ["x"]),
    ("x @ start()", ["x"]),
    ("max without (instance, job) (x_total)", ["x_total"]),
    # labels and their values, strings, numbers, durations, comments
    ("count(x{le=\"+Inf\", code!='sum(y)', msg=`z`}) > 1e3  # and not_a_metric",
     ["x"]),
    ("label_replace(x, \"dst\", \"$1\", \"src\", \"(.*)\")", ["x"]),
    ("y > 0x1F and y < Inf and y != NaN", ["y"]),
    ("absent(improved_ready)", ["improved_ready"]),
    ("clamp_min(sum(rate(a_total[1h30m])), 1) / b", ["a_total", "b"]),
    ("{__name__=\"selected_by_matcher\"}", []),
    ("x + x", ["x"]),
    ("colon:recorded:rule", ["colon:recorded:rule"]),
])
def test_metric_names_are_what_an_expression_selects(expr, names):
    assert metric_names(expr) == names


def test_series_resolve_to_their_family_by_type():
    series = exported({"improved_apply_seconds": "histogram", "improved_applies": "counter",
                       "improved_ready": "gauge"})
    assert series["improved_apply_seconds_bucket"] == "improved_apply_seconds"
    assert series["improved_apply_seconds_count"] == "improved_apply_seconds"
    assert series["improved_apply_seconds_sum"] == "improved_apply_seconds"
    assert series["improved_applies_total"] == "improved_applies"
    assert series["improved_ready"] == "improved_ready"
    # a counter is read as its _total, a histogram through its series
    assert "improved_applies" not in series
    assert "improved_apply_seconds" not in series
    assert "improved_ready_total" not in series


def test_every_query_of_a_dashboard_and_a_rule_file_is_found():
    dashboard = {
        "panels": [
            {"title": "a", "targets": [{"expr": "x"}, {"expr": "y"}, {"refId": "C"}]},
            {"title": "row", "type": "row", "panels": [
                {"title": "collapsed", "targets": [{"expr": "z"}]}]},
        ],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus"},
            {"name": "instance", "type": "query",
             "query": {"query": "label_values(improved_ready, instance)"}},
            {"name": "job", "type": "query", "query": "label_values(up{a=\"b\"}, job)"},
        ]},
    }
    assert list(dashboard_expressions(dashboard)) == [
        ("panel 'a'", "x"), ("panel 'a'", "y"), ("panel 'collapsed'", "z"),
        ("variable 'instance'", "improved_ready"), ("variable 'job'", "up{a=\"b\"}")]
    rules = {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "a > 1"},
                                                {"record": "r:b", "expr": "sum(b)"}]}]}
    assert list(rule_expressions(rules)) == [("rule 'A'", "a > 1"), ("rule 'r:b'", "sum(b)")]
