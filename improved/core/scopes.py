"""Capability scopes of tool calls (SPEC 09 §3.1, "per-tool capability scoping"): what one call
may touch — filesystem paths, named sets, network origins — checked at every invocation,
orthogonal to the call's authority class.

A tool declares its scope (the most it may ever touch) and which of its arguments address what
(`scoped_args`: argument name → `path`, `set` or `origin`; a value is a string or a list of
strings). A runtime's policy may narrow a tool's scope, and so may a session upgrade. A call's
every addressed value must lie within every layer: a layer that leaves a kind out (None) does
not restrict it, except the tool's own scope, which must name each kind its arguments address.

- paths: globs over `/`-separated paths; `*` and `?` stay within one segment, `**` crosses
  segments, and a trailing `/**` also matches the directory itself. A value with a `..` segment
  is refused outright (`path_traversal`), whatever the globs say; empty and `.` segments are
  dropped before matching. Paths are compared as text: a symlink under an allowed path is the
  tool's to resolve.
- sets: exact names (a set UUID is a name).
- origins: `scheme://host[:port]`, compared after lower-casing and dropping the scheme's
  default port; a URL with user info (`https://good.example@evil.example/`) is refused, since
  that is how a host is hidden.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from improved.protocol.model import _In

ScopeKind = Literal["path", "set", "origin"]
SCOPE_KINDS: tuple[str, ...] = ("path", "set", "origin")
DEFAULT_PORTS = {"http": "80", "https": "443", "ws": "80", "wss": "443"}

PathGlob = Annotated[str, Meta(min_length=1, max_length=1024)]
SetName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z")]
OriginText = Annotated[str, Meta(min_length=1, max_length=512)]


class CapabilityScope(_In):
    """What calls may touch, per kind; None leaves that kind to the other layers, [] allows
    none of it."""

    paths: list[PathGlob] | None = None
    sets: list[SetName] | None = None
    origins: list[OriginText] | None = None

    def allowed(self, kind: str) -> list[str] | None:
        return {"path": self.paths, "set": self.sets, "origin": self.origins}[kind]


class ScopeRefused(Exception):
    """A call's argument outside a scope: `code` is `out_of_scope` or `path_traversal`."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


# -- paths --------------------------------------------------------------------------------------


def _segments(path: str) -> list[str]:
    return re.split(r"[/\\]", path)


def normal_path(path: str) -> str:
    """`path` without empty or `.` segments; ScopeRefused for `..`, NUL or nothing at all."""
    if "\0" in path:
        raise ScopeRefused("out_of_scope", f"{path!r} contains a NUL byte")
    if ".." in _segments(path):
        raise ScopeRefused("path_traversal", f"{path!r} climbs out with '..'")
    kept = "/".join(s for s in path.split("/") if s not in ("", "."))
    normal = ("/" if path.startswith("/") else "") + kept
    if not normal:
        raise ScopeRefused("out_of_scope", f"{path!r} names no path")
    return normal


@functools.lru_cache(maxsize=512)
def _glob(glob: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(glob):
        if glob.startswith("/**", i) and i + 3 == len(glob):
            out.append("(?:/.*)?")
            i += 3
        elif glob.startswith("/**/", i):
            out.append("/(?:.*/)?")
            i += 4
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append("[^/]*")
            i += 1
        elif glob[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return re.compile("".join(out) + r"\Z", re.S)


def path_within(path: str, globs: Sequence[str]) -> bool:
    normal = normal_path(path)
    return any(_glob(g).match(normal) for g in globs)


# -- origins ------------------------------------------------------------------------------------

_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<auth>[^/?#]*)(?P<rest>[/?#].*)?\Z",
                  re.S)
_HOST = re.compile(r"^(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9](?:[a-z0-9-]{0,61}"
                   r"[a-z0-9])?\Z|^\[[0-9a-f:.]+\]\Z")


def origin_of(url: str) -> str:
    """`scheme://host[:port]` of a URL, normalised; ScopeRefused when it names none."""
    m = _URL.match(url)
    if m is None:
        raise ScopeRefused("out_of_scope", f"{url[:100]!r} is not a URL with an origin")
    scheme, auth = m["scheme"].lower(), m["auth"].lower()
    if "@" in auth:
        raise ScopeRefused("out_of_scope", f"{url[:100]!r} carries user info before its host")
    host, port = auth, ""
    if auth.startswith("["):
        end = auth.find("]")
        host, port = auth[:end + 1], auth[end + 1:].removeprefix(":")
    elif ":" in auth:
        host, _, port = auth.rpartition(":")
    host = host.rstrip(".")
    if not _HOST.match(host) or (port and not (port.isdigit() and 0 < int(port) < 65536)):
        raise ScopeRefused("out_of_scope", f"{url[:100]!r} has no valid host and port")
    if port == DEFAULT_PORTS.get(scheme):
        port = ""
    return f"{scheme}://{host}" + (f":{port}" if port else "")


# -- checking a call ----------------------------------------------------------------------------


def check_scope(scope: CapabilityScope, what: str) -> None:
    """ValueError when a declared scope cannot be checked against: a glob with `..`, an
    allowed origin that is no origin."""
    for glob in scope.paths or ():
        if ".." in _segments(glob) or "\0" in glob:
            raise ValueError(f"{what}: path glob {glob!r} may not contain '..' or NUL")
    for origin in scope.origins or ():
        try:
            normal = origin_of(origin)
        except ScopeRefused as exc:
            raise ValueError(f"{what}: origin {origin!r}: {exc.reason}") from None
        if normal != origin.rstrip("/").lower():
            raise ValueError(f"{what}: origin {origin!r} is written {normal!r}")


def check_scoped_args(scoped_args: Mapping[str, str], scope: CapabilityScope | None,
                      what: str) -> None:
    """ValueError unless every addressed kind is declared by the tool's own scope."""
    for arg, kind in scoped_args.items():
        if kind not in SCOPE_KINDS:
            raise ValueError(f"{what}: argument {arg!r} addresses {kind!r}, not one of "
                             f"{', '.join(SCOPE_KINDS)}")
        if scope is None or scope.allowed(kind) is None:
            raise ValueError(f"{what}: argument {arg!r} addresses a {kind} but the tool "
                             f"declares no {kind}s scope")
    if scope is not None:
        check_scope(scope, what)


def _values(arg: str, kind: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ScopeRefused("out_of_scope", f"argument {arg!r} addresses a {kind}: it must be a "
                       "string or a list of strings")


def _within(kind: str, value: str, allowed: Sequence[str]) -> bool:
    if kind == "path":
        return path_within(value, allowed)
    if kind == "origin":
        return origin_of(value) in {o.rstrip("/").lower() for o in allowed}
    return value in allowed


def scope_problem(scoped_args: Mapping[str, str], args: Mapping[str, Any],
                  layers: Sequence[tuple[str, CapabilityScope | None]]) -> ScopeRefused | None:
    """Why a call's arguments leave one of the scope `layers` (label, scope), or None. The
    first layer is the tool's own and must name every kind; the others narrow it."""
    for arg, kind in scoped_args.items():
        if arg not in args:
            continue
        try:
            for value in _values(arg, kind, args[arg]):
                if kind == "path":
                    normal_path(value)  # `..` is refused whatever the globs
                for n, (label, scope) in enumerate(layers):
                    allowed = scope.allowed(kind) if scope is not None else None
                    if allowed is None and n > 0:
                        continue
                    if allowed is None or not _within(kind, value, allowed):
                        return ScopeRefused("out_of_scope", f"argument {arg!r}: {value[:200]!r} "
                                            f"is outside the {label} scope "
                                            f"({', '.join(allowed or []) or f'no {kind}s'})")
        except ScopeRefused as exc:
            return exc
    return None


def to_wire(scope: CapabilityScope | None) -> dict[str, Any] | None:
    return None if scope is None else msgspec.to_builtins(scope)
