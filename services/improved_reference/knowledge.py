"""The knowledge store's decisions, pure: what a CAL Tier-1 batch or an inverse plan does to one
namespace's grains, whether the approver may write there, and whether the quotas allow it.

A namespace's state is one JSON object (the store keeps it as one KV value, so a batch is
applied all or nothing by one compare-and-set):

    {"grains": {hex: grain},                   content-addressed: hex = OMS address of grain
     "index":  {hex: {"superseded_by"?, "system_valid_to"?, "invalidation_type"?,
                      "supersedes"?: [hex, ...]}},         index-layer fields, never in a grain
     "writes": [[at_ms, "add" | "supersede" | "revert"], ...]}   the last minute, for quotas

A grain is live while its index entry has neither `superseded_by` nor `system_valid_to`.
Nothing is ever deleted (OMS: CAL has no destructive verb); undo closes and reopens grains.

Execution (OMS §7.1): ADD puts a new grain; SUPERSEDE (by address or by `<plural> WHERE …`
over the live grains) writes one new grain — the first match's content with the SETs — and
closes every grain it replaces; REVERT writes a copy of the version the head superseded and
closes the head (E041 when there is none). Every address a statement names must be a grain of
this namespace (rule 8: no write outside the recommendation's own namespace).

The inverse (OMS §3.6) is `cal.inverse` given the addresses actually written, so every step
names a real grain and can be replayed. A plan is itself applicable, step by step:

    {"op": "retract",   "target": A}                      close live A as a retraction
    {"op": "reinstate", "target": A}                      reopen A, closed by a retraction
    {"op": "supersede", "target": A | [A…], "restore_from": B | [B…]}
                                                          close live A…, reopen B… that A… had
                                                          superseded

and the inverse of a plan is again a plan, so a rollback can itself be rolled back. A step
whose grains moved since (a later change superseded them) is refused: drift is never undone
over the top of someone else's change.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from improved.protocol import cal, canonical

# CAL §17.3 Tier-1 write quotas, per namespace per minute (oms.md §7.2).
MAX_ADD_PER_MINUTE = 20
MAX_SUPERSEDE_PER_MINUTE = 10
MAX_REVERT_PER_MINUTE = 5
QUOTAS = {"add": MAX_ADD_PER_MINUTE, "supersede": MAX_SUPERSEDE_PER_MINUTE,
          "revert": MAX_REVERT_PER_MINUTE}
QUOTA_WINDOW_MS = 60_000
# OMS header type bytes of the CAL-addable grain types (OMS §3.1.1).
TYPE_BYTES = {"fact": 0x01, "workflow": 0x04, "observation": 0x06, "goal": 0x07, "skill": 0x0B}
# Who may write which namespaces unless the store is told otherwise: operators (an approval
# is theirs) and the policy principal (auto-applies), into any namespace. `--writer` narrows.
DEFAULT_WRITERS: tuple[tuple[str, str], ...] = (("operator:*", "*"), ("policy:*", "*"))
_PREFIX = "sha256:"


class Refused(ValueError):
    """The batch or plan is not applied; the text says why, with CAL's code where it has one."""


@dataclass(frozen=True)
class Outcome:
    state: dict[str, Any]  # the namespace after the change
    inverse: list[dict[str, Any]]  # the plan that undoes it
    written: list[str]  # addresses of the grains the change wrote (new grains), in order


def empty() -> dict[str, Any]:
    return {"grains": {}, "index": {}, "writes": []}


def check_state(state: object) -> dict[str, Any]:
    """The namespace's state as read from KV, or Refused: anyone on the bus may write a KV
    entry, so a grain that does not match its address, or a malformed index, is never built
    on (a corrupt namespace refuses every change until an operator repairs it)."""
    def corrupt(why: str) -> Refused:
        return Refused(f"the namespace's stored state is not this store's: {why}; nothing was "
                       "applied")

    if not isinstance(state, dict) or not isinstance(state.get("grains"), dict) or \
            not isinstance(state.get("index"), dict) or not isinstance(state.get("writes"), list):
        raise corrupt("expected {grains, index, writes}")
    for h, grain in state["grains"].items():
        if not isinstance(grain, dict) or grain.get("type") not in TYPE_BYTES:
            raise corrupt(f"grain {h[:12]} is not a CAL-addable grain")
        try:
            intact = address_of(grain) == h
        except canonical.CanonicalError:
            intact = False
        if not intact:
            raise corrupt(f"grain {h[:12]} does not match its content address")
    if not all(isinstance(e, dict) and h in state["grains"] for h, e in state["index"].items()):
        raise corrupt("an index entry names no stored grain")
    if not all(isinstance(w, list) and len(w) == 2 and isinstance(w[0], int)
               and w[1] in QUOTAS for w in state["writes"]):
        raise corrupt("the quota's write log is malformed")
    return state


def live(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The grains recall returns: neither superseded nor closed."""
    index = state["index"]
    return {h: g for h, g in state["grains"].items()
            if not {"superseded_by", "system_valid_to"} & set(index.get(h, {}))}


def address_of(grain: Mapping[str, Any]) -> str:
    return canonical.content_address(dict(grain), TYPE_BYTES[grain["type"]])


def may_write(principal: str, namespace: str, writers: Iterable[tuple[str, str]]) -> bool:
    """Rule 8: the approving principal's capability, as globs (principal, namespace)."""
    return any(fnmatch.fnmatchcase(principal, who) and fnmatch.fnmatchcase(namespace, where)
               for who, where in writers)


def check_quota(state: Mapping[str, Any], batch: cal.Batch, now: int) -> list[list[Any]]:
    """The namespace's writes of the last minute with this batch's added, or Refused (E052 for
    ADD, E043 otherwise) naming the quota the batch would exceed."""
    recent = [w for w in state.get("writes", []) if now - w[0] < QUOTA_WINDOW_MS]
    mine = [_verb(s) for s in batch]
    for verb, limit in QUOTAS.items():
        used = sum(1 for _, v in recent if v == verb)
        asked = mine.count(verb)
        if asked and used + asked > limit:
            code = "E052 AddQuotaExceeded" if verb == "add" else "E043 WriteQuotaExceeded"
            raise Refused(f"{code}: {asked} {verb.upper()} with {used} in the last minute "
                          f"exceeds MAX_{verb.upper()}_PER_MINUTE = {limit} for this namespace; "
                          "nothing was written, try again later")
    return recent + [[now, v] for v in mine]


def _verb(s: cal.Statement) -> str:
    return "add" if isinstance(s, cal.Add) else "supersede" if isinstance(s, cal.Supersede) \
        else "revert"


def _json(v: cal.Value) -> Any:
    if isinstance(v, tuple):
        return [_json(x) for x in v]
    return str(v) if isinstance(v, cal.Hash) else v


class _Namespace:
    """A mutable copy of one namespace's state, and the rule-8 checks on every address."""

    def __init__(self, state: Mapping[str, Any], namespace: str, now: int):
        self.grains: dict[str, Any] = dict(state["grains"])
        self.index: dict[str, dict[str, Any]] = {h: dict(e) for h, e in state["index"].items()}
        self.namespace, self.now = namespace, now

    def state(self, writes: list[list[Any]]) -> dict[str, Any]:
        return {"grains": self.grains, "index": self.index, "writes": writes}

    def resolve(self, ref: str) -> str:
        """The full address a `sha256:` literal (or unique prefix) names in this namespace."""
        digits = ref[len(_PREFIX):] if ref.startswith(_PREFIX) else ref
        found = [h for h in self.grains if h.startswith(digits)]
        if len(found) > 1:
            raise Refused(f"E015: {_PREFIX}{digits} is ambiguous in namespace "
                          f"{self.namespace!r}; give more digits")
        if not found:
            raise Refused(f"E045 NamespaceMismatch or E046 TargetNotFound: {_PREFIX}{digits} "
                          f"is no grain of namespace {self.namespace!r}; a recommendation writes "
                          "only into its own namespace (OMS rule 8)")
        return found[0]

    def is_live(self, h: str) -> bool:
        return not {"superseded_by", "system_valid_to"} & set(self.index.get(h, {}))

    def head(self, h: str) -> str:
        if not self.is_live(h):
            by = self.index[h].get("superseded_by")
            why = f"superseded by {_PREFIX}{by}" if by else \
                f"closed ({self.index[h].get('invalidation_type', 'retracted')})"
            raise Refused(f"E040 SupersessionConflict: {_PREFIX}{h} is not the head: it was "
                          f"{why}")
        return h

    def put(self, grain: dict[str, Any], supersedes: list[str]) -> str:
        try:
            h = address_of(grain)
        except canonical.CanonicalError as exc:
            raise Refused(f"the grain has no canonical form: {exc}") from None
        if h in self.grains:
            raise Refused(f"E040 SupersessionConflict: the grain {_PREFIX}{h} is stored already "
                          "(a write that changes nothing)")
        self.grains[h] = grain
        self.index[h] = {"supersedes": supersedes} if supersedes else {}
        return h

    def close(self, h: str, by: str | None, invalidation: str | None = None) -> None:
        entry = {k: v for k, v in self.index.get(h, {}).items() if k == "supersedes"}
        entry["system_valid_to"] = self.now
        if by is not None:
            entry["superseded_by"] = by
        if invalidation is not None:
            entry["invalidation_type"] = invalidation
        self.index[h] = entry

    def reopen(self, h: str) -> None:
        self.index[h] = {k: v for k, v in self.index.get(h, {}).items() if k == "supersedes"}

    def content(self, h: str) -> dict[str, Any]:
        """A grain's content without what a new version gets anew."""
        return {k: v for k, v in self.grains[h].items() if k not in ("created_at", "derived_from")}

    def new(self, content: dict[str, Any], derived: list[str]) -> dict[str, Any]:
        return {**content, "namespace": self.namespace, "created_at": self.now,
                "derived_from": derived}


def _matches(grain: Mapping[str, Any], where: cal.Pairs) -> bool:
    return all(grain.get(k) == _json(v) for k, v in where)


def execute(state: Mapping[str, Any], batch: cal.Batch, namespace: str, now: int,
            proposal_id: str) -> Outcome:
    """Apply `batch` to `namespace` at `now`, or Refused; quotas included. Pure."""
    writes = check_quota(state, batch, now)
    ns = _Namespace(state, namespace, now)
    prior: dict[str, object] = {}
    written: list[str] = []
    for i, s in enumerate(batch):
        if isinstance(s, cal.Add):
            grain = {"type": s.grain_type, **{k: _json(v) for k, v in s.sets}}
            h = ns.put(ns.new(grain, [f"mg:sha256:{proposal_id}"]), [])
            prior[str(i)] = _PREFIX + h
        elif isinstance(s, cal.Supersede):
            if isinstance(s.target, cal.Selector):
                olds = _select(ns, s.target)
            else:
                olds = [ns.head(ns.resolve(str(s.target)))]
            content = {**ns.content(olds[0]), **{k: _json(v) for k, v in s.sets}}
            h = ns.put(ns.new(content, [_PREFIX + o for o in olds]), olds)
            for old in olds:
                ns.close(old, h)
            restore: object = [_PREFIX + o for o in olds] if isinstance(
                s.target, cal.Selector) else _PREFIX + olds[0]
            prior[str(i)] = {"new": _PREFIX + h, "old": restore}
        else:
            head = ns.head(ns.resolve(str(s.target)))
            before = ns.index[head].get("supersedes")
            if not before:
                raise Refused(f"E041 NoPreviousVersion: {_PREFIX}{head} supersedes nothing, so "
                              "there is no earlier version to revert to")
            h = ns.put(ns.new(ns.content(before[0]), [_PREFIX + head]), [head])
            ns.close(head, h)
            prior[str(i)] = {"new": _PREFIX + h, "old": _PREFIX + head}
        written.append(_PREFIX + h)
    return Outcome(ns.state(writes), cal.inverse(batch, prior), written)


def _select(ns: _Namespace, sel: cal.Selector) -> list[str]:
    """The live grains `<plural> WHERE …` names, oldest first; a namespace condition other
    than the recommendation's own is a write outside it (E045)."""
    gtype = sel.grain_type[:-1]
    conds = tuple((k, v) for k, v in sel.where if k not in ("namespace", "ns"))
    for k, v in sel.where:
        if k in ("namespace", "ns") and v != ns.namespace:
            raise Refused(f"E045 NamespaceMismatch: the batch writes into namespace {v!r}, but "
                          f"the recommendation inhabits {ns.namespace!r} (OMS rule 8)")
    found = sorted((h for h, g in ns.grains.items()
                    if g.get("type") == gtype and ns.is_live(h) and _matches(g, conds)),
                   key=lambda h: (ns.grains[h]["created_at"], h))
    if not found:
        shown = " AND ".join(f"{k} = {_json(v)!r}" for k, v in sel.where)
        raise Refused(f"E046 TargetNotFound: no live {sel.grain_type} in namespace "
                      f"{ns.namespace!r} where {shown}")
    return found


# -- plans -------------------------------------------------------------------------------------


def _addresses(value: object, what: str) -> list[str]:
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(a, str) and a.startswith(_PREFIX) for a in items):
        raise Refused(f"{what} must be a sha256: address or a list of them, not {value!r}: "
                      "only a plan naming real grains can be replayed")
    return list(items)


def check_plan(plan: object) -> list[dict[str, Any]]:
    """The plan's steps, or Refused naming the first that is not replayable. Pure."""
    if not isinstance(plan, list) or not plan:
        raise Refused("cal_inverse must be a non-empty list of steps")
    for i, step in enumerate(plan):
        if not isinstance(step, dict) or step.get("op") not in ("retract", "reinstate",
                                                                "supersede"):
            raise Refused(f"cal_inverse[{i}]: op must be retract, reinstate or supersede")
        _addresses(step.get("target"), f"cal_inverse[{i}].target")
        if step["op"] != "supersede" and not isinstance(step["target"], str):
            raise Refused(f"cal_inverse[{i}]: {step['op']} names one grain")
        if step["op"] == "supersede":
            _addresses(step.get("restore_from"), f"cal_inverse[{i}].restore_from")
    return plan


def replay(state: Mapping[str, Any], plan: list[dict[str, Any]], namespace: str,
           now: int) -> Outcome:
    """Apply an inverse plan (module doc), or Refused when its grains moved. Pure.

    Not counted against the quotas: it only moves grains the namespace holds, and an undo is
    never held back by the quota that let the change in."""
    ns = _Namespace(state, namespace, now)
    inverse: list[dict[str, Any]] = []
    for i, step in enumerate(check_plan(plan)):
        targets = [ns.resolve(a) for a in _addresses(step["target"], "target")]
        if step["op"] == "retract":
            [t] = targets
            ns.close(ns.head(t), None, "retraction")
            inverse.append({"op": "reinstate", "target": _PREFIX + t})
        elif step["op"] == "reinstate":
            [t] = targets
            entry = ns.index.get(t, {})
            if entry.get("invalidation_type") != "retraction" or "superseded_by" in entry:
                raise Refused(f"cal_inverse[{i}]: {_PREFIX}{t} is not retracted, so there is "
                              "nothing to reinstate")
            ns.reopen(t)
            inverse.append({"op": "retract", "target": _PREFIX + t,
                            "invalidation_type": "retraction"})
        else:
            restores = [ns.resolve(a) for a in _addresses(step["restore_from"], "restore_from")]
            for t in targets:
                ns.head(t)
            for r in restores:
                if ns.index.get(r, {}).get("superseded_by") not in targets:
                    raise Refused(f"cal_inverse[{i}]: {_PREFIX}{r} was not superseded by "
                                  f"{step['target']}: the grains moved since, undo the later "
                                  "change first")
            for t in targets:
                ns.close(t, restores[0])
            for r in restores:
                ns.reopen(r)
            inverse.append({"op": "supersede", "target": step["restore_from"],
                            "restore_from": step["target"]})
    inverse.reverse()
    return Outcome(ns.state(list(state.get("writes", []))), inverse, [])
