"""The L0–L4 trust gradient (DESIGN §2): which class and scope a target admits, and which gate a
class faces. Pure functions over the policy; no I/O.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Final

from improved.protocol.model import ChangeClass, Scope

CLASSES = ("L0", "L1", "L2", "L3", "L4")
RANK = {c: i for i, c in enumerate(CLASSES)}

DEFAULT_MIN_CLASS: Mapping[str, ChangeClass] = {
    **dict.fromkeys(("cache", "rank", "score"), "L0"),
    **dict.fromkeys(("skill", "doc", "config", "host"), "L2"),
    **dict.fromkeys(("code", "binary", "schema", "secret", "topic", "lkg"), "L4"),
}
FALLBACK_MIN_CLASS: Final = "L2"

SCHEME_SCOPE: Mapping[str, Scope] = {
    **dict.fromkeys(
        ("cache", "rank", "score", "skill", "doc", "grain", "entity", "query", "template"),
        "knowledge",
    ),
    **dict.fromkeys(
        ("config", "host", "binary", "schema", "secret", "topic", "lkg"), "operation"
    ),
    "code": "code",
}
# Constitution IV.1: unclassified paths default to knowledge.
FALLBACK_SCOPE: Final = "knowledge"
# The charter is a document: a `charter` proposal must target `doc:` (and is never auto-applied).
CHARTER_SCHEMES = frozenset({"doc"})

AUTO_APPLY_CLASSES = frozenset({"L0", "L3"})

# What each class is for and the gate it faces (docs/services.md, "Classes, schemes and gates"):
# what a proposer reads to pick a class before it proposes (`improved mcp`'s classes resource).
CLASS_MEANING: Mapping[str, tuple[str, str]] = {
    "L0": ("read-only learning: scores, ranks, caches",
           "automatic: applied under the policy principal"),
    "L1": ("proposing only", "surfaced for review, never applied"),
    "L2": ("the first execution of a skill or action", "an operator's signed approval"),
    "L3": ("re-execution of a skill whose <name>:<sha256> holds a grant",
           "automatic under that exact hash; otherwise gated as L2 (no_grant)"),
    "L4": ("code-modifying or destructive",
           "an operator's signed approval per occurrence (or a signed quorum, when enabled), "
           "and a healthy last-known-good of every artefact first"),
}
assert tuple(CLASS_MEANING) == CLASSES


def scheme_of(target_ref: str) -> str:
    return target_ref.split(":", 1)[0]


def unlisted(scheme: str, configured: Mapping[str, str] | None = None) -> str | None:
    """For a scheme neither SPEC 09's tables nor the configuration list: what to say, since the
    likely mistake is the scheme (`rnk:` for `rank:`), not the class its fallback minimum then
    demands. None for a listed scheme."""
    known = sorted({*DEFAULT_MIN_CLASS, *SCHEME_SCOPE, *(configured or {})})
    if scheme in known:
        return None
    close = difflib.get_close_matches(scheme, known, n=1)
    return (f"the target scheme {scheme}: is not one SPEC 09 lists"
            + (f" (did you mean {close[0]}:?)" if close else f" (known: {', '.join(known)})"))


def rest_of(target_ref: str) -> str:
    return target_ref.split(":", 1)[1] if ":" in target_ref else ""


def floor(scheme: str) -> str:
    """SPEC 09's minimum class of a scheme: the table, else the built-in fallback. Built in:
    a configuration may raise it, never lower it (DESIGN §9, "invariants are floors")."""
    return DEFAULT_MIN_CLASS.get(scheme, FALLBACK_MIN_CLASS)


def higher(a: str, b: str) -> str:
    """The higher of two classes."""
    return a if RANK[a] >= RANK[b] else b


def min_class(scheme: str, overrides: Mapping[str, str] | None = None,
              fallback: str = FALLBACK_MIN_CLASS) -> str:
    """The configured minimum (an override, else the table, else `fallback`), never below the
    scheme's built-in floor: a lower value in a policy raises nothing and lowers nothing."""
    if overrides and scheme in overrides:
        configured = overrides[scheme]
    else:
        configured = DEFAULT_MIN_CLASS.get(scheme, fallback)
    return higher(configured, floor(scheme))


def class_fits(change_class: str, scheme: str, overrides: Mapping[str, str] | None = None,
               fallback: str = FALLBACK_MIN_CLASS) -> bool:
    """L1 fits anything (it only surfaces); L3 fits skills only; others must reach the minimum."""
    if change_class == "L1":
        return True
    if change_class == "L3":
        return scheme == "skill"
    return RANK[change_class] >= RANK[min_class(scheme, overrides, fallback)]


def implied_scope(scheme: str) -> Scope:
    return SCHEME_SCOPE.get(scheme, FALLBACK_SCOPE)


def scope_fits(scope: str, scheme: str) -> bool:
    if scope == "charter":
        return scheme in CHARTER_SCHEMES
    return scope == implied_scope(scheme)
