"""The guards that run before any class gate (DESIGN §2, §5.1): forbidden targets and the
feedback-collapse guard. Pure functions; the daemon supplies the policy and the clock.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from improved.core.gradient import rest_of, scheme_of

# Constitution Art. VI, plus SPEC 08's user-unit path (reference/cosmix.md §1).
DEFAULT_FORBIDDEN: tuple[str, ...] = (
    "_spec/2026-04-20-00-constitution.md",
    "_doc/2026-04-20-declaration.md",
    "_spec/CHANGELOG.md",
    "src/crates/cosmix-noded/**",
    "src/crates/cosmix-indexd/**",
    "src/crates/cosmix-mcp/**",
    "/etc/systemd/system/cosmix-*.service",
    "/etc/systemd/system/cosmix-*.timer",
    "/etc/systemd/system/cosmix-*-wake.service",
    "/etc/systemd/system/cosmix-*.service.d/**",
    "/etc/systemd/system/cosmix-*.timer.d/**",
    "~/.config/systemd/user/cosmix-*.service",
    "src/Cargo.toml",
    "~/.config/cosmix/*.toml",
)

# Schemes whose rest is a path and so is checked against the forbidden list too.
PATH_SCHEMES = frozenset({"doc", "code", "config", "host", "binary", "schema", "file"})


class EscapingPath(ValueError):
    """A path that climbs above its root once normalised: it cannot be proven safe."""


def normalize_path(path: str) -> str:
    """Collapse `.`, `..` and duplicate slashes so `a/../constitution.md` cannot slip through.

    `$COSMIX/` is the repository root, so it is dropped; a path that still starts with `..`
    after normalisation escapes its root and is refused by the caller.
    """
    p = path.replace("\\", "/").strip()
    for root in ("$COSMIX/", "${COSMIX}/"):
        if p.startswith(root):
            p = p[len(root):]
    norm = posixpath.normpath(p) if p else p
    if norm == ".." or norm.startswith("../"):
        raise EscapingPath(path)
    if norm.startswith("//"):
        norm = "/" + norm.lstrip("/")
    return norm


@lru_cache(maxsize=512)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    """`**` crosses directories, `*` and `?` do not. Relative patterns match at any depth."""
    out = []
    i = 0
    if pattern.startswith("~/"):  # a home directory, however it is spelled
        out.append("(?:~|/root|/home/[^/]+)/")
        i = 2
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("/**", i) and i + 3 == len(pattern):
            out.append("(?:/.*)?")  # `dir/**` covers the directory itself too
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif ch == "*":
            out.append("[^/]*")
            i += 1
        elif ch == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(ch))
            i += 1
    body = "".join(out)
    anchored = pattern.startswith(("/", "~"))
    return re.compile(("^" if anchored else "^(?:.*/)?") + body + "$", re.DOTALL)


def forbidden_match(paths: Iterable[str], patterns: Sequence[str]) -> str | None:
    """The first path (normalised) that a forbidden pattern matches, or None.

    A path that escapes its root with `..` counts as a match: the guard fails closed.
    """
    for raw in paths:
        try:
            path = normalize_path(raw)
        except EscapingPath:
            return raw
        for pattern in patterns:
            if _glob_regex(pattern).match(path):
                return path
    return None


def on_allowlist(path: str, patterns: Sequence[str]) -> bool:
    """A path (normalised; an escaping one never is) that one of the globs names."""
    try:
        norm = normalize_path(path)
    except EscapingPath:
        return False
    return any(_glob_regex(p).match(norm) for p in patterns)


def target_paths(target_ref: str, target_files: Sequence[str] | None) -> list[str]:
    """Everything a proposal says it touches: its files, and its target when that is a path."""
    paths = list(target_files or ())
    if scheme_of(target_ref) in PATH_SCHEMES:
        paths.append(rest_of(target_ref))
    return paths


# -- feedback collapse (SPEC 09 §5, DESIGN §3.3) ------------------------------------------------

_SEQ = re.compile(r"^[0-9]+$")


def session_of(actor: str) -> str:
    """An actor id without its call sequence: `mcp:<uuid>:42` → `mcp:<uuid>`."""
    parts = actor.split(":")
    if len(parts) >= 3 and _SEQ.match(parts[-1]):
        return ":".join(parts[:-1])
    return actor


@dataclass(frozen=True, slots=True)
class Evidence:
    """What the guard needs of one signal."""

    kind: str
    actor: str
    service: str
    positive: bool
    at: int


def is_independent(
    signal: Evidence,
    origin_actor: str,
    origin_service: str,
    applied_at: int | None,
    effect_window_ms: int,
) -> bool:
    """Independent of the proposer: another session; a `world` signal must also come from
    another service and fall inside the effect window after apply."""
    if session_of(signal.actor) == session_of(origin_actor):
        return False
    if signal.kind == "world":
        if signal.service == origin_service or applied_at is None:
            return False
        return applied_at <= signal.at <= applied_at + effect_window_ms
    return True


def self_confirmed(positives: int, independent_positives: int) -> bool:
    """True when there is positive evidence and none of it is independent."""
    return positives > 0 and independent_positives == 0
