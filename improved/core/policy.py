"""The policy the pure core decides under: the `[policy]` table of the configuration.

Decoded strictly from TOML by improved.runtime.config (unknown keys and wrong types are refused
there, one line naming the key); the core only reads it. Immutable.
"""

from __future__ import annotations

import typing
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, field

from improved.core.gradient import CLASSES, FALLBACK_MIN_CLASS
from improved.core.guards import DEFAULT_FORBIDDEN

ChangeClass = Literal["L0", "L1", "L2", "L3", "L4"]
assert typing.get_args(ChangeClass) == CLASSES
Autonomy = Literal["on", "off"]
Direction = Literal["higher", "lower"]
Positive = Annotated[int, Meta(ge=1)]
Text = Annotated[str, Meta(min_length=1)]
# Every float has a lower and an upper bound, which also refuses TOML's nan and inf.
YEARS_10_S = 10 * 365 * 86400  # upper bound of every span: far beyond use, well inside int64


class Policy(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    forbidden_targets: tuple[str, ...] = DEFAULT_FORBIDDEN
    min_class: dict[str, ChangeClass] = field(default_factory=dict)
    fallback_min_class: ChangeClass = FALLBACK_MIN_CLASS
    policy_principal: Text = "policy:auto"
    effect_window_ms: Annotated[int, Meta(ge=1, le=YEARS_10_S * 1000)] = 24 * 3600 * 1000
    autonomy: Autonomy = "on"  # "off" holds every autonomous apply back (constitution IV.6)
    doc_allowlist: tuple[str, ...] = ()  # globs of the doc: targets that may be edited at all
    # relative change of a metric that counts as regression
    regression_tolerance: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.05
    metric_direction: dict[str, Direction] = field(default_factory=dict)  # metric → higher|lower
    breaker_threshold: Positive = 3  # autonomous rollbacks within the window that trip the breaker
    breaker_window_days: Annotated[float, Meta(gt=0.0, le=YEARS_10_S / 86400)] = 14.0
    breaker_pause_hours: Annotated[float, Meta(gt=0.0, le=YEARS_10_S / 3600)] = 48.0
    quorum: bool = False  # L4 may also pass on signed votes of non-correlated sessions (§5.4)
