"""The policy the pure core decides under: the `[policy]` table of the configuration.

Decoded strictly from TOML by improved.client.config (unknown keys and wrong types are refused
there, one line naming the key); the core only reads it. Immutable.

Invariants are floors (DESIGN §9). The constitution's Art. VI list and SPEC 09's scheme minimum
classes are built in: `forbidden_targets` only *adds* patterns (`Policy.forbidden` is the
built-in list and them), and a minimum class is never below its built-in floor
(`gradient.min_class`), whatever a Policy holds. A configuration that tries to lower one, or
turns `quorum` on without naming the constitution edit that permits it, is refused at start:
`loosening` says where and why. `amendment_problem` judges the named edit, replayed from its
chain by the shell. `effective`, `digest` and `differences` describe the policy in force for
the `_policy` chain, on which the daemon records every change of it (`draft`).
"""

from __future__ import annotations

import functools
import hashlib
import re
import typing
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta, field

from improved.core import gradient
from improved.core.audit import REASON_LIMIT, Draft, draft_of
from improved.core.gradient import CLASSES, FALLBACK_MIN_CLASS
from improved.core.guards import DEFAULT_FORBIDDEN
from improved.core.record import ProposalRecord
from improved.core.trailers import PolicyInForce, body_as
from improved.protocol import canonical
from improved.protocol.model import ChangeClass, ProposalId

assert typing.get_args(ChangeClass) == CLASSES
Autonomy = Literal["on", "off"]
Direction = Literal["higher", "lower"]
Positive = Annotated[int, Meta(ge=1)]
Text = Annotated[str, Meta(min_length=1)]
# `[policy.principals]`: a namespace glob (`*`, `?`), and the principal it maps to, which must
# be a policy principal (`policy:NAME`): an auto-apply never runs under what reads as an
# operator or a service, whose capabilities an applier grants to their own acts alone
NamespaceGlob = Annotated[str, Meta(min_length=1, max_length=256,
                                    description="a namespace glob (* and ?), 1-256 characters")]
POLICY_PRINCIPAL_RE: Final = r"^policy:[A-Za-z0-9._@+-]{1,128}\Z"
PolicyPrincipal = Annotated[str, Meta(pattern=POLICY_PRINCIPAL_RE,
                                      description="a policy principal, policy:NAME (NAME of "
                                                  "letters, digits and ._@+-)")]
# Every float has a lower and an upper bound, which also refuses TOML's nan and inf.
YEARS_10_S = 10 * 365 * 86400  # upper bound of every span: far beyond use, well inside int64


DEFAULT_DOC_ALLOWLIST: tuple[str, ...] = ("docs/**", "*.md")


class Policy(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # globs forbidden *in addition to* the constitution's Art. VI list (DEFAULT_FORBIDDEN),
    # which is always in force: see `forbidden`
    forbidden_targets: tuple[str, ...] = ()
    min_class: dict[str, ChangeClass] = field(default_factory=dict)  # raised, never lowered
    fallback_min_class: ChangeClass = FALLBACK_MIN_CLASS  # likewise
    policy_principal: Text = "policy:auto"
    # `[policy.principals]`: namespace glob → the policy principal an auto-apply of a proposal
    # in that namespace runs under (OMS rule 8: "the host-configured policy principal for the
    # recommendation's namespace"); a namespace no glob matches, or none, gets policy_principal
    principals: dict[NamespaceGlob, PolicyPrincipal] = field(default_factory=dict)
    effect_window_ms: Annotated[int, Meta(ge=1, le=YEARS_10_S * 1000)] = 24 * 3600 * 1000
    autonomy: Autonomy = "on"  # "off" holds every autonomous apply back (constitution IV.6)
    # globs of the doc: targets that may be edited at all: by default the documentation
    # (OMS's headline use case), never the forbidden list, which is checked first
    doc_allowlist: tuple[str, ...] = DEFAULT_DOC_ALLOWLIST
    # relative change of a metric that counts as regression
    regression_tolerance: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.05
    metric_direction: dict[str, Direction] = field(default_factory=dict)  # metric → higher|lower
    breaker_threshold: Positive = 3  # autonomous rollbacks within the window that trip the breaker
    breaker_window_days: Annotated[float, Meta(gt=0.0, le=YEARS_10_S / 86400)] = 14.0
    breaker_pause_hours: Annotated[float, Meta(gt=0.0, le=YEARS_10_S / 3600)] = 48.0
    quorum: bool = False  # L4 may also pass on signed votes of non-correlated sessions (§5.4)
    # the approved constitution edit (charter proposal) that permits the quorum (SPEC 09 §6)
    quorum_amendment: ProposalId | None = None

    @property
    def forbidden(self) -> tuple[str, ...]:
        """The forbidden list in force: the constitution's, then the configured additions."""
        return forbidden(self.forbidden_targets)

    def principal_for(self, namespace: str | None) -> str:
        """The policy principal an auto-apply in `namespace` runs under (`principal_of`)."""
        return principal_of(self.principals, self.policy_principal, namespace)


def principal_of(principals: typing.Mapping[str, str], default: str,
                 namespace: str | None) -> str:
    """The principal of the glob in `principals` that matches `namespace`, else `default`.
    The most specific glob wins whatever the order written (the order is lost on the policy
    chain, which records the table sorted): an exact name, then the longest glob, then the
    first in sorted order. `*` is any run of characters, `?` one; the rest is literal and
    case-sensitive, as OMS namespaces are."""
    if namespace is None:
        return default
    matching = [glob for glob in principals if _namespace_glob(glob).match(namespace)]
    if not matching:
        return default
    return principals[min(matching, key=lambda g: (g != namespace, -len(g), g))]


@functools.lru_cache(maxsize=256)
def _namespace_glob(glob: str) -> re.Pattern[str]:
    body = "".join(".*" if ch == "*" else "." if ch == "?" else re.escape(ch) for ch in glob)
    return re.compile(f"^{body}\\Z", re.DOTALL)


def forbidden(additional: typing.Iterable[str]) -> tuple[str, ...]:
    """DEFAULT_FORBIDDEN followed by every other pattern of `additional`, each once."""
    out = list(DEFAULT_FORBIDDEN)
    for pattern in additional:
        if pattern not in out:
            out.append(pattern)
    return tuple(out)


# -- the floors, as a configuration is checked against them --------------------------------------

QUORUM_WORD: Final = "quorum"  # what an amendment's `amends` clause must name to permit it


def loosening(policy: Policy) -> tuple[tuple[str, ...], str] | None:
    """The first place `policy` would weaken an invariant: (its key under `[policy]`, why), or
    None. Minimum classes by scheme, then the fallback, then the quorum."""
    for scheme, cls in sorted(policy.min_class.items()):
        least = gradient.floor(scheme)
        if gradient.RANK[cls] < gradient.RANK[least]:
            return (("min_class", scheme),
                    f"{cls} is below the minimum {least} for {scheme}: targets; a "
                    "configuration may only raise it")
    if gradient.RANK[policy.fallback_min_class] < gradient.RANK[FALLBACK_MIN_CLASS]:
        return (("fallback_min_class",),
                f"{policy.fallback_min_class} is below the built-in fallback "
                f"{FALLBACK_MIN_CLASS} for schemes not listed; a configuration may only raise it")
    if policy.quorum and policy.quorum_amendment is None:
        return (("quorum",),
                "true needs policy.quorum_amendment, the id of an approved constitution edit "
                "(a charter proposal) that permits the L4 quorum (SPEC 09 §6)")
    return None


def amendment_problem(pid: str, record: ProposalRecord | None) -> str | None:
    """Why the proposal `pid` (replayed from its chain; None when it has none) does not permit
    the L4 quorum, or None: it must be a constitution edit — scope charter, L4, an `amends`
    clause that names the quorum — and approved by an operator's signed review."""
    if record is None:
        return f"{pid} has no audit chain: no such proposal"
    p = record.proposal
    if p.scope != "charter" or p.change_class != "L4" or not (p.amends or "").strip():
        return (f"{pid} is not a constitution edit (a charter proposal: scope charter, L4, with "
                "an amends clause)")
    if QUORUM_WORD not in (p.amends or "").lower():
        return f"{pid} amends {p.amends!r}, which does not name the {QUORUM_WORD}"
    if record.status != "approved" or record.approved_by is None:
        return f"{pid} is {record.status}, not approved"
    return None


# -- the policy in force, on the `_policy` chain -------------------------------------------------


def effective(policy: Policy) -> Policy:
    """The policy as the core applies it, in one normal form: `forbidden_targets` only the
    patterns the built-in list lacks (each once), every minimum at least its floor and only
    the ones that change something. Two policies the core treats alike are equal here (one
    that lists part of the built-in list, or a scheme at its own minimum, is the default)."""
    fallback = _class(gradient.higher(policy.fallback_min_class, FALLBACK_MIN_CLASS))
    raised = {scheme: _class(gradient.min_class(scheme, policy.min_class, fallback))
              for scheme in sorted(policy.min_class)}
    return msgspec.structs.replace(
        policy, forbidden_targets=policy.forbidden[len(DEFAULT_FORBIDDEN):],
        min_class={s: c for s, c in raised.items() if c != gradient.min_class(s, None, fallback)},
        fallback_min_class=fallback)


def _class(name: str) -> ChangeClass:
    assert name in CLASSES
    return typing.cast(ChangeClass, name)


def _builtins(policy: Policy) -> dict[str, Any]:
    """The effective policy as plain data; an empty `principals` left out, so a policy that
    sets none has the digest it had before the table existed (no new `_policy` trailer)."""
    data: dict[str, Any] = msgspec.to_builtins(effective(policy))
    if not data.get("principals"):
        data.pop("principals", None)
    return data


def digest(policy: Policy) -> str:
    """SHA-256 of the canonical MessagePack of the effective policy."""
    return canonical.digest(_builtins(policy))


def differences(policy: Policy) -> dict[str, Any]:
    """Each key whose effective value differs from the default's, with that value."""
    mine = _builtins(policy)
    default = _builtins(Policy())
    return {name: value for name, value in mine.items() if default.get(name) != value}


POLICY_ID: Final = hashlib.sha256(b"improved policy").hexdigest()  # the one `_policy` chain


def recorded_digest(body: dict[str, Any] | None) -> str | None:
    """The policy digest a trailer of the `_policy` chain records (None for an empty chain)."""
    if not body:
        return None
    return body_as(PolicyInForce, body).digest


def draft(policy: Policy, actor: str) -> Draft:
    """The trailer recording `policy` as in force: refs `digest:` and `<key>:<JSON value>` for
    each key that differs from the default."""
    changed = differences(policy)
    what = ("differs from the defaults in " + ", ".join(changed)) if changed else \
        "the defaults"
    return draft_of(PolicyInForce(digest=digest(policy), changed=changed), "learn-back", actor,
                    "rec:system",
                    f"effective policy {digest(policy)[:12]}: {what}"[:REASON_LIMIT])
