"""The guards that run before any class gate (DESIGN §2, §5.1): forbidden targets and the
feedback-collapse guard. Pure functions; the daemon supplies the policy and the clock.
"""

from __future__ import annotations

import posixpath
import re
import unicodedata
from collections.abc import Iterable, Sequence
from functools import lru_cache

from improved.core.gradient import rest_of
from improved.protocol.model import Proposal

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

class EscapingPath(ValueError):
    """A path that climbs above its root once normalised: it cannot be proven safe."""


class UncanonicalPath(ValueError):
    """A path with no single canonical form (a control character, an encoding that does not
    settle or does not decode): refused, never passed."""


DECODE_ROUNDS = 4  # percent-decoding rounds before an encoding that keeps changing is refused
_PERCENT = re.compile(rb"%([0-9A-Fa-f]{2})")
_HOME = re.compile(r"^(?:\$HOME|\$\{HOME\}|~[a-z_][a-z0-9_.-]*|/root|/home/[^/]+)(?=/|$)")
_HOST = re.compile(r"^(?:file://[^/]*|[A-Za-z0-9][A-Za-z0-9.-]*:(?=/))")  # file://h, h:/path


def _percent_decoded(path: str) -> str:
    """Percent-decode until stable; the bytes must be UTF-8."""
    for _ in range(DECODE_ROUNDS):
        raw = _PERCENT.sub(lambda m: bytes([int(m.group(1), 16)]), path.encode("utf-8"))
        try:
            decoded = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise UncanonicalPath(f"{path!r}: percent-encoding that is not UTF-8") from None
        if decoded == path:
            return path
        path = decoded
    raise UncanonicalPath(f"{path!r}: percent-encoding that does not settle")


def canonical_path(path: str) -> str:
    """The one form a path is compared in, so no spelling of a forbidden path slips through:
    percent-decoded until stable, Unicode NFKC, backslashes as slashes, `$COSMIX/` (the
    repository root) dropped, a host prefix (`file://host`, `host:/path`) dropped and a home
    prefix (`$HOME`, `~user`, `/root`, `/home/user`) spelled `~`, `.`/`..`/`//` collapsed, and
    case-folded. A control or format character (NUL, a newline, a zero-width joiner) has no
    canonical form: UncanonicalPath. A path that climbs above its root: EscapingPath."""
    p = unicodedata.normalize("NFKC", _percent_decoded(path))
    if any(unicodedata.category(ch)[0] == "C" for ch in p):
        raise UncanonicalPath(f"{path!r}: a control or format character")
    p = p.replace("\\", "/").strip()
    for root in ("$COSMIX/", "${COSMIX}/"):
        if p.startswith(root):
            p = p[len(root):]
    p = _HOME.sub("~", _HOST.sub("", p, count=1), count=1)
    norm = posixpath.normpath(p) if p else p
    if norm == ".." or norm.startswith("../"):
        raise EscapingPath(path)
    if norm.startswith("//"):
        norm = "/" + norm.lstrip("/")
    return norm.casefold()


@lru_cache(maxsize=512)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    """`**` crosses directories, `*` and `?` do not. Relative patterns match at any depth."""
    pattern = unicodedata.normalize("NFKC", pattern).casefold()
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
    """The first path (in canonical form) that a forbidden pattern matches, or None.

    A path that escapes its root, or has no canonical form, counts as a match: the guard fails
    closed.
    """
    for raw in paths:
        try:
            path = canonical_path(raw)
        except (EscapingPath, UncanonicalPath):
            return raw
        for pattern in patterns:
            if _glob_regex(pattern).match(path):
                return path
    return None


def on_allowlist(path: str, patterns: Sequence[str]) -> bool:
    """A path (in canonical form; an escaping or uncanonical one never is) that one of the
    globs names."""
    try:
        norm = canonical_path(path)
    except (EscapingPath, UncanonicalPath):
        return False
    return any(_glob_regex(p).match(norm) for p in patterns)


def uncanonical(paths: Iterable[str]) -> str | None:
    """Why the first path with no canonical form has none, or None (an escaping path has one:
    it is refused as a forbidden target instead)."""
    for raw in paths:
        try:
            canonical_path(raw)
        except UncanonicalPath as exc:
            return str(exc)
        except EscapingPath:
            continue
    return None


_DIFF_PATH = re.compile(r"^(?:--- |\+\+\+ |rename from |rename to |copy from |copy to )(.+?)(?:\t.*)?$")
_GIT_HEADER = re.compile(r"^diff --git (\S+) (\S+)$")


def diff_paths(diff: str) -> list[str]:
    """Every path a unified (or git) diff names: old and new sides, renames and copies."""
    out: list[str] = []
    for line in diff.splitlines():
        named = _DIFF_PATH.match(line)
        pair = _GIT_HEADER.match(line)
        found = [named.group(1)] if named else list(pair.groups()) if pair else []
        for path in found:
            if path != "/dev/null":
                out.append(path[2:] if path[:2] in ("a/", "b/") else path)
    return out


def touched_paths(proposal: Proposal) -> list[str]:
    """Every path a change touches: its declared files, its target's rest (whatever the
    scheme), the files its `proposal_edit` diff names, and every `lkg` artefact."""
    paths = list(proposal.target_files or ())
    paths.append(rest_of(proposal.target_ref))
    if proposal.proposal_edit is not None:
        paths += diff_paths(proposal.proposal_edit.diff)
    for entry in proposal.lkg or ():
        if isinstance(entry, dict) and isinstance(entry.get("artefact"), str):
            paths.append(entry["artefact"])
    return paths


# -- feedback collapse (SPEC 09 §5, DESIGN §3.3) ------------------------------------------------

_SEQ = re.compile(r"^[0-9]+\Z")


def session_of(actor: str) -> str:
    """An actor id without its call sequence: `mcp:<uuid>:42` → `mcp:<uuid>`."""
    parts = actor.split(":")
    if len(parts) >= 3 and _SEQ.match(parts[-1]):
        return ":".join(parts[:-1])
    return actor


def self_confirmed(positives: int, independent_positives: int) -> bool:
    """True when there is positive evidence and none of it is independent."""
    return positives > 0 and independent_positives == 0
