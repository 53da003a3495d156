"""A proposal named on the command line by a unique prefix of its id, as git names a commit:
the 12 digits the demo prints work wherever an id does, an ambiguous prefix names candidates,
and a prefix that matches nothing, or is not one, is one line."""

from __future__ import annotations

import asyncio
import json

import pytest
from cryptography.hazmat.primitives import serialization

from improved.cli import ids
from improved.client import connection
from improved.client.sdk import MeshClient
from improved.protocol import subjects as S
from improved.runtime.store import Store
from tests.bus import eventually, trailers
from tests.cli import improved
from tests.factories import skill_proposal
from tests.keys import ALICE

pytestmark = pytest.mark.asyncio(loop_scope="session")


def cli(*args: str):
    return asyncio.to_thread(improved, *args)


async def test_the_demos_twelve_digits_name_a_proposal_everywhere(daemon, nc, nats_url, svc,
                                                                   tmp_path):
    pid = (await MeshClient(nc, svc).propose(skill_proposal(svc))).proposal_id
    short = pid[:12]
    shown = await cli("show", "--nats", nats_url, short.upper())  # any case, as typed
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["state"]["proposal_id"] == pid
    verified = await cli("audit", "verify", "--nats", nats_url, short)  # that chain alone
    # no daemon key here: the chain holds, and who wrote it is not checked
    assert "1/1 chains hold (hashes and links), 2 trailers" in verified.stdout, verified.stdout
    assert verified.returncode == 3, verified.stdout + verified.stderr

    key = tmp_path / "alice.pem"
    key.write_bytes(ALICE[1].private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    rejected = await cli("reject", short, "--nats", nats_url, "--reason", "not this one",
                         "--key", str(key), "--principal", ALICE[0])
    assert rejected.returncode == 0, rejected.stderr
    assert f"reject of {pid} signed by {ALICE[0]}" in rejected.stdout  # signed in full

    async def rejected_on_the_chain():
        return any(t.get("verdict") == "reject" for t in await trailers(daemon, svc, pid))

    await eventually(rejected_on_the_chain)


async def test_an_ambiguous_or_unknown_prefix_is_one_line(own_server):
    """The listing reads the audit stream's chain subjects only: two chains under one prefix
    are made by hand here, on a server of the test's own."""
    nc = await connection.connect(own_server.url, "ids-test")
    try:
        await Store(nc).ensure()
        js = nc.jetstream()
        made = ["abcd" + "0" * 59 + str(i) for i in range(5)] + ["abce" + "1" * 60]
        for pid in made:
            await js.publish(S.audit("idsvc", pid), b"{}", stream=S.STREAM_AUDIT)
        await js.publish(S.grant_audit("abcd" + "f" * 60), b"{}", stream=S.STREAM_AUDIT)
        assert await ids.with_prefix(nc, "abcd") == [("idsvc", p) for p in made[:5]]
        assert await ids.with_prefix(nc, "abce") == [("idsvc", made[5])]  # never a grant chain
    finally:
        await nc.close()

    ambiguous = await cli("show", "--nats", own_server.url, "abcd")
    assert ambiguous.returncode == 1 and "Traceback" not in ambiguous.stderr
    assert ambiguous.stderr == (f"improved show: abcd is ambiguous: {made[0][:16]} (idsvc), "
                                f"{made[1][:16]} (idsvc), {made[2][:16]} (idsvc) and 2 more; "
                                "give more digits\n")
    for command in (["show"], ["audit", "verify"], ["revert"]):
        unknown = await cli(*command, "--nats", own_server.url, "beef")
        assert unknown.returncode == 1, unknown.stderr
        assert unknown.stderr == (f"improved {' '.join(command)}: no proposal id starts with "
                                  "beef; `improved review` lists what waits\n")
    for bad in ("abc", "xyz0", "a" * 65):
        usage = await cli("show", "--nats", own_server.url, bad)
        assert usage.returncode == 2 and "not a proposal id" in usage.stderr, usage.stderr
