"""The configuration file as an operator writes it: strict about keys and types, one line naming
the key when something is wrong, and the documented examples load to the documented values."""

from __future__ import annotations

import argparse
import base64
import re
import typing
from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from improved.client import config as config_module
from improved.client import connection
from improved.client.config import (
    ApplySettings,
    Config,
    Policy,
    TelemetrySettings,
    Trust,
    load,
    parse,
)
from improved.client.connection import ConfigError, NatsSettings
from improved.core.guards import DEFAULT_FORBIDDEN
from improved.core.policy import loosening
from improved.core.signing import raw_public

ROOT = Path(__file__).resolve().parents[2]


def b64_key() -> str:
    return base64.b64encode(raw_public(Ed25519PrivateKey.generate().public_key())).decode()


KEY_A, KEY_B, KEY_C, KEY_D, KEY_E = b64_key(), b64_key(), b64_key(), b64_key(), b64_key()


def error_of(doc: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        parse(doc)
    return str(caught.value)


# -- what a user hits --------------------------------------------------------------------------


@pytest.mark.parametrize(("doc", "line"), [
    ({"nats": "nats://x:4222"}, "config error: nats: expected table (user, password_file, "
                                "token_file, creds_file, tls_*), got str (did you mean "
                                "nats_url?)"),
    ({"nats": {"password_file": 5}}, "config error: nats.password_file: expected a path, "
                                     "got 5"),
    ({"nats": {"user": ["improved"]}}, "config error: nats.user: expected str, got array"),
    ({"nats": {"pasword_file": "/x"}},
     "config error: nats.pasword_file: unknown key (did you mean password_file?)"),
    ({"nats": {"user": "improved"}},
     "config error: nats.user: needs nats.password_file (the password, in a file)"),
    ({"nats": {"password_file": "/run/pw"}}, "config error: nats.password_file: needs nats.user"),
    ({"nats": {"user": "improved", "password_file": "/run/pw", "token_file": "/run/t"}},
     "config error: nats.token_file: one credential only (user and password_file, token_file "
     "or creds_file), got nats.user, nats.password_file, nats.token_file"),
    ({"nats": {"tls_cert": "/etc/c.pem"}}, "config error: nats.tls_cert: needs nats.tls_key"),
    ({"policy": {"autonomyy": "off"}},
     "config error: policy.autonomyy: unknown key (did you mean autonomy?)"),
    ({"apply": {"retries": 2, "timeout_s": 1}}, "config error: apply.retries: unknown key"),
    ({"trust": {"operator": {}}}, "config error: trust.operator: unknown key (did you mean "
                                  "operators?)"),
    ({"policy": {"forbidden_targets": "_spec/2026-04-20-00-constitution.md"}},
     "config error: policy.forbidden_targets: expected array, got str"),
    ({"policy": {"doc_allowlist": ["docs/**", 3]}},
     "config error: policy.doc_allowlist[1]: expected str, got int"),
    ({"apply": {"timeout_s": "five"}}, "config error: apply.timeout_s: expected float, got str"),
    ({"apply": {"attempts": "3"}}, "config error: apply.attempts: expected int, got str"),
    ({"apply": {"attempts": 0}}, "config error: apply.attempts: expected int >= 1, got 0"),
    ({"apply": {"timeout_s": -1.0}},
     "config error: apply.timeout_s: expected float > 0.0, got -1.0"),
    ({"policy": {"fallback_min_class": "L9"}},
     "config error: policy.fallback_min_class: expected one of L0, L1, L2, L3, L4, got 'L9'"),
    ({"policy": {"min_class": {"grain": "L2", "rank": "L9"}}},
     "config error: policy.min_class.rank: expected one of L0, L1, L2, L3, L4, got 'L9'"),
    ({"policy": {"autonomy": "maybe"}},
     "config error: policy.autonomy: expected one of on, off, got 'maybe'"),
    ({"policy": {"quorum": "yes"}}, "config error: policy.quorum: expected bool, got str"),
    ({"policy": {"regression_tolerance": 5}},
     "config error: policy.regression_tolerance: expected float <= 1.0, got 5"),
    ({"policy": {"metric_direction": {"error rate": "down"}}},
     "config error: policy.metric_direction.\"error rate\": expected one of higher, lower, "
     "got 'down'"),
    ({"policy": {"effect_window_ms": 1.5}},
     "config error: policy.effect_window_ms: expected int, got float"),
    ({"port": 0}, "config error: port: expected int >= 1, got 0"),
    ({"metrics_port": 65536}, "config error: metrics_port: expected int <= 65535, got 65536"),
    ({"replicas": 2}, "config error: replicas: expected one of 1, 3, 5, got 2"),
    ({"records_storage": "disk"},
     "config error: records_storage: expected one of file, memory, got 'disk'"),
    ({"sync": "sometimes"},
     "config error: sync: expected \"always\" or a duration such as \"2m\", got 'sometimes'"),
    ({"data_dir": 7}, "config error: data_dir: expected a path, got 7"),
    ({"policy": ["a"]}, "config error: policy: expected table, got array"),
    ({"nats_url": 4222}, "config error: nats_url: expected str, got int"),
    ({"policy": {"regression_tolerance": float("nan")}},
     "config error: policy.regression_tolerance: expected float >= 0.0, got nan"),
    ({"policy": {"breaker_window_days": float("inf")}},
     "config error: policy.breaker_window_days: expected float <= 3650.0, got inf"),
    ({"trust": {"operators": {"operator:alice": "not a key"}}},
     "config error: trust.operators.\"operator:alice\": expected the base64 of a raw 32-byte "
     "Ed25519 public key, got 'not a key'"),
    ({"trust": {"quorum": {"agent-a": base64.b64encode(b"x" * 31).decode()}}},
     "config error: trust.quorum.agent-a: expected the base64 of a raw 32-byte Ed25519 public "
     "key, got 'eHh4eHh4eHh4eHh4eHh4eHh4eHh4eHh4eHh4eHh4eA=='"),
])
def test_a_bad_value_is_one_line_naming_the_key(doc, line):
    assert error_of(doc) == line


def test_a_string_of_forbidden_targets_does_not_unguard_the_constitution():
    # it used to become one-character globs; now it is refused, and omitting it keeps Art. VI
    assert "policy.forbidden_targets" in error_of({"policy": {"forbidden_targets": "abc"}})
    assert parse({"policy": {}}).policy.forbidden == DEFAULT_FORBIDDEN
    added = parse({"policy": {"forbidden_targets": ["a/**"]}}).policy
    assert added.forbidden_targets == ("a/**",)
    assert added.forbidden == (*DEFAULT_FORBIDDEN, "a/**")


# -- invariants are floors (DESIGN §9) ----------------------------------------------------------


@pytest.mark.parametrize(("policy", "line"), [
    ({"min_class": {"binary": "L0"}},
     "config error: policy.min_class.binary: L0 is below the minimum L4 for binary: targets; "
     "a configuration may only raise it"),
    ({"min_class": {"code": "L0", "binary": "L2"}},
     "config error: policy.min_class.binary: L2 is below the minimum L4 for binary: targets; "
     "a configuration may only raise it"),
    ({"min_class": {"grain": "L0"}},
     "config error: policy.min_class.grain: L0 is below the minimum L2 for grain: targets; "
     "a configuration may only raise it"),
    ({"min_class": {"code": "L3"}},
     "config error: policy.min_class.code: L3 is below the minimum L4 for code: targets; "
     "a configuration may only raise it"),
    ({"fallback_min_class": "L0"},
     "config error: policy.fallback_min_class: L0 is below the built-in fallback L2 for "
     "schemes not listed; a configuration may only raise it"),
    ({"quorum": True},
     "config error: policy.quorum: true needs policy.quorum_amendment, the id of an approved "
     "constitution edit (a charter proposal) that permits the L4 quorum (SPEC 09 §6)"),
    ({"quorum": True, "quorum_amendment": "P-17"},
     "config error: policy.quorum_amendment: expected a proposal id (64 lowercase hex), "
     "got 'P-17'"),
])
def test_a_loosening_is_one_line_naming_the_key(policy, line):
    assert error_of({"policy": policy}) == line


def test_what_only_tightens_or_repeats_the_floors_is_accepted():
    p = parse({"policy": {"min_class": {"binary": "L4", "rank": "L2", "grain": "L2"},
                          "fallback_min_class": "L4",
                          "forbidden_targets": ["_spec/CHANGELOG.md", "deploy/**"],
                          "quorum_amendment": "a" * 64}}).policy
    assert p.min_class == {"binary": "L4", "rank": "L2", "grain": "L2"}
    assert p.forbidden == (*DEFAULT_FORBIDDEN, "deploy/**")
    assert p.quorum is False and p.quorum_amendment == "a" * 64  # named, not switched on
    assert parse({"policy": {"quorum": True, "quorum_amendment": "b" * 64}}).policy.quorum


def test_numbers_widen_to_float_but_nothing_else_is_coerced():
    config = parse({"apply": {"timeout_s": 2}, "policy": {"breaker_pause_hours": 1}})
    assert config.apply.timeout_s == 2.0 and isinstance(config.apply.timeout_s, float)
    assert config.policy.breaker_pause_hours == 1.0
    assert "expected int, got bool" in error_of({"port": True})
    assert "expected float, got bool" in error_of({"apply": {"timeout_s": True}})


def test_defaults_are_unchanged(monkeypatch):
    monkeypatch.delenv("IMPROVED_CONFIG", raising=False)
    assert parse({}) == Config() == load(None)
    c = Config()
    assert (c.nats_url, c.data_dir, c.port, c.sync, c.max_message_bytes, c.replicas,
            c.records_storage, c.metrics_port, c.checkpoint_interval_s, c.checkpoint_key,
            c.metrics_host) == (None, config_module.state_dir(), 4222, "always", 262144, 1, "memory", None,
                                300.0, None, "127.0.0.1")
    p = c.policy
    assert (p.forbidden_targets, p.min_class, p.fallback_min_class, p.policy_principal,
            p.effect_window_ms, p.autonomy, p.doc_allowlist, p.regression_tolerance,
            p.metric_direction, p.breaker_threshold, p.breaker_window_days,
            p.breaker_pause_hours, p.quorum) == (
        (), {}, "L2", "policy:auto", 86400000, "on", ("docs/**", "*.md"), 0.05, {}, 3, 14.0, 48.0,
        False)
    assert p.forbidden == DEFAULT_FORBIDDEN and p.quorum_amendment is None
    assert (c.apply.timeout_s, c.apply.attempts, c.apply.max_deliveries) == (5.0, 3, 8)
    assert (c.trust.operators, c.trust.act_max_age_s, c.trust.quorum) == ({}, 86400.0, {})


def test_sections_are_built_by_keyword_immutable_and_replaced_whole():
    policy = Policy(doc_allowlist=("docs/**",), quorum=True)
    config = Config(policy=policy, apply=ApplySettings(timeout_s=1.0), trust=Trust())
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        Policy(("a",))  # type: ignore[misc]  # keyword only
    moved = msgspec.structs.replace(config, port=5000)
    assert moved.port == 5000 and moved.policy is policy and config.port == 4222
    assert Policy(min_class={}) == Policy()


def test_sync_takes_always_or_a_duration():
    for good in ("always", "2m", "1h30m", "500ms", "0"):
        assert parse({"sync": good}).sync == good
    for bad in ("", "2", "-1s", "2 m", "never"):
        assert error_of({"sync": bad}).startswith("config error: sync: expected ")


# -- the documented examples -------------------------------------------------------------------


def _toml_block(text: str) -> str:
    return text.split("```toml\n", 1)[1].split("\n```", 1)[0]


def _with_keys(block: str, order: tuple[str, ...] | None = None) -> str:
    keys = iter(order or (KEY_A, KEY_B, KEY_C))
    return re.sub(r'"<base64[^">]*>"', lambda _: f'"{next(keys)}"', block)


def test_the_docstring_example_loads_to_its_values(tmp_path):
    path = tmp_path / "improved.toml"
    path.write_text(_with_keys(_toml_block(config_module.__doc__)))
    assert load(path) == Config(
        nats_url="nats://127.0.0.1:4222", data_dir=Path("/var/lib/improved"), port=4222, sync="always",
        max_message_bytes=262144, replicas=1, records_storage="memory", metrics_port=9464,
        metrics_host="127.0.0.1", checkpoint_interval_s=300.0,
        checkpoint_key=Path("/etc/improved/checkpoint.pem"),
        nats=NatsSettings(user="improved", password_file=Path("/etc/improved/nats-password")),
        policy=Policy(forbidden_targets=("deploy/secrets/**",), min_class={"config": "L4"},
                      fallback_min_class="L2", policy_principal="policy:auto",
                      effect_window_ms=86400000, autonomy="on",
                      doc_allowlist=("docs/**", "*.md"), regression_tolerance=0.05,
                      metric_direction={"error_rate": "lower"}, breaker_threshold=3,
                      breaker_window_days=14.0, breaker_pause_hours=48.0, quorum=False,
                      principals={"kb:*": "policy:kb"}),
        trust=Trust(operators={"operator:alice": KEY_A}, act_max_age_s=86400.0,
                    quorum={"agent-a": KEY_B}, daemons={"improved:b": KEY_C}),
        apply=ApplySettings(timeout_s=5.0, attempts=3, max_deliveries=8),
        telemetry=TelemetrySettings(endpoint="http://127.0.0.1:4318"))


def test_the_readme_example_loads_to_its_values(tmp_path):
    readme = (ROOT / "README.md").read_text()
    path = tmp_path / "improved.toml"
    path.write_text(_with_keys(_toml_block(readme.split("## Configuration", 1)[1]),
                               (KEY_A, KEY_B, KEY_D, KEY_C, KEY_E)))
    config = load(path)
    assert config == Config(
        nats_url="nats://127.0.0.1:4222", data_dir=Path("/var/lib/improved"), port=4222, sync="always",
        max_message_bytes=262144, metrics_port=9464, replicas=1, records_storage="memory",
        metrics_host="127.0.0.1", checkpoint_interval_s=300.0,
        nats=NatsSettings(user="improved", password_file=Path("/etc/improved/nats-password")),
        policy=Policy(forbidden_targets=("deploy/secrets/**",),
                      min_class={"config": "L4"}, fallback_min_class="L2",
                      policy_principal="policy:auto", effect_window_ms=86400000, autonomy="on",
                      breaker_threshold=3, breaker_window_days=14.0, breaker_pause_hours=48.0,
                      doc_allowlist=("docs/**",),
                      regression_tolerance=0.05, metric_direction={"error_rate": "lower"},
                      quorum=False, principals={"kb:*": "policy:kb"}),
        trust=Trust(operators={"operator:alice": KEY_A}, quorum={"agent-a": KEY_B},
                    signers={"check:ci": KEY_D}, daemons={"improved:b": KEY_C},
                    runtimes={"agent": KEY_E}),
        apply=ApplySettings(timeout_s=5.0, attempts=3, max_deliveries=8),
        telemetry=TelemetrySettings(endpoint="http://127.0.0.1:4318"))
    assert len(config.trust.store().keys) == 1 and len(config.trust.voters().keys) == 1
    assert [k.principal for k in config.trust.runtime_store().keys.values()] == ["agent"]
    assert len(config.trust.daemon_keyids()) == 1 and len(config.trust.signer_store().keys) == 1
    # copied as is, it weakens no invariant
    assert config.policy.forbidden[:len(DEFAULT_FORBIDDEN)] == DEFAULT_FORBIDDEN
    assert loosening(config.policy) is None and not config.policy.quorum


def test_the_deploy_example_loads():
    config = load(ROOT / "deploy" / "improved.toml")
    assert config.replicas == 1 and config.policy.quorum is False


def test_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("port = \n")
    with pytest.raises(ConfigError, match=r"^config file .* is not valid TOML: "):
        load(bad)
    bad.write_bytes(b'nats_url = "\xff"\n')
    with pytest.raises(ConfigError, match=r"^config file .* cannot be read: "):
        load(bad)
    with pytest.raises(ConfigError, match=r"^config file not found: "):
        load(tmp_path / "missing.toml")


# -- properties ----------------------------------------------------------------------------------


def _fields(cls) -> list[str]:
    return list(typing.get_type_hints(cls))


SECTIONS = {"policy": Policy, "apply": ApplySettings, "trust": Trust}
NAMES = sorted({*_fields(Config), *(n for c in SECTIONS.values() for n in _fields(c)),
                "grain", "error_rate", "operator:alice", "agent-a"})
keys = st.one_of(st.sampled_from(NAMES), st.text(max_size=10))
scalars = st.one_of(
    st.sampled_from(["L2", "L9", "on", "off", "file", "memory", "higher", "lower", "always",
                     "2m", "", "policy:auto", "docs/**", KEY_A]),
    st.text(max_size=12), st.integers(-(2**63), 2**63 - 1), st.floats(), st.booleans(),
    st.datetimes(), st.dates(), st.times())
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=10)
documents = st.dictionaries(
    keys, st.one_of(values, st.dictionaries(keys, values, max_size=6)), max_size=8)


def _one_line(message: str) -> bool:
    return "\n" not in message and "\r" not in message


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
def test_any_document_is_a_config_or_one_config_error(doc):
    try:
        config = parse(doc)
    except ConfigError as exc:
        assert _one_line(str(exc)) and str(exc).startswith("config error: ")
    else:
        assert isinstance(config, Config)


VALID = {
    "port": 4300, "sync": "2m", "replicas": 3,
    "policy": {"min_class": {"grain": "L2"}, "doc_allowlist": ["docs/**"], "autonomy": "off",
               "metric_direction": {"error_rate": "lower"}},
    "apply": {"timeout_s": 2.0, "attempts": 2},
    "trust": {"operators": {"operator:alice": KEY_A}, "quorum": {"agent-a": KEY_B}},
}
PLACES = [(n,) for n in _fields(Config) if n not in SECTIONS] + [
    (s, n) for s, cls in SECTIONS.items() for n in _fields(cls)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PLACES), values)
def test_one_bad_value_in_a_good_file_is_named(place, value):
    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in VALID.items()}
    if len(place) == 1:
        doc[place[0]] = value
    else:
        doc.setdefault(place[0], {})[place[1]] = value
    dotted = ".".join(place)
    try:
        parse(doc)
    except ConfigError as exc:
        message = str(exc)
        assert _one_line(message)
        assert re.match(rf"config error: {re.escape(dotted)}[.:\[]", message), message


def test_a_key_ending_in_a_newline_is_quoted_on_its_one_line():
    with pytest.raises(ConfigError) as err:
        parse({"0\n": 1})
    assert str(err.value) == 'config error: "0\\n": unknown key'


@pytest.mark.parametrize("name", ["ci", "operator:alice", "agent:ranking", "Check:CI"])
def test_a_signer_must_be_an_identity(name):
    """[trust.signers] names identities in their one canonical form (core/identity.py): an
    operator signs with an operator key, never as a signer."""
    assert error_of({"trust": {"signers": {name: KEY_A}}}).startswith(
        f"config error: trust.signers.{name}: not an identity")


def test_trust_runtimes_names_runtimes_and_their_keys():
    """[trust.runtimes]: runtime name → its key; a bad name or key is one line naming it."""
    assert parse({"trust": {"runtimes": {"agent": KEY_A}}}).trust.runtimes == {"agent": KEY_A}
    assert error_of({"trust": {"runtimes": {"Agent.x": KEY_A}}}).startswith(
        'config error: trust.runtimes."Agent.x": not a tool runtime\'s name')
    bad_key = error_of({"trust": {"runtimes": {"agent": "not-a-key"}}})
    assert bad_key.startswith("config error: trust.runtimes.agent: ") and "\n" not in bad_key


# -- NATS credentials: files, never the URL ----------------------------------------------------


def test_credentials_come_from_their_files_and_never_show_in_the_servers(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("s3cret-pw\n")
    where = connection.target("nats://127.0.0.1:4222,nats://127.0.0.1:4223",
                              NatsSettings(user="improved", password_file=pw))
    assert where.options == {"user": "improved", "password": "s3cret-pw"}
    assert where.where == "nats://127.0.0.1:4222,nats://127.0.0.1:4223"
    assert "s3cret" not in f"{where} {where!r}"
    token = tmp_path / "token"
    token.write_text("t0ken")
    assert connection.target("nats://h:4222", NatsSettings(token_file=token)).options == {
        "token": "t0ken"}
    # the older form still connects, its credentials split off the servers
    old = connection.target("nats://svc-ranking:p%40ss@h1:4222,nats://h2:4222")
    assert old.where == "nats://h1:4222,nats://h2:4222"
    assert old.options == {"user": "svc-ranking", "password": "p@ss"}


def test_a_credential_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, monkeypatch):
    def line(url: str, settings) -> str:
        with pytest.raises(ConfigError) as caught:
            connection.target(url, settings)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    missing = tmp_path / "nope"
    assert line("nats://h:4222", NatsSettings(user="improved", password_file=missing)) == (
        f"config error: nats.password_file: cannot read {missing}: No such file or directory")
    (tmp_path / "empty").write_text("\n")
    assert line("nats://h:4222", NatsSettings(token_file=tmp_path / "empty")) == (
        f"config error: nats.token_file: {tmp_path / 'empty'} is empty")
    (tmp_path / "ca.pem").write_text("not a certificate\n")
    assert line("nats://h:4222", NatsSettings(tls_ca=tmp_path / "ca.pem")).startswith(
        f"config error: nats.tls_ca: {tmp_path / 'ca.pem'} holds no CA certificate")
    (tmp_path / "pw").write_text("pw")
    assert line("nats://improved:pw@h:4222",
                NatsSettings(user="improved", password_file=tmp_path / "pw")) == (
        "config error: nats_url: carries credentials, and nats.user names others: keep one "
        "(the files: nats_url without user or password)")
    # given by the environment, the error names the variable too
    monkeypatch.setenv("IMPROVED_NATS_CREDS_FILE", str(missing))
    with pytest.raises(ConfigError) as caught:
        connection.target("nats://h:4222", load(None).nats)
    assert str(caught.value) == (f"config error: nats.creds_file (IMPROVED_NATS_CREDS_FILE): "
                                 f"cannot read {missing}: No such file or directory")


def test_the_environment_gives_the_nats_credentials_over_the_file(tmp_path, monkeypatch):
    conf = tmp_path / "improved.toml"
    conf.write_text('nats_url = "nats://h:4222"\n[nats]\ntoken_file = "/etc/improved/token"\n')
    assert load(conf).nats.token_file == Path("/etc/improved/token")
    monkeypatch.setenv("IMPROVED_NATS_USER", "improved")
    with pytest.raises(ConfigError) as caught:  # a user, and still the file's token
        load(conf)
    assert str(caught.value) == (
        "config error: nats.user (IMPROVED_NATS_USER): needs nats.password_file "
        "(IMPROVED_NATS_PASSWORD_FILE) (the password, in a file)")
    monkeypatch.setenv("IMPROVED_NATS_PASSWORD_FILE", "/run/secrets/pw")
    with pytest.raises(ConfigError, match="one credential only"):
        load(conf)
    conf.write_text('nats_url = "nats://h:4222"\n')
    settings = load(conf).nats
    assert (settings.user, settings.password_file) == ("improved", Path("/run/secrets/pw"))


def test_tls_files_make_a_client_context(tmp_path):
    import datetime
    import ssl

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID


    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "improved")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    where = connection.target("nats://h:4222", NatsSettings(
        tls_cert=tmp_path / "cert.pem", tls_key=tmp_path / "key.pem",
        tls_ca=tmp_path / "cert.pem"))
    assert isinstance(where.options["tls"], ssl.SSLContext)
    assert where.options["tls"].verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(ConfigError, match=r"^config error: nats.tls_cert: .* are not a "
                                          r"certificate and its key"):
        connection.target("nats://h:4222", NatsSettings(tls_cert=tmp_path / "key.pem",
                                                        tls_key=tmp_path / "key.pem"))


def test_the_environment_names_the_server_over_the_file(tmp_path, monkeypatch):
    conf = tmp_path / "improved.toml"
    conf.write_text('nats_url = "nats://h:4222"\n')
    monkeypatch.delenv("IMPROVED_NATS_URL", raising=False)
    assert load(conf).nats_url == "nats://h:4222" and load(None).nats_url is None
    monkeypatch.setenv("IMPROVED_NATS_URL", "nats://other:4333")
    assert load(conf).nats_url == load(None).nats_url == "nats://other:4333"


def test_the_data_directory_is_the_flag_then_the_environment_then_the_file_then_the_state_dir(
        tmp_path, monkeypatch):
    """Where a command looks for the daemon's data never depends on where it runs: the
    per-user state directory by default, a config's relative data_dir from its own directory,
    IMPROVED_DATA_DIR over the file, --data-dir over everything."""
    from improved.cli.common import config_of

    home, state, elsewhere = tmp_path / "home", tmp_path / "state", tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("IMPROVED_CONFIG", raising=False)
    monkeypatch.delenv("IMPROVED_DATA_DIR", raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    assert load(None).data_dir == home / ".local" / "state" / "improved"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/ignored")  # the XDG spec ignores it
    assert load(None).data_dir == home / ".local" / "state" / "improved"
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    assert load(None).data_dir == Config().data_dir == state / "improved"

    conf_dir = tmp_path / "etc"
    conf_dir.mkdir()
    conf = conf_dir / "improved.toml"
    conf.write_text('data_dir = "loop"\n')  # relative: to the file's directory, not the cwd
    assert load(conf).data_dir == conf_dir / "loop"
    conf.write_text(f'data_dir = "{tmp_path / "abs"}"\n')
    assert load(conf).data_dir == tmp_path / "abs"
    conf.write_text('port = 4333\n')  # no data_dir in the file: the default still holds
    assert load(conf).data_dir == state / "improved"

    monkeypatch.setenv("IMPROVED_DATA_DIR", str(tmp_path / "env"))
    conf.write_text('data_dir = "loop"\n')
    assert load(conf).data_dir == load(None).data_dir == tmp_path / "env"
    args = argparse.Namespace(config=str(conf), data_dir=str(tmp_path / "flag"))
    assert config_of(args).data_dir == tmp_path / "flag"
    assert config_of(argparse.Namespace(config=str(conf), data_dir=None)).data_dir == \
        tmp_path / "env"
    assert not (elsewhere / ".improved").exists()
