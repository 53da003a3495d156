"""The Recommendation grain's last points through a real nats-server and daemon (issue 34): a
proposal with an unversioned analyzer id is refused on the bus and by `improved propose`, in
one line naming the form, and registers nothing; an auto-apply runs under the policy
principal of its proposal's namespace, and a proposal outside that namespace cannot borrow
it."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
import pytest_asyncio

from improved.client import connection
from improved.client.sdk import ImproveError, MeshClient
from improved.core.policy import Policy
from improved.core.propose import identify
from improved.protocol.model import AnalyzerRef
from improved.runtime.daemon import Daemon
from improved_reference.ranking_store import RankingStore
from tests.bus import daemon_config, eventually
from tests.cli import improved
from tests.factories import rank_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")

FORM = "publisher.name/major"


async def test_an_unversioned_analyzer_id_is_refused_on_the_bus_and_registers_nothing(
        daemon, nc, svc):
    client = MeshClient(nc, svc)
    unversioned = msgspec.structs.replace(rank_proposal(svc),
                                          analyzer=AnalyzerRef(id="acme.tuner"))
    reply = await client.propose_raw(msgspec.json.encode(unversioned))
    assert reply["error"]["code"] == "invalid_value"
    assert reply["error"]["field"] == "analyzer.id"
    assert FORM in reply["error"]["message"]
    with pytest.raises(ImproveError) as info:
        await client.propose(unversioned)
    assert info.value.field == "analyzer.id"
    pid, _ = identify(unversioned)
    await asyncio.sleep(0.3)
    assert await client.state(pid) is None
    assert await daemon.store.read_chain(svc, pid) == []


async def test_improved_propose_prints_the_form_in_one_line_and_exits_2(daemon, nats_url, svc):
    body = msgspec.to_builtins(rank_proposal(svc))
    body["analyzer"] = {"id": "tuner/1"}
    done = await asyncio.to_thread(improved, "propose", "-", "--nats", nats_url,
                                   input=json.dumps(body))
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    line = done.stderr.strip()
    assert line.startswith("improved propose: refused invalid_value (analyzer.id): analyzer.id "
                           "'tuner/1' is not a versioned analyzer id: the form is "
                           "publisher.name/major"), line


@pytest_asyncio.fixture(loop_scope="session")
async def namespaced_daemon(own_server):
    """A daemon of its own whose policy gives namespace `kb:*` the principal `policy:kb`."""
    conn = await connection.connect(own_server.url, "recs-daemon")
    d = Daemon(conn, daemon_config(policy=Policy(principals={"kb:*": "policy:kb"})))
    await d.start()
    yield conn, d
    await d.stop()
    await connection.close(conn)


async def test_an_auto_apply_runs_under_its_namespaces_principal_end_to_end(namespaced_daemon,
                                                                            svc):
    conn, d = namespaced_daemon
    store = RankingStore(conn, svc)
    await store.start()
    try:
        client = MeshClient(conn, svc)
        # the namespace's own; then the attack: proposals that name a look-alike namespace,
        # or none, to borrow kb's principal get the global one
        cases = [("kb:prefs", "policy:kb"), ("KB:prefs", "policy:auto"),
                 ("kbx:prefs", "policy:auto"), (None, "policy:auto")]
        for i, (namespace, principal) in enumerate(cases):
            reply = await client.propose(rank_proposal(svc, key=f"boost{i}", value=1.0 + i,
                                                       namespace=namespace))
            outcome = await eventually(lambda pid=reply.proposal_id: client.outcome(pid))
            assert outcome.ok and outcome.authority == principal, (namespace, outcome)
            chain = [b for _, b in await d.store.read_chain(svc, reply.proposal_id)]
            dispatched = [b for b in chain if b.get("verdict") == "dispatched"]
            assert len(dispatched) == 1
            assert f"authority:{principal}" in dispatched[0]["refs"], namespace
    finally:
        await store.stop()
