"""The metric names that the dashboard's and the alert rules' PromQL reads, and the family each
resolves to in a scrape: enough for a test to tell an expression that names a metric the
daemon does not export. Pure, no PromQL engine: a tokenizer that knows what is not a metric
name — a function or an aggregation (a name followed by `(`, or an aggregation by its
grouping: `sum by (le) (…)`), a keyword or binary operator,
a label inside `{…}` or in the list after `by`, `without`, `on`, `ignoring`, `group_left` or
`group_right`, a string, a number or duration, a range `[…]`, a Grafana variable.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

# The words PromQL gives a meaning of its own where a metric name could stand.
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                      "and", "or", "unless", "offset", "atan2", "inf", "nan"})
# The aggregations, which may take their grouping before the parenthesis: `sum by (le) (x)`.
AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
                          "count_values", "bottomk", "topk", "quantile", "limitk",
                          "limit_ratio"})
# Keywords whose parenthesis holds label names, not an expression.
LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
# The series a family of each type exposes in the text format, by suffix.
SUFFIXES = {"counter": ("_total", "_created"),
            "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"),
            "info": ("_info",),
            "stateset": ("",),
            "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
            "unknown": ("",)}

_TOKEN = re.compile(r"""
      (?P<space>\s+)
    | (?P<comment>\#[^\n]*)
    | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    | (?P<variable>\$\{[^}]*\}|\$\w+|\[\[\w+\]\])
    | (?P<number>0[xX][0-9a-fA-F]+|\d[\w.]*|\.\d[\w.]*)
    | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<open>[({\[])
    | (?P<close>[)}\]])
    | (?P<other>.)
""", re.X | re.S)


def _tokens(expr: str) -> list[tuple[str, str]]:
    """(kind, text) of every token that matters: no space, no comment."""
    return [(m.lastgroup or "other", m.group()) for m in _TOKEN.finditer(expr)
            if m.lastgroup not in ("space", "comment")]


def metric_names(expr: str) -> list[str]:
    """The metric names `expr` selects, each once, in order of appearance."""
    tokens = _tokens(expr)
    found: list[str] = []
    stack: list[str] = []  # the open brackets: "(", "{", "[" or "labels" (a label list)
    for i, (kind, text) in enumerate(tokens):
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "open":
            label_list = text == "(" and i > 0 and tokens[i - 1][1].lower() in LABEL_LISTS
            stack.append("labels" if label_list else text)
        elif kind == "close":
            if stack:
                stack.pop()
        elif kind == "name" and not any(s in ("{", "[", "labels") for s in stack) \
                and following != "(" and text.lower() not in KEYWORDS and text not in found \
                and not (text in AGGREGATIONS and following.lower() in ("by", "without")):
            found.append(text)
    return found


def exported(families: Mapping[str, str]) -> dict[str, str]:
    """Every series name a scrape's families expose (family name → type, as
    prometheus_client's parser reads them), mapped to its family: `x_bucket` of histogram
    `x` resolves to `x`, `y_total` of counter `y` to `y`."""
    return {family + suffix: family for family, kind in families.items()
            for suffix in SUFFIXES.get(kind, ("",))}


def dashboard_expressions(dashboard: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every query of a Grafana dashboard: each panel's targets (rows'
    collapsed panels too) and each query variable (the series of `label_values(series,
    label)`)."""

    def panels(items: list[Any]) -> Iterator[Mapping[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield f"panel {panel.get('title')!r}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        values = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query, re.S)
        yield f"variable {variable.get('name')!r}", values.group(1) if values else query


def rule_expressions(rules: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every rule of a Prometheus rule file."""
    for group in rules.get("groups", []):
        for rule in group.get("rules", []):
            name = rule.get("alert") or rule.get("record")
            yield f"rule {name!r}", str(rule.get("expr", ""))
