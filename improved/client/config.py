"""Configuration: one TOML file (`--config` or `IMPROVED_CONFIG`), every key optional.

Decoded by msgspec into the frozen Structs below, as strictly as the wire: an unknown key, a
value of the wrong type (no coercion: `"5"` is not a number, a string is not a list) or out of
range is refused with a ConfigError of one line naming the key, e.g.
`config error: policy.forbidden_targets: expected array, got str`.

One file, one schema, read by the daemon and by every command (where the bus is, its
credentials, the data directory, the trust store, the policy a chain is replayed under): so it
lives in the client, beside the `[nats]` settings (`client.connection`), and a command refuses
a mistyped key exactly as the daemon would. The daemon's own settings (`[apply]`, the embedded
server, checkpoints, metrics) are part of that one schema; only the daemon acts on them.

Invariants are floors (DESIGN §9; improved.core.policy): the configuration can tighten them,
never loosen them. `forbidden_targets` lists patterns forbidden *in addition to* the
constitution's Art. VI list, which is built in (listing some of its patterns, or none, removes
nothing). `min_class` and `fallback_min_class` may raise SPEC 09's minimum classes; a lower
value is refused, e.g. `config error: policy.min_class.binary: L0 is below the minimum L4 for
binary: targets; a configuration may only raise it`. `quorum = true` needs `quorum_amendment`,
the id of an approved constitution edit (a charter proposal whose `amends` names the quorum);
the daemon checks it on the proposal's audit chain when it starts and refuses to start
otherwise. The daemon records the effective policy on the `_policy` audit chain whenever it
starts with a policy that differs from the last one recorded.

```toml
nats_url = "nats://127.0.0.1:4222"   # omit to start an embedded nats-server; IMPROVED_NATS_URL
                                     # wins over it
data_dir = "/var/lib/improved"    # where the embedded server, the checkpoint key and the
                                     # kept checkpoint live; relative: to this file's directory.
                                     # --data-dir, then IMPROVED_DATA_DIR, win over it; the
                                     # default is $XDG_STATE_HOME/improved (~/.local/state/improved)
port = 4222                          # embedded server port
sync = "always"                      # embedded server fsync: "always" or a duration ("2m")
accounts = false                     # embedded server: true gives it deploy/accounts.conf's
                                     # users and permissions (`improved run --accounts`)
max_message_bytes = 262144
replicas = 1                         # JetStream replicas of every stream (3 on a cluster)
records_storage = "memory"           # retained records: "memory" (as ABP kept them: not
                                     # fsync'd; refilled from the chains after the last sealed
                                     # epoch when a broker restart loses them), or "file"
records_ttl_days = 30                # a closed proposal's retained records and dedup key
                                     # leave this long after their last publish (0: kept for
                                     # good); chains and the rejection ledger stay
metrics_port = 9464                  # Prometheus /metrics, /healthz, /readyz (default: off)
metrics_host = "127.0.0.1"
checkpoint_interval_s = 300          # sign a checkpoint over the whole audit log this often
checkpoint_key = "/etc/improved/checkpoint.pem"   # default: <data_dir>/checkpoint.pem

[nats]                               # credentials, each in a file read at start (one kind):
user = "improved"                    # a user and password_file, or token_file, or creds_file
password_file = "/etc/improved/nats-password"   # (a NATS .creds file); TLS: tls_ca, tls_cert
                                     # and tls_key. IMPROVED_NATS_USER, _PASSWORD_FILE,
                                     # _TOKEN_FILE, _CREDS_FILE, _TLS_CA, _TLS_CERT, _TLS_KEY
                                     # win over these; a user:password in nats_url still works

[policy]
forbidden_targets = ["deploy/secrets/**"]   # globs forbidden besides the constitution's Art. VI
                                     # list, which always applies (default: none added)
min_class = { config = "L4" }        # per-scheme minimum classes, raised above SPEC 09's
fallback_min_class = "L2"            # for schemes not listed anywhere (at least L2)
policy_principal = "policy:auto"     # authority of auto-applies (L0, L3 with grant)
effect_window_ms = 86400000          # a world signal counts if it lands this soon after apply
autonomy = "on"                      # "off": no autonomous apply (constitution IV.6)
doc_allowlist = ["docs/**", "*.md"]  # doc: targets that may be edited (this is the default)
regression_tolerance = 0.05          # at review_after, a metric worse by more than 5 % ...
metric_direction = { error_rate = "lower" }  # ... regressed (default: higher is better)
breaker_threshold = 3                # autonomous rollbacks within the window that trip ...
breaker_window_days = 14             # ... the circuit breaker (constitution IV.5), which
breaker_pause_hours = 48             # pauses autonomous applies this long
quorum = false                       # L4 may pass on 3 signed votes of non-correlated sessions;
# quorum_amendment = "<64 hex>"      # true needs this: an approved charter proposal's id

[policy.principals]                  # namespace glob (* and ?) → the policy principal an
"kb:*" = "policy:kb"                 # auto-apply of a proposal in that namespace runs under
                                     # (policy:NAME; an exact name, then the longest glob wins);
                                     # a namespace none matches, or none: policy_principal

[audit]                              # epochs of the audit log (docs/protocol.md, Epochs)
epoch_trailers = 1000000             # seal an epoch when it holds this many trailers ...
epoch_hours = 168                    # ... or is this old (then `improved audit archive`)
retention_days = 30                  # an applied change's chain stays this long at least

[trust]                              # keys whose signed acts count, bound to their principal
operators = { "operator:alice" = "<base64 of the raw 32-byte Ed25519 public key>" }
act_max_age_s = 86400                # a signed act older than this (by its `at`) is refused
quorum = { "agent-a" = "<base64 public key>" }   # voters whose signed votes count (policy.quorum)
daemons = { "improved:b" = "<base64 public key>" }  # daemon checkpoint keys trusted besides
                                     # this daemon's own (its replicas'; an old key after a
                                     # rotation); a checkpoint signed by any other key is a
                                     # break; shared keys need no entry

[apply]
timeout_s = 5.0                      # one ApplyOrder request
attempts = 3                         # requests per delivery before backing off
max_deliveries = 8                   # redeliveries (with backoff) before the slow retry
retry_max_s = 300.0                  # the slow retry's longest wait between two tries

[telemetry]                          # OpenTelemetry traces (the `otel` extra): off unless an
endpoint = "http://127.0.0.1:4318"   # endpoint is set here or by OTEL_EXPORTER_OTLP_ENDPOINT;
protocol = "http/protobuf"           # or "grpc" (OTEL_EXPORTER_OTLP_PROTOCOL)
service_name = "improved"            # the resource's service.name (OTEL_SERVICE_NAME)
sampler = "parentbased_always_on"    # OTEL_TRACES_SAMPLER's names; traceidratio ones take
sampler_arg = 1.0                    # their ratio here (OTEL_TRACES_SAMPLER_ARG). Every OTEL_*
                                     # variable wins over its key; OTEL_SDK_DISABLED=true and
                                     # OTEL_TRACES_EXPORTER=none turn traces off
```
"""

import base64
import binascii
import difflib
import json
import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, field

from improved.client.connection import ConfigError, NatsSettings, check_nats, nats_from_env
from improved.core.identity import IDENTITY_RE
from improved.core.policy import YEARS_10_S as _YEARS_10_S
from improved.core.policy import Policy, Positive, Text, loosening
from improved.core.signing import TrustStore
from improved.protocol import subjects as S

# Enumerated values, and ranges. A Meta's description is what an error says was expected.
RecordsStorage = Literal["file", "memory"]
# retained records are outputs rebuilt from the fsync'd chains (`Upkeep.republish_if_lost`),
# so by default they take no fsync of their own; "file" keeps them across a broker restart
RECORDS_STORAGE: RecordsStorage = "memory"
Replicas = Literal[1, 3, 5]
Port = Annotated[int, Meta(ge=1, le=65535)]
# nats-server's jetstream sync_interval: "always", or a Go duration such as "2m" or "1h30m"
Sync = Annotated[str, Meta(pattern=r"^(always|0|([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+)\Z",
                           description='"always" or a duration such as "2m"')]


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A table of the file: immutable and strict about its keys. Each one is also built by
    keyword only (`kw_only` is per class in msgspec, not inherited)."""


class ApplySettings(_Section, frozen=True, kw_only=True):
    timeout_s: Annotated[float, Meta(gt=0.0, le=86400.0)] = 5.0
    attempts: Positive = 3
    max_deliveries: Positive = 8
    # a given-up apply is tried again after a minute, doubling up to this (runtime/daemon.py)
    retry_max_s: Annotated[float, Meta(gt=0.0, le=86400.0)] = 300.0


class Trust(_Section, frozen=True, kw_only=True):
    operators: dict[str, str] = field(default_factory=dict)
    act_max_age_s: Annotated[float, Meta(gt=0.0, le=float(_YEARS_10_S))] = 24 * 3600.0
    quorum: dict[str, str] = field(default_factory=dict)  # voter principal → public key
    daemons: dict[str, str] = field(default_factory=dict)  # daemon → checkpoint public key
    # identities whose signed signals count (core/identity.py): `agent:<svc>:<name>`,
    # `check:<name>`, `service:<svc>` → public key
    signers: dict[str, str] = field(default_factory=dict)
    # the deployment's NATS permissions bind each service to its own subjects (as
    # deploy/accounts.conf does): then a subject `<svc>` proves the identity `service:<svc>`
    subjects_bound: bool = False
    # `[trust.runtimes]`: tool runtime name → the Ed25519 public key that signs its `_tools`
    # chain (IMPROVE_TOOLS_AUDIT). Only `improved audit verify` reads it; a daemon never does
    runtimes: dict[str, str] = field(default_factory=dict)

    def store(self) -> TrustStore:
        return TrustStore.from_config(self.operators)

    def voters(self) -> TrustStore:
        """The keys whose quorum votes count; each bound to one voter identity."""
        return TrustStore.from_config(self.quorum)

    def signer_store(self) -> TrustStore:
        return TrustStore.from_config(self.signers)

    def runtime_store(self) -> TrustStore:
        """The tool runtimes' keys, each bound to its runtime's name."""
        return TrustStore.from_config(self.runtimes)

    def daemon_keyids(self) -> set[str]:
        """The key ids of the daemon checkpoint keys trusted besides a daemon's own."""
        return set(TrustStore.from_config(self.daemons).keys)


class AuditSettings(_Section, frozen=True, kw_only=True):
    """`[audit]`: when the daemon seals an epoch of the audit log (`core.epochs`), and how
    long an applied change stays in the hot log before its chain may be archived."""

    epoch_trailers: Positive = 1_000_000  # seal when the epoch holds this many trailers ...
    epoch_hours: Annotated[float, Meta(gt=0.0, le=24.0 * 3660)] = 168.0  # ... or is this old
    retention_days: Annotated[float, Meta(ge=0.0, le=3660.0)] = 30.0


Sampler = Literal["always_on", "always_off", "traceidratio", "parentbased_always_on",
                  "parentbased_always_off", "parentbased_traceidratio"]
OtlpProtocol = Literal["http/protobuf", "grpc"]


class TelemetrySettings(_Section, frozen=True, kw_only=True):
    """`[telemetry]`: where the daemon's traces go (runtime/telemetry.py). No endpoint (and no
    OTEL_* variable asking for traces): none are made, and nothing of OpenTelemetry is loaded."""

    endpoint: Text | None = None  # the OTLP base endpoint, as OTEL_EXPORTER_OTLP_ENDPOINT
    protocol: OtlpProtocol = "http/protobuf"
    service_name: Text = "improved"
    sampler: Sampler = "parentbased_always_on"
    sampler_arg: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0


class Config(_Section, frozen=True, kw_only=True):
    nats_url: Text | None = None
    nats: NatsSettings = field(default_factory=NatsSettings)
    data_dir: Path = field(default_factory=lambda: state_dir())
    port: Port = 4222
    sync: Sync = "always"
    # the embedded server with deploy/accounts.conf's users and permissions (runtime/accounts.py)
    accounts: bool = False
    max_message_bytes: Annotated[int, Meta(ge=1, le=64 * 1024 * 1024)] = 256 * 1024
    replicas: Replicas = 1
    records_storage: RecordsStorage = RECORDS_STORAGE
    # how long a closed proposal's retained records and dedup key stay (Nats-TTL); 0 keeps
    # them for good
    records_ttl_days: Annotated[float, Meta(ge=0.0, le=3660.0)] = 30.0
    metrics_port: Port | None = None  # Prometheus /metrics, /healthz, /readyz (off when unset)
    # 0: no periodic checkpoint (one at start and stop)
    checkpoint_interval_s: Annotated[float, Meta(ge=0.0, le=float(_YEARS_10_S))] = 300.0
    checkpoint_key: Path | None = None  # default: <data_dir>/checkpoint.pem, made on first use
    metrics_host: Text = "127.0.0.1"
    policy: Policy = field(default_factory=Policy)
    apply: ApplySettings = field(default_factory=ApplySettings)
    trust: Trust = field(default_factory=Trust)
    audit: AuditSettings = field(default_factory=AuditSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)


def _dec_hook(typ: type, obj: Any) -> Any:
    if typ is Path:
        if isinstance(obj, str) and obj:
            return Path(obj)
        raise ValueError(f"expected a path, got {_got(obj)}")
    raise NotImplementedError(typ)


def parse(doc: object) -> Config:
    """The Config a decoded TOML document describes, or ConfigError naming the first bad key."""
    if isinstance(doc, dict) and isinstance(doc.get("nats"), str):  # the URL, misnamed
        raise ConfigError("config error: nats: expected table (user, password_file, "
                          "token_file, creds_file, tls_*), got str (did you mean nats_url?)")
    try:
        config = msgspec.convert(doc, Config, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        try:
            why = _explain(str(exc), doc)
        except (LookupError, StopIteration, TypeError, AttributeError):  # not from TOML
            why = " ".join(str(exc).split())
        raise ConfigError(f"config error: {why}") from None
    for name in ("operators", "quorum", "daemons", "signers", "runtimes"):
        for principal, key in getattr(config.trust, name).items():
            _check_key(("trust", name, principal), key)
    for principal in config.trust.operators:
        if not principal.startswith("operator:") or not IDENTITY_RE.match(principal):
            raise ConfigError(f"config error: {_dotted(('trust', 'operators', principal))}: an "
                              "operator is named operator:NAME, as `improved keys new "
                              "--principal operator:NAME` prints the entry; an act signed "
                              "under any other name is refused")
    for principal in config.trust.signers:
        if not IDENTITY_RE.match(principal) or principal.startswith("operator:"):
            raise ConfigError(f"config error: trust.signers.{principal}: not an identity "
                              "(`agent:<svc>:<name>`, `check:<name>` or `service:<svc>`)")
    for runtime in config.trust.runtimes:
        if not S.SERVICE_RE.match(runtime):
            raise ConfigError(f"config error: {_dotted(('trust', 'runtimes', runtime))}: not a "
                              f"tool runtime's name (it matches {S.SERVICE_RE.pattern}, as "
                              "`<runtime>.tools.call` does)")
    loose = loosening(config.policy)
    if loose is not None:
        where, why = loose
        raise ConfigError(f"config error: {_dotted(('policy', *where))}: {why}")
    check_nats(config.nats)
    return config


URL_ENV = "IMPROVED_NATS_URL"  # the server every command and the daemon use, over nats_url
DATA_DIR_ENV = "IMPROVED_DATA_DIR"  # the data directory, over the config's data_dir


def state_dir(environ: typing.Mapping[str, str] | None = None) -> Path:
    """The per-user default data directory, `$XDG_STATE_HOME/improved` (else
    `~/.local/state/improved`): one place per user, whatever the working directory, so a
    command run anywhere finds the daemon it started and never a stray `.improved/`."""
    environ = os.environ if environ is None else environ
    state = environ.get("XDG_STATE_HOME")
    if state and Path(state).is_absolute():  # the XDG spec ignores a relative one
        return Path(state) / "improved"
    home = environ.get("HOME")
    return (Path(home) if home else Path.home()) / ".local" / "state" / "improved"


def with_env(config: Config, environ: typing.Mapping[str, str] | None = None) -> Config:
    """`config` with what the environment sets in place of the file's: the server
    (`IMPROVED_NATS_URL` for `nats_url`), the data directory (`IMPROVED_DATA_DIR` for
    `data_dir`) and the `[nats]` keys (NATS_ENV); ConfigError naming the variable when its
    value is not one."""
    environ = os.environ if environ is None else environ
    url = environ.get(URL_ENV)
    if url:
        config = msgspec.structs.replace(config, nats_url=url)
    data_dir = environ.get(DATA_DIR_ENV)
    if data_dir:
        config = msgspec.structs.replace(config, data_dir=Path(data_dir).expanduser())
    settings = nats_from_env(config.nats, environ)
    return config if settings is config.nats else msgspec.structs.replace(config, nats=settings)


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Read the TOML file named by `path` or `IMPROVED_CONFIG` (defaults when neither is set),
    with what the environment sets over the file's (`with_env`). The data directory is
    `IMPROVED_DATA_DIR`, else the file's `data_dir` (a relative one taken from the file's
    directory, not from wherever the command runs), else `state_dir()`; `--data-dir` is the
    command line's, over all of them (`cli.common.config_of`)."""
    path = path or os.environ.get("IMPROVED_CONFIG")
    if not path:
        return with_env(Config())
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from exc
    config = parse(doc)
    if isinstance(doc, dict) and "data_dir" in doc:
        config = msgspec.structs.replace(
            config, data_dir=Path(path).parent / config.data_dir.expanduser())
    return with_env(config)


# -- one line naming the key ---------------------------------------------------------------------


def _check_key(path: tuple[str, ...], key: str) -> None:
    """A trusted key is the base64 of a raw 32-byte Ed25519 public key (`improved keys new`)."""
    try:
        raw = base64.b64decode(key, validate=True)
        if len(raw) == 32:
            TrustStore.from_config({path[-1]: key})
            return
    except (binascii.Error, ValueError):
        pass
    raise ConfigError(f"config error: {_dotted(path)}: expected the base64 of a raw 32-byte "
                      f"Ed25519 public key, got {_got(key)}")


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")  # fullmatch: `$` would let a final newline in
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def _dotted(path: tuple[str | int, ...]) -> str:
    """`policy.min_class.grain`, `trust.operators."operator:alice"`, `policy.doc_allowlist[2]`."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = part if _BARE_KEY.fullmatch(part) else json.dumps(part)
            out += f".{name}" if out else name
    return out or "(top level)"


def _got(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _explain(message: str, doc: object) -> str:
    """Turn msgspec's `Expected `int` >= 1 - at `$.apply.attempts`` into
    `apply.attempts: expected int >= 1, got 0`, naming a table's key where msgspec says `[...]`."""
    message, _, where = message.partition(" - at `")
    node: Any = doc
    typ: Any = Config
    path: list[str | int] = []
    for name, index in _SEGMENT.findall(where.rstrip("`")[1:]):
        if name:  # a field of a Struct
            typ = typing.get_type_hints(_strip(typ), include_extras=True)[name]
            node = node[name]
            path.append(name)
        elif index == "...":  # a value of a table: find the key msgspec does not name
            typ = typing.get_args(_strip(typ))[1]
            key = next(k for k, v in node.items() if not _fits(v, typ))
            node = node[key]
            path.append(key)
        else:  # an element of an array
            typ = typing.get_args(_strip(typ))[0]
            node = node[int(index)]
            path.append(int(index))
    unknown = re.match(r"Object contains unknown field `(.*)`$", message, re.S)
    if unknown:
        key = unknown.group(1)
        hints = typing.get_type_hints(_strip(typ))
        near = difflib.get_close_matches(key, list(hints), n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        return f"{_dotted((*path, key))}: unknown key{hint}"
    return f"{_dotted(tuple(path))}: {_expected(message, typ, node)}"


def _fits(value: object, typ: Any) -> bool:
    try:
        msgspec.convert(value, typ, dec_hook=_dec_hook)
    except msgspec.ValidationError:
        return False
    return True


def _strip(typ: Any) -> Any:
    """The type under Annotated and `| None`."""
    while True:
        if typing.get_origin(typ) is Annotated:
            typ = typing.get_args(typ)[0]
        elif typing.get_origin(typ) in (typing.Union, types.UnionType):
            typ = next(t for t in typing.get_args(typ) if t is not type(None))
        else:
            return typ


def _expected(message: str, typ: Any, value: object) -> str:
    if message.startswith("Invalid enum value"):
        choices = ", ".join(str(c) for c in typing.get_args(_strip(typ)))
        return f"expected one of {choices}, got {_got(value)}"
    wrong_type = re.match(r"Expected `([^`]+)`, got `([^`]+)`$", message)
    if wrong_type:  # in TOML's words: a table, and no null
        want, got = (t.replace(" | null", "").replace("object", "table")
                     for t in wrong_type.groups())
        return f"expected {want}, got {got}"
    if message.startswith("Expected `"):  # a constraint: a range, a length, a pattern
        descriptions = [m.description for m in _metas(typ) if m.description]
        want = descriptions[0] if descriptions else message[len("Expected "):].replace("`", "")
        return f"expected {want}, got {_got(value)}"
    return " ".join(message.split())  # a dec_hook's own words, or msgspec's, on one line


def _metas(typ: Any) -> list[Meta]:
    found = []
    for t in (typ, *typing.get_args(typ)):
        if typing.get_origin(t) is Annotated:
            found += [m for m in t.__metadata__ if isinstance(m, Meta)]
    return found
