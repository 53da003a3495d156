"""Configuration: one TOML file (`--config` or `IMPROVED_CONFIG`), every key optional.

```toml
nats_url = "nats://127.0.0.1:4222"   # omit to start an embedded nats-server
data_dir = ".improved"
port = 4222                          # embedded server port
sync = "always"                      # embedded server fsync: "always" or a duration ("2m")
max_message_bytes = 262144
replicas = 1                         # JetStream replicas of every stream (3 on a cluster)
records_storage = "file"             # retained records: "file", or "memory" as ABP kept them
                                     # (rebuilt from the chains after a broker restart)
metrics_port = 9464                  # Prometheus /metrics, /healthz, /readyz (default: off)
metrics_host = "127.0.0.1"
checkpoint_interval_s = 300          # sign a checkpoint over the whole audit log this often
checkpoint_key = "/etc/improved/checkpoint.pem"   # default: <data_dir>/checkpoint.pem

[policy]
forbidden_targets = ["..."]          # globs; default: the constitution's Art. VI list
min_class = { grain = "L2" }         # per-scheme minimum class overrides
fallback_min_class = "L2"            # for schemes not listed anywhere
policy_principal = "policy:auto"     # authority of auto-applies (L0, L3 with grant)
effect_window_ms = 86400000          # a world signal counts if it lands this soon after apply
autonomy = "on"                      # "off": no autonomous apply (constitution IV.6)
doc_allowlist = ["docs/**", "*.md"]  # doc: targets that may be edited (default: none)
regression_tolerance = 0.05          # at review_after, a metric worse by more than 5 % ...
metric_direction = { error_rate = "lower" }  # ... regressed (default: higher is better)
breaker_threshold = 3                # autonomous rollbacks within the window that trip ...
breaker_window_days = 14             # ... the circuit breaker (constitution IV.5), which
breaker_pause_hours = 48             # pauses autonomous applies this long
quorum = false                       # L4 may pass on 3 signed votes of non-correlated sessions

[trust]                              # keys whose signed acts count, bound to their principal
operators = { "operator:alice" = "<base64 of the raw 32-byte Ed25519 public key>" }
act_max_age_s = 86400                # a signed act older than this (by its `at`) is refused
quorum = { "agent-a" = "<base64 public key>" }   # voters whose signed votes count (policy.quorum)

[apply]
timeout_s = 5.0                      # one ApplyOrder request
attempts = 3                         # requests per delivery before backing off
max_deliveries = 8                   # redeliveries (with backoff) before giving up for now
```
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from improved.core.gradient import CLASSES, FALLBACK_MIN_CLASS
from improved.core.guards import DEFAULT_FORBIDDEN
from improved.core.signing import TrustStore


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Policy:
    forbidden_targets: tuple[str, ...] = DEFAULT_FORBIDDEN
    min_class: dict[str, str] = field(default_factory=dict)
    fallback_min_class: str = FALLBACK_MIN_CLASS
    policy_principal: str = "policy:auto"
    effect_window_ms: int = 24 * 3600 * 1000
    autonomy: str = "on"  # "off" holds every autonomous apply back (constitution IV.6)
    doc_allowlist: tuple[str, ...] = ()  # globs of the doc: targets that may be edited at all
    regression_tolerance: float = 0.05  # relative change of a metric that counts as regression
    metric_direction: dict[str, str] = field(default_factory=dict)  # metric → higher|lower
    breaker_threshold: int = 3  # autonomous rollbacks within the window that trip the breaker
    breaker_window_days: float = 14.0
    breaker_pause_hours: float = 48.0
    quorum: bool = False  # L4 may also pass on signed votes of non-correlated sessions (§5.4)


@dataclass(frozen=True)
class ApplySettings:
    timeout_s: float = 5.0
    attempts: int = 3
    max_deliveries: int = 8


@dataclass(frozen=True)
class Trust:
    operators: dict[str, str] = field(default_factory=dict)
    act_max_age_s: float = 24 * 3600.0
    quorum: dict[str, str] = field(default_factory=dict)  # voter principal → public key

    def store(self) -> TrustStore:
        return TrustStore.from_config(self.operators)

    def voters(self) -> TrustStore:
        """The keys whose quorum votes count; each bound to one voter identity."""
        return TrustStore.from_config(self.quorum)


@dataclass(frozen=True)
class Config:
    nats_url: str | None = None
    data_dir: Path = Path(".improved")
    port: int = 4222
    sync: str = "always"
    max_message_bytes: int = 256 * 1024
    replicas: int = 1
    records_storage: str = "file"
    metrics_port: int | None = None  # Prometheus /metrics, /healthz, /readyz (off when unset)
    checkpoint_interval_s: float = 300.0  # 0: no periodic checkpoint (one at start and stop)
    checkpoint_key: Path | None = None  # default: <data_dir>/checkpoint.pem, made on first use
    metrics_host: str = "127.0.0.1"
    policy: Policy = field(default_factory=Policy)
    apply: ApplySettings = field(default_factory=ApplySettings)
    trust: Trust = field(default_factory=Trust)


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    return value


def _check_class(name: str, value: object) -> str:
    if value not in CLASSES:
        raise ConfigError(f"{name}: expected one of {', '.join(CLASSES)}, got {value!r}")
    return str(value)


def parse(doc: dict) -> Config:
    known = {"nats_url", "data_dir", "port", "sync", "max_message_bytes", "policy", "apply",
             "trust", "replicas", "records_storage", "metrics_port", "metrics_host",
             "checkpoint_interval_s", "checkpoint_key"}
    unknown = set(doc) - known
    if unknown:
        raise ConfigError(f"unknown configuration keys: {', '.join(sorted(unknown))}")
    pol = dict(doc.get("policy", {}))
    min_class = {k: _check_class(f"policy.min_class.{k}", v)
                 for k, v in dict(pol.pop("min_class", {})).items()}
    policy = Policy(
        forbidden_targets=tuple(pol.pop("forbidden_targets", DEFAULT_FORBIDDEN)),
        min_class=min_class,
        fallback_min_class=_check_class(
            "policy.fallback_min_class", pol.pop("fallback_min_class", FALLBACK_MIN_CLASS)),
        policy_principal=str(pol.pop("policy_principal", "policy:auto")),
        effect_window_ms=int(pol.pop("effect_window_ms", 24 * 3600 * 1000)),
        autonomy=str(pol.pop("autonomy", "on")),
        doc_allowlist=tuple(pol.pop("doc_allowlist", ())),
        regression_tolerance=float(pol.pop("regression_tolerance", 0.05)),
        metric_direction={str(k): str(v) for k, v in
                          dict(pol.pop("metric_direction", {})).items()},
        breaker_threshold=int(pol.pop("breaker_threshold", 3)),
        breaker_window_days=float(pol.pop("breaker_window_days", 14.0)),
        breaker_pause_hours=float(pol.pop("breaker_pause_hours", 48.0)),
        quorum=_check_bool("policy.quorum", pol.pop("quorum", False)),
    )
    if policy.autonomy not in ("on", "off"):
        raise ConfigError(f"policy.autonomy: expected on or off, got {policy.autonomy!r}")
    if pol:
        raise ConfigError(f"unknown policy keys: {', '.join(sorted(pol))}")
    ap = dict(doc.get("apply", {}))
    apply = ApplySettings(
        timeout_s=float(ap.pop("timeout_s", 5.0)),
        attempts=int(ap.pop("attempts", 3)),
        max_deliveries=int(ap.pop("max_deliveries", 8)),
    )
    if ap:
        raise ConfigError(f"unknown apply keys: {', '.join(sorted(ap))}")
    tr = dict(doc.get("trust", {}))
    trust = Trust(operators={str(k): str(v) for k, v in dict(tr.pop("operators", {})).items()},
                  act_max_age_s=float(tr.pop("act_max_age_s", 24 * 3600.0)),
                  quorum={str(k): str(v) for k, v in dict(tr.pop("quorum", {})).items()})
    if tr:
        raise ConfigError(f"unknown trust keys: {', '.join(sorted(tr))}")
    for name, load in (("operators", trust.store), ("quorum", trust.voters)):
        try:
            load()
        except ValueError as exc:
            raise ConfigError(f"trust.{name}: {exc}") from None
    records_storage = str(doc.get("records_storage", "file"))
    if records_storage not in ("file", "memory"):
        raise ConfigError(f"records_storage: expected file or memory, got {records_storage!r}")
    replicas = int(doc.get("replicas", 1))
    if replicas not in (1, 3, 5):
        raise ConfigError(f"replicas: expected 1, 3 or 5, got {replicas}")
    return Config(
        nats_url=doc.get("nats_url"),
        replicas=replicas,
        records_storage=records_storage,
        metrics_port=int(doc["metrics_port"]) if "metrics_port" in doc else None,
        metrics_host=str(doc.get("metrics_host", "127.0.0.1")),
        checkpoint_interval_s=float(doc.get("checkpoint_interval_s", 300.0)),
        checkpoint_key=Path(doc["checkpoint_key"]) if "checkpoint_key" in doc else None,
        data_dir=Path(doc.get("data_dir", ".improved")),
        port=int(doc.get("port", 4222)),
        sync=str(doc.get("sync", "always")),
        max_message_bytes=int(doc.get("max_message_bytes", 256 * 1024)),
        policy=policy,
        apply=apply,
        trust=trust,
    )


def load(path: str | os.PathLike | None = None) -> Config:
    """Read the TOML file named by `path` or `IMPROVED_CONFIG`; defaults when neither is set."""
    path = path or os.environ.get("IMPROVED_CONFIG")
    if not path:
        return Config()
    try:
        with open(path, "rb") as fh:
            return parse(tomllib.load(fh))
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
