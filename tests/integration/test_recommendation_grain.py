"""The Recommendation grain's last points through a real nats-server and daemon (issue 34): a
proposal with an unversioned analyzer id is refused on the bus and by `improved propose`, in
one line naming the form, and registers nothing; an auto-apply runs under the policy
principal of its proposal's namespace, and a proposal outside that namespace cannot borrow
it."""

from __future__ import annotations

import asyncio
import hashlib
import json

import msgspec
import pytest
import pytest_asyncio

from improved.client import connection, oms_export
from improved.client.sdk import ImproveError, MeshClient
from improved.core import oms_observation as oms
from improved.core.policy import Policy
from improved.core.propose import identify
from improved.protocol import canonical
from improved.protocol import subjects as S
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


# -- the audit chains as OMS grains -------------------------------------------------------------


async def test_the_export_re_encodes_byte_for_byte_links_each_chain_and_catches_tampering(
        namespaced_daemon, own_server, svc, tmp_path):
    conn, d = namespaced_daemon
    store = RankingStore(conn, svc)
    await store.start()
    try:
        client = MeshClient(conn, svc)
        applied = (await client.propose(rank_proposal(svc, namespace="kb:x"))).proposal_id
        await eventually(lambda: client.outcome(applied))
        waiting = (await client.propose(rank_proposal(svc, key="k2", change_class="L2")))
    finally:
        await store.stop()
    out = tmp_path / "oms"
    done = await asyncio.to_thread(improved, "audit", "export", "--oms", str(out), "--nats",
                                   own_server.url)
    assert done.returncode == 0, done.stderr
    assert "OMS grains" in done.stdout
    manifest = {c["chain"]: c for c in json.loads((out / "chains.json").read_text())["chains"]}
    # every file: named by its SHA-256, and decoded then encoded again by the project's OMS
    # encoder, the same bytes
    files = sorted(out.glob("*.mg"))
    assert files
    for path in files:
        blob = path.read_bytes()
        assert path.stem == hashlib.sha256(blob).hexdigest()
        type_byte, fields = oms.decoded(blob)
        assert canonical.grain_blob(fields, type_byte) == blob
    for pid in (applied, waiting.proposal_id):
        grains = [oms.decoded((out / f"{a}.mg").read_bytes())[1]
                  for a in manifest[pid]["grains"]]
        # the Recommendation grain heads the chain under the proposal id, its content address
        assert manifest[pid]["grains"][0] == pid and grains[0]["type"] == "recommendation"
        chain = [b for _, b in await d.store.read_chain(svc, pid)]
        assert [oms.trailer_of(g) for g in grains[1:]] == chain
        addresses = manifest[pid]["grains"]
        assert grains[1]["derived_from"] == [pid]
        for before, g in zip(addresses[1:], grains[2:], strict=False):
            assert g["derived_from"] == [pid, before]
        assert all(g["observer_type"] in ("human", "rec:agent", "rec:policy", "rec:system")
                   for g in grains[1:])
    assert [g["relation"] for g in (oms.decoded((out / f"{a}.mg").read_bytes())[1]
                                    for a in manifest[applied]["grains"][1:])][-1] == "rec:applied"
    assert oms_export.verify(out) == []

    # tampered: one byte of an observation (its reason) changed in place
    victim = out / f"{manifest[applied]['grains'][2]}.mg"
    original = victim.read_bytes()
    victim.write_bytes(original.replace(b"accept", b"reject", 1))
    assert original != victim.read_bytes()
    problems = oms_export.verify(out)
    assert len(problems) == 1 and applied in problems[0] and "content address" in problems[0]
    victim.write_bytes(original)
    # removed
    victim.unlink()
    assert any("cannot be read" in p for p in oms_export.verify(out))


async def test_a_forged_chain_on_the_bus_is_left_out_and_named(namespaced_daemon, own_server,
                                                              svc, tmp_path):
    """Anyone may publish on improve.audit.>: what does not verify is not exported."""
    conn, _ = namespaced_daemon
    forged = "ef" * 32
    await conn.jetstream().publish(S.audit(svc, forged), json.dumps(
        {"proposal_id": forged, "seq": 0, "reason": "approved, trust me"}).encode(),
        stream=S.STREAM_AUDIT)
    done = await asyncio.to_thread(improved, "audit", "export", "--oms", str(tmp_path / "o"),
                                   "--nats", own_server.url)
    assert done.returncode == 1, done
    assert f"BROKEN {forged} trailer 0" in done.stdout
    chains = json.loads((tmp_path / "o" / "chains.json").read_text())["chains"]
    assert forged not in {c["chain"] for c in chains}
    assert oms_export.verify(tmp_path / "o") == []
