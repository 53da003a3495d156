"""An operator's first-hour mistakes, each fed through the real command line: one line on
stderr naming the file, key or entry and the fix, a non-zero exit, never a traceback."""

from __future__ import annotations

import base64
import os
import subprocess

from improved.runtime import bus
from tests.cli import ENV, IMPROVED

ID = "ab" * 32


def test_each_mistake_is_one_line_naming_it_and_the_fix(own_server, tmp_path):
    keys = tmp_path / "keys"  # $IMPROVED_KEYS: empty, like a first hour's
    not_pem = tmp_path / "alice.pem"
    not_pem.write_text("this is not a key\n")
    five = tmp_path / "five.toml"
    five.write_text('[apply]\ntimeout_s = "five"\n')
    unprefixed = tmp_path / "trust.toml"
    key = base64.b64encode(bytes(32)).decode()
    unprefixed.write_text(f'[trust.operators]\n"alice" = "{key}"\n')
    nowhere = f"nats://127.0.0.1:{bus.free_port()}"  # the key is read before any connection
    mistakes = [
        (["propose", str(tmp_path / "missing.json")],
         f"improved propose: cannot read the proposal file {tmp_path / 'missing.json'}: No such "
         "file or directory; give the path of a proposal file, or - to read it from stdin", 2),
        (["approve", ID, "--reason", "ok", "--key", str(tmp_path / "nokey.pem"), "--nats",
          nowhere],
         f"improved approve: cannot read key file {tmp_path / 'nokey.pem'}: No such file or "
         "directory; give the file `improved keys new` wrote", 2),
        (["grant", "summarize:" + "c" * 64, "--proposal", ID, "--reason", "ok", "--key",
          str(not_pem), "--nats", nowhere],
         f"improved grant: {not_pem} is not a PEM private key; give the unencrypted Ed25519 "
         "PEM file `improved keys new` wrote", 2),
        (["reject", ID, "--reason", "no", "--principal", "operator:zed", "--nats", nowhere],
         f"improved reject: no key for operator:zed at {keys / 'operator_zed.pem'} (the key "
         "directory is $IMPROVED_KEYS, else ~/.config/improved/keys): make one with `improved "
         "keys new --principal operator:zed`, or give --key FILE", 2),
        (["run", "--config", str(five), "--nats", nowhere],
         "improved: config error: apply.timeout_s: expected float, got str", 2),
        (["status", "--config", str(five), "--nats", nowhere],
         "improved: config error: apply.timeout_s: expected float, got str", 2),
        (["tools", "list", "demo", "--nats", own_server.url],
         "improved tools list: nothing serves demo.tools.list: start what answers it (the "
         "daemon, or the runtime or service the subject names), or check --nats", 1),
        (["run", "--config", str(unprefixed), "--nats", nowhere],
         'improved: config error: trust.operators.alice: an operator is named operator:NAME, as '
         "`improved keys new --principal operator:NAME` prints the entry; an act signed under "
         "any other name is refused", 2),
    ]
    env = {**ENV, "IMPROVED_KEYS": str(keys)}
    for args, line, code in mistakes:
        done = subprocess.run([*IMPROVED, *args], capture_output=True, text=True, timeout=60,
                              env=env, cwd=tmp_path)
        assert "Traceback" not in done.stderr, (args, done.stderr)
        assert (done.returncode, done.stderr) == (code, line + "\n"), args
    assert not os.path.exists(keys)  # nothing was made on the way
