"""`improved run --accounts`: the embedded server's users and permissions are
deploy/accounts.conf's, from that one file; the data directory's passwords are private, made
once, and sent only to the server running in that directory."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from improved.client import credentials
from improved.client.connection import NatsSettings
from improved.client.credentials import AccountsError
from improved.runtime import accounts, bus
from tests.cluster import ACCOUNTS, PASSWORDS

REFERENCE_PASSWORD = re.compile(r'password: "[^"]*"')


def test_the_package_carries_deploy_accounts_conf_itself():
    """One source: the text the embedded server is given is deploy/accounts.conf's bytes."""
    assert accounts.template() == ACCOUNTS.read_text(encoding="utf-8")


def test_the_embedded_users_and_permissions_are_deploy_accounts_conf_but_for_the_passwords(
        tmp_path):
    accounts.prepare(tmp_path)
    block = (tmp_path / "accounts" / "nats.conf").read_text()
    reference = ACCOUNTS.read_text()
    body = block.split("\n\n", 1)[1]  # after the header saying where it comes from
    assert REFERENCE_PASSWORD.sub("password: …", body) == \
        REFERENCE_PASSWORD.sub("password: …", reference)
    assert accounts.users(body) == accounts.users(reference)
    assert set(accounts.users(reference)) == {*PASSWORDS, "sys"}
    for user in accounts.users(reference):
        own = credentials.password_file(tmp_path, user).read_text().strip()
        assert f'password: "{own}"' in body
        assert own not in reference and PASSWORDS.get(user, "dev-sys-pw") not in body


def test_credentials_are_private_made_once_and_reused(tmp_path):
    accounts.prepare(tmp_path)
    private = tmp_path / "accounts"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    files = sorted(private.iterdir())
    assert {p.name for p in files} == {*(f"{u}.pw" for u in {*PASSWORDS, "sys"}), "nats.conf"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    first = {p.name: p.read_text() for p in files}
    assert len({v for k, v in first.items() if k.endswith(".pw")}) == len(files) - 1  # each own
    accounts.prepare(tmp_path)
    assert {p.name: p.read_text() for p in sorted(private.iterdir())} == first


def test_a_credential_open_to_others_or_not_a_password_is_refused(tmp_path):
    accounts.prepare(tmp_path)
    operator = credentials.password_file(tmp_path, "operator")
    operator.chmod(0o644)
    with pytest.raises(AccountsError, match=re.escape(f"{operator} is open to others (mode "
                                                      f"0644): `chmod 600 {operator}`")):
        accounts.prepare(tmp_path)
    operator.chmod(0o600)
    operator.write_text("short\n")
    with pytest.raises(AccountsError, match="holds no password"):
        accounts.prepare(tmp_path)
    operator.unlink()  # removed: a new one is made
    accounts.prepare(tmp_path)
    (tmp_path / "accounts").chmod(0o755)
    with pytest.raises(AccountsError, match=r"accounts is open to others \(mode 0755\)"):
        accounts.prepare(tmp_path)


def test_an_added_service_gets_svc_rankings_permissions_for_its_own_name(tmp_path):
    entry = accounts.service_user(accounts.template(), "my-svc")
    assert "ranking" not in entry and "#" not in entry
    for subject in ('"improve.proposals.my-svc"', '"my-svc.improve.propose"',
                    '"my-svc.improve.apply"', '"_INBOX_svc-my-svc.>"',
                    '"$JS.API.DIRECT.GET.IMPROVE_RECORDS.improve.*.my-svc.*"',
                    '"$KV.rank_my_svc.>"', '"$JS.API.STREAM.CREATE.KV_applies_my_svc"'):
        assert subject in entry, subject
    assert entry.count("{") == entry.count("}")

    path, new = accounts.add_service(tmp_path, "my-svc")
    assert new and path == tmp_path / "accounts" / "svc-my-svc.pw"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    block = (tmp_path / "accounts" / "nats.conf").read_text()
    assert "user: svc-my-svc" in block and f'"{path.read_text().strip()}"' in block
    again, new = accounts.add_service(tmp_path, "my-svc")
    assert (again, new) == (path, False)
    assert accounts.add_service(tmp_path, "ranking")[1] is False  # deploy/accounts.conf has it
    assert accounts.added(tmp_path) == ["my-svc"]
    with pytest.raises(AccountsError, match="must match"):
        accounts.add_service(tmp_path, "Bad.Name")


def pretend_running(data_dir: Path, port: int) -> None:
    """The lock and ports file an embedded server leaves in its data directory, with this
    process's pid standing in for the server's."""
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / bus.EmbeddedServer.LOCK).write_text(f"{os.getpid()}\n")
    (data_dir / f"nats-server_{os.getpid()}.ports").write_text(
        json.dumps({"nats": [f"nats://127.0.0.1:{port}"]}))


def test_a_password_goes_to_the_server_running_in_its_data_directory_only(tmp_path):
    data_dir = tmp_path / ".improved"
    accounts.prepare(data_dir)
    none = NatsSettings()
    # nothing runs there: nothing is sent, and the default is where a command goes
    assert credentials.target(None, data_dir, "operator", none).user is None
    pretend_running(data_dir, 4333)
    found = credentials.target(None, data_dir, "operator", none)
    assert found.where == "nats://127.0.0.1:4333" and found.user == "operator"
    assert found.options["password"] == \
        credentials.password_file(data_dir, "operator").read_text().strip()
    assert credentials.target("nats://localhost:4333", data_dir, "improved-admin",
                              none).user == "improved-admin"
    # another server, credentials given, or a data directory run open: none of its passwords
    assert credentials.target("nats://127.0.0.1:4222", data_dir, "operator", none).user is None
    assert credentials.target("nats://10.0.0.7:4333", data_dir, "operator", none).user is None
    given = tmp_path / "pw"
    given.write_text("s3cret-s3cret-s3cret\n")
    mine = NatsSettings(user="alice", password_file=given)
    assert credentials.target(None, data_dir, "operator", mine).user == "alice"
    assert credentials.target("nats://bob:pw@127.0.0.1:4333", data_dir, "operator",
                              none).user == "bob"
    with pytest.raises(AccountsError, match=re.escape(
            f"the server of {data_dir} runs with accounts and has no user svc-demo: give it "
            "one with `improved accounts add-service demo`")):
        credentials.target(None, data_dir, "svc-demo", none)
    open_dir = tmp_path / "open"
    pretend_running(open_dir, 4334)
    assert credentials.target(None, open_dir, "operator", none).user is None


def test_a_data_directory_says_which_way_it_was_run(tmp_path):
    assert accounts.mode_in(tmp_path) is None
    streams = tmp_path / "jetstream" / "jetstream" / "$G" / "streams"
    streams.mkdir(parents=True)
    assert accounts.mode_in(tmp_path) is None  # no stream yet: nothing to lose
    (streams / "IMPROVE_AUDIT").mkdir()
    assert accounts.mode_in(tmp_path) == "open"
    accounts.prepare(tmp_path / "other")
    assert accounts.mode_in(tmp_path / "other") == "accounts"
