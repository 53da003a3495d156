"""The reference L4 artefact store and the service-side acceptance check, against a real
nats-server (no daemon): orders are sent by hand, and the audit trailers the acceptance check
reads are sealed and appended here, hashed and linked as the daemon would but neither
daemon-signed nor carrying signed acts (the service checks hashes and links; who wrote them is
the deployment's permissions). So they live on a server of this module's own: the session's
log must verify in full."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import asynccontextmanager

import msgspec
import pytest
import pytest_asyncio

from improved import testing
from improved.client import acceptance, connection
from improved.core import audit, propose
from improved.core.apply import ROLLBACK_ANALYZER
from improved.core.record import ChainHead
from improved.protocol import subjects as S
from improved.protocol.model import AnalyzerRef, ApplyOrder, Origin, Proposal, Summary, to_json
from improved.runtime import bus
from improved.runtime.store import Store
from improved_reference import kv_service
from improved_reference.artefact_store import ArtefactStore, bucket_names, digest_of, main
from tests.bus import eventually, send
from tests.factories import unique_ms

OPERATOR = "operator:alice"
SEED = {"config": '{"level": 1}', "motd": "hello"}
SMOKE = {"config": "json", "motd": "nonempty"}


def lkg(contents: dict[str, str], smoke: dict[str, str] = SMOKE) -> list[dict[str, str]]:
    return [{"artefact": n, "digest": digest_of(c.encode()), "smoke_test": smoke[n]}
            for n, c in contents.items()]


def l4(svc: str, data: dict, lkg_entries: list | None, change_class: str = "L4",
       **over) -> Proposal:
    return testing.proposal(svc, **{
        "target_ref": f"binary:{svc}", "change_class": change_class,
        "template": "swap_artefacts", "analyzer": "acme.release/1", "scope": "operation",
        "proposal_data": data, "lkg": lkg_entries, **over})


def swap(svc: str, contents: dict[str, str], **over) -> Proposal:
    return l4(svc, {"artefacts": contents}, lkg(contents), **over)


def order(p: Proposal, authority: str = OPERATOR) -> ApplyOrder:
    pid, _ = propose.identify(p)
    return ApplyOrder(proposal_id=pid, proposal=p, authority=authority, attempt=1)


async def append(js, svc: str, chain_id: str, *steps: tuple[str | None, str],
                 gate_class: str = "L4") -> None:
    """Seal and append one trailer per (verdict, actor) to a chain, as the daemon would: each
    at its verdict's stage (an apply's outcome and an operator's rollback request at apply)."""
    bodies = await acceptance.read_chain(js, S.audit(svc, chain_id))
    head = ChainHead(length=len(bodies), last_hash=bodies[-1]["hash"] if bodies else "")
    for verdict, actor in steps:
        stage = "apply" if verdict in ("applied", "rollback") else "triage"
        draft = (audit.Draft("observe", "propose", actor, "rec:agent", "proposed")
                 if verdict is None else
                 audit.Draft("triage", stage, actor, "human", f"{verdict} by {actor}",
                             verdict=verdict))
        trailer = audit.seal_next(draft, chain_id, head, gate_class, "operation", unique_ms())
        await js.publish(S.audit(svc, chain_id), to_json(trailer), stream=S.STREAM_AUDIT)
        head = ChainHead(length=head.length + 1, last_hash=trailer.hash)


async def approved(js, o: ApplyOrder, *verdicts: tuple[str, str]) -> ApplyOrder:
    """`o`, registered on its chain and then given `verdicts` (default: approved by alice)."""
    await append(js, o.proposal.service, o.proposal_id, (None, o.proposal.origin.actor),
                 *(verdicts or (("approve", OPERATOR),)))
    return o


async def manifest_rev(store: ArtefactStore) -> int:
    return (await store._current("manifest"))[1]


@pytest.fixture(scope="module")
def module_server(tmp_path_factory):
    server = bus.EmbeddedServer(tmp_path_factory.mktemp("artefacts"), bus.free_port(),
                                sync="2m")
    server.start()
    yield server
    server.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def nc(module_server):
    """A connection to this module's server, where the loop's streams exist (as a daemon
    makes them); no daemon runs there."""
    conn = await connection.connect(module_server.url, "improved-test-artefacts")
    await Store(conn).ensure()
    yield conn
    await conn.drain()


@pytest_asyncio.fixture(loop_scope="session")
async def store(nc, svc):
    """The reference artefact store of `svc`, seeded."""
    async with serving(nc, svc, SEED) as s:
        yield s


@asynccontextmanager
async def serving(nc, svc: str, seed: dict[str, str]):
    """The reference artefact store of `svc`, started and seeded; stopped and its buckets
    deleted on the way out."""
    s = ArtefactStore(nc, svc)
    await s.start()
    await s.seed(seed)
    try:
        yield s
    finally:
        await s.stop()
        await dropped(nc, svc)


async def dropped(nc, svc: str) -> None:
    """The artefact store's buckets of `svc`, deleted."""
    js = nc.jetstream()
    objects, heads, ledger = bucket_names(svc)
    await js.delete_object_store(objects)
    for bucket in (heads, ledger):
        await js.delete_key_value(bucket)


def seeded() -> dict[str, str]:
    return {n: digest_of(c.encode()) for n, c in SEED.items()}


async def lkg_check(nc, svc: str, body) -> dict:
    data = body if isinstance(body, bytes) else to_json(body)
    reply = await nc.request(S.lkg_request(svc), data, timeout=5)
    return msgspec.json.decode(reply.data)


# -- the pre-apply LKG check ---------------------------------------------------------------------


async def test_lkg_check_reports_healthy_failing_unknown_and_corrupt_and_changes_nothing(
        nc, svc, store):
    before, rev = await store.manifest(), await manifest_rev(store)
    pid = "ab" * 32
    new = {"config": '{"level": 2}', "motd": "hi"}

    healthy = await lkg_check(nc, svc, {"proposal_id": pid, "lkg": lkg(new)})
    assert healthy == {"ok": True, "artefacts": [
        {"artefact": "config", "lkg_digest": seeded()["config"], "smoke_test": "json", "rc": 0},
        {"artefact": "motd", "lkg_digest": seeded()["motd"], "smoke_test": "nonempty", "rc": 0}]}

    # the current motd ("hello") is no JSON: its LKG fails that smoke test
    failing = await lkg_check(nc, svc, {"proposal_id": pid, "lkg": lkg(
        new, {"config": "json", "motd": "json"})})
    assert failing["ok"] is False
    assert [a["rc"] for a in failing["artefacts"]] == [0, 1]
    assert "motd" in failing["error"]

    unknown = await lkg_check(nc, svc, {"proposal_id": pid, "lkg": [
        {"artefact": "nosuch", "digest": digest_of(b"x"), "smoke_test": "nonempty"},
        {"artefact": "motd", "digest": digest_of(b"x"), "smoke_test": "nosuch-test"}]})
    assert unknown["ok"] is False
    assert unknown["artefacts"][0] == {"artefact": "nosuch", "lkg_digest": None,
                                       "smoke_test": "nonempty", "rc": 127}
    assert unknown["artefacts"][1]["rc"] == 127
    assert "no last-known-good for nosuch" in unknown["error"]

    for bad in (b"not json", {"lkg": lkg(new)}, {"proposal_id": pid, "lkg": []},
                {"proposal_id": pid, "lkg": [{"artefact": "motd"}]}):
        reply = await lkg_check(nc, svc, bad)
        assert reply["error"]["code"] == "invalid_value", reply

    assert (await store.manifest(), await manifest_rev(store)) == (before, rev)

    # the LKG blob itself goes missing: rc 126
    await store.blobs.objects.delete(seeded()["motd"].removeprefix("sha256:"))
    corrupt = await lkg_check(nc, svc, {"proposal_id": pid, "lkg": lkg(new)})
    assert corrupt["ok"] is False and [a["rc"] for a in corrupt["artefacts"]] == [0, 126]
    assert "LKG blob missing or corrupt" in corrupt["error"]
    assert (await store.manifest(), await manifest_rev(store)) == (before, rev)


# -- swaps ---------------------------------------------------------------------------------------


async def test_accepted_swap_applies_both_in_one_write_exactly_once(nc, svc, store):
    js = nc.jetstream()
    new = {"config": '{"level": 2}', "motd": "hello, world"}
    o = await approved(js, order(swap(svc, new)))
    rev = await manifest_rev(store)

    result, raw = await send(nc, svc, o)
    assert result.ok, result.error
    assert result.applied_id == f"manifest@{rev + 1}"  # one write moved both
    assert result.rollbackable and result.inverse == {"restore": seeded()}
    assert await store.manifest() == {n: digest_of(c.encode()) for n, c in new.items()}
    assert await store.content("motd") == b"hello, world"
    assert await store.content("config") == b'{"level": 2}'

    again, raw_again = await send(nc, svc, o)
    assert (again, raw_again) == (result, raw)
    assert await manifest_rev(store) == rev + 1
    assert (store.applies, store.orders) == (1, 2)
    assert await store.apply_count(o.proposal_id) == 1


@pytest.mark.parametrize("fault, error", [
    ("smoke", "artefact motd: smoke test nonempty failed (rc 1); nothing swapped"),
    ("digest", "artefact motd: digest mismatch"),
])
async def test_second_artefact_failing_leaves_both_at_their_lkg(nc, svc, store, fault, error):
    js = nc.jetstream()
    new = {"config": '{"level": 3}', "motd": "" if fault == "smoke" else "fine"}
    entries = lkg(new)
    if fault == "digest":
        entries[1]["digest"] = digest_of(b"something else")
    o = await approved(js, order(l4(svc, {"artefacts": new}, entries)))
    rev = await manifest_rev(store)

    result, _ = await send(nc, svc, o)
    assert not result.ok and result.error == error
    assert await store.manifest() == seeded()
    assert await manifest_rev(store) == rev
    assert await store.apply_count(o.proposal_id) == 0
    assert not await store.blobs.has(digest_of(new["config"].encode()))  # nothing uploaded


async def test_swap_needs_an_lkg_and_lkg_listing_every_artefact(nc, svc, store):
    js = nc.jetstream()
    contents = {"config": "{}", "brand-new": "x"}
    fresh = await approved(js, order(l4(svc, {"artefacts": contents},
                                        lkg(contents, {**SMOKE, "brand-new": "nonempty"}),
                                        target_ref="lkg:brand-new")))
    result, _ = await send(nc, svc, fresh)
    assert not result.ok and "brand-new: no last-known-good" in result.error
    partial = await approved(js, order(l4(svc, {"artefacts": {"config": "{}", "motd": "x"}},
                                          lkg({"config": "{}"}))))
    result, _ = await send(nc, svc, partial)
    assert not result.ok and "lkg must list exactly" in result.error
    assert await store.manifest() == seeded()


# -- going back ----------------------------------------------------------------------------------


async def test_inverse_applied_as_its_own_order_restores_both(nc, svc, store):
    js = nc.jetstream()
    new = {"config": '{"level": 4}', "motd": "bye"}
    first, _ = await send(nc, svc, await approved(js, order(swap(svc, new))))
    assert first.ok, first.error

    back = await approved(js, order(l4(svc, first.inverse, None)))
    result, _ = await send(nc, svc, back)
    assert result.ok, result.error
    assert await store.manifest() == seeded()
    assert await store.content("motd") == b"hello"
    assert result.inverse == {"restore": {n: digest_of(c.encode()) for n, c in new.items()}}

    # a restore to a digest the store never held is refused
    unknown = await approved(js, order(l4(svc, {"restore": {"motd": digest_of(b"never")}},
                                          None)))
    result, _ = await send(nc, svc, unknown)
    assert not result.ok and "is not held" in result.error
    assert await store.manifest() == seeded()


async def test_operator_rollback_is_accepted_on_the_originals_chain(nc, svc, store):
    js = nc.jetstream()
    original = await approved(js, order(swap(svc, {"config": "[1]", "motd": "v2"})))
    first, _ = await send(nc, svc, original)
    assert first.ok, first.error
    inverse = l4(svc, first.inverse, None, origin=Origin(actor="improved", service="improved"),
                 analyzer=AnalyzerRef(id=ROLLBACK_ANALYZER),
                 summary=Summary(template_id="rollback",
                                 args={"proposal_id": original.proposal_id}),
                 derived_from=[f"mg:sha256:{original.proposal_id}"])
    o = order(inverse)

    result, _ = await send(nc, svc, o)
    assert not result.ok
    assert result.error == (f"not_accepted: no rollback by {OPERATOR} on the audit chain of "
                            f"{original.proposal_id[:8]}")
    await append(js, svc, original.proposal_id, ("applied", OPERATOR), ("rollback", OPERATOR))
    result, _ = await send(nc, svc, o)
    assert result.ok, result.error
    assert await store.manifest() == seeded()


# -- acceptance ----------------------------------------------------------------------------------


@pytest.mark.parametrize("verdicts, authority, why", [
    (None, OPERATOR, "no audit chain for"),
    ((), OPERATOR, f"no approval by {OPERATOR} on the audit chain of"),
    ((("approve", "operator:bob"),), OPERATOR, f"no approval by {OPERATOR}"),
    ((("approve", OPERATOR),), "operator:bob", "no approval by operator:bob"),
    ((("approve", OPERATOR), ("superseded", "improved")), OPERATOR, "withdrawn (superseded)"),
])
async def test_unaccepted_l4_order_is_refused_and_changes_nothing(nc, svc, store, verdicts,
                                                                 authority, why):
    js = nc.jetstream()
    o = order(swap(svc, {"config": "{}", "motd": "unreviewed"}), authority)
    if verdicts is not None:
        await append(js, svc, o.proposal_id, (None, o.proposal.origin.actor), *verdicts)
    rev = await manifest_rev(store)
    result, _ = await send(nc, svc, o)
    assert not result.ok
    assert result.error.startswith("not_accepted: ") and why in result.error, result.error
    assert (await store.manifest(), await manifest_rev(store)) == (seeded(), rev)
    assert await store.apply_count(o.proposal_id) == 0


async def test_acceptance_rules_for_other_classes_and_tampering(nc, svc, store):
    js = nc.jetstream()
    # L0 too: a hand-made order triage never accepted is refused, an accepted one applies
    l0 = order(swap(svc, {"config": "{}", "motd": "x"}, change_class="L0"), "policy:auto")
    assert (await acceptance.check(js, l0)).startswith("not_accepted: no audit chain")
    await append(js, svc, l0.proposal_id, (None, l0.proposal.origin.actor),
                 ("accept", "improved:triage"), gate_class="L0")
    assert await acceptance.check(js, l0) is None
    l1 = order(swap(svc, {"config": "{}", "motd": "x"}, change_class="L1"))
    assert await acceptance.check(js, l1) == "not_accepted: L1 proposals are never applied"

    # an approved id does not carry over to other content
    good = await approved(js, order(swap(svc, {"config": "{}", "motd": "x"})))
    assert await acceptance.check(js, good) is None
    forged = ApplyOrder(proposal_id=good.proposal_id, attempt=1, authority=OPERATOR,
                        proposal=swap(svc, {"config": "{}", "motd": "evil"}))
    assert "is not the content address" in await acceptance.check(js, forged)

    # L3: an active grant for the exact skill, else an operator's approval
    skill = {"name": "summarize", "description": "d", "instructions": "i"}
    l3 = order(l4(svc, {"skill": skill}, None, change_class="L3"), "policy:auto")
    assert (await acceptance.check(js, l3)).startswith("not_accepted: no grant for summarize:")


async def test_a_chain_that_does_not_verify_is_no_evidence(own_server):
    """On a server of its own: a broken chain would put the session daemon in crisis."""
    nc = await connection.connect(own_server.url, "tamper")
    try:
        await Store(nc).ensure()
        js = nc.jetstream()
        svc = "tamper"
        o = order(swap(svc, {"config": "{}", "motd": "y"}))
        await append(js, svc, o.proposal_id, (None, "someone"))
        body = audit.seal_next(audit.Draft("triage", "triage", OPERATOR, "human", "approve",
                                           verdict="approve"), o.proposal_id,
                               ChainHead(length=1, last_hash="0" * 64), "L4", "operation", 1)
        await js.publish(S.audit(svc, o.proposal_id), to_json(body), stream=S.STREAM_AUDIT)
        assert "does not verify" in await acceptance.check(js, o)
    finally:
        await connection.close(nc)


# -- capabilities ----------------------------------------------------------------------------------


async def test_spec_get_answers_capabilities_with_lkg(nc, svc, store):
    reply = msgspec.json.decode((await nc.request(S.service_spec(svc), b"", timeout=5)).data)
    assert reply["service"] == svc and reply["improve"] is True
    assert reply["apply"] == S.apply_request(svc) and reply["lkg"] == S.lkg_request(svc)
    assert reply["conformance"] == "L4"
    assert reply["acceptance"] == "verified on the audit chain"
    assert reply["smoke_tests"] == ["json", "json_schema", "nonempty", "utf8"]
    assert "binary:" in reply["schemes"] and "lkg:" in reply["schemes"]


def test_main_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "--service" in capsys.readouterr().out


# -- supervised artefacts: the health window -------------------------------------------------------

def program(version: str, *, fail: bool = False, grandchild: bool = False) -> str:
    """An artefact that is a Python program: run as `python {path} SEEN`, it appends
    `<version> <pid>` to SEEN, then stays up (or exits 1 at once with `fail`); with
    `grandchild` it first starts a child of its own and appends `child <pid>` too."""
    lines = ["import os, subprocess, sys, time",
             "seen = open(sys.argv[1], 'a')"]
    if grandchild:
        lines += ["child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])",
                  "seen.write(f'child {child.pid}\\n')"]
    lines += [f"seen.write(f'{version} {{os.getpid()}}\\n')", "seen.close()",
              "sys.exit(1)" if fail else "while True: time.sleep(1)"]
    return "\n".join(lines) + "\n"


def seen_lines(seen) -> list[tuple[str, int]]:
    if not seen.exists():
        return []
    return [(v, int(p)) for v, p in (line.split() for line in seen.read_text().splitlines())]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting for a parent that will not reap it."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def running(store: ArtefactStore, seen, version: str, other_than: int = 0) -> int:
    """The pid of the artefact process `store` runs, once it has reported `version` (and is not
    `other_than`)."""

    async def up():
        proc = store.supervision.artefacts["app"].proc
        lines = seen_lines(seen)
        if proc is None or proc.returncode is not None or not lines or proc.pid == other_than:
            return None
        return proc.pid if lines[-1] == (version, proc.pid) else None

    return await eventually(up)


@pytest_asyncio.fixture(loop_scope="session")
async def supervised(nc, svc, tmp_path):
    """Artefact store factory: `app` run as `python {path} <seen>`, seeded with v1 running."""
    made: list[ArtefactStore] = []
    seen = tmp_path / "seen"

    async def make(window: float = 1.0, health: str | None = None) -> ArtefactStore:
        s = ArtefactStore(nc, svc, run={"app": f"{sys.executable} {{path}} {seen}"},
                          health={"app": health} if health else None, health_window=window)
        await s.start()
        await s.seed({"app": program("v1")})
        await running(s, seen, "v1")
        made.append(s)
        return s

    make.seen = seen  # type: ignore[attr-defined]
    yield make
    for s in made:
        await s.stop()
    await dropped(nc, svc)


def app_swap(svc: str, content: str) -> Proposal:
    return l4(svc, {"artefacts": {"app": content}}, lkg({"app": content}, {"app": "nonempty"}))


async def test_a_healthy_swap_restarts_the_artefact_on_the_new_content(nc, svc, supervised):
    store = await supervised(window=1.0)
    seen = supervised.seen
    v1_pid = (await running(store, seen, "v1"))
    o = await approved(nc.jetstream(), order(app_swap(svc, program("v2"))))
    result, raw = await send(nc, svc, o)
    assert result.ok, result.error
    assert result.inverse == {"restore": {"app": digest_of(program("v1").encode())}}
    # the answer came after the restart and the window: v2 runs, v1 does not
    v2_pid = await running(store, seen, "v2")
    assert v2_pid != v1_pid and not alive(v1_pid) and alive(v2_pid)
    path = store.supervision.artefacts["app"].path
    assert path.read_text() == program("v2") and path.parent == store.supervision.workdir
    entry, _ = await kv_service.read_json(store.ledger, o.proposal_id)
    assert entry["health"] == "ok"
    again, raw_again = await send(nc, svc, o)
    assert (again, raw_again) == (result, raw)
    # a repeated order restarts nothing
    assert store.supervision.artefacts["app"].proc.pid == v2_pid

    # the inverse, applied as its own order, restarts the artefact on v1 under the same window
    back = await approved(nc.jetstream(), order(l4(svc, result.inverse, None)))
    restored, _ = await send(nc, svc, back)
    assert restored.ok, restored.error
    assert await store.manifest() == {"app": digest_of(program("v1").encode())}
    assert await running(store, seen, "v1") not in (v1_pid, v2_pid) and not alive(v2_pid)


@pytest.mark.parametrize("case", ["crash", "health"])
async def test_an_unhealthy_swap_is_rolled_back_to_the_last_known_good(nc, svc, supervised,
                                                                       case):
    check = (f"{sys.executable} -c \"import os, sys; "
             "sys.exit(0 if 'v1' in open(os.environ['ARTEFACT_PATH']).read() else 3)\"")
    store = await supervised(window=2.0, health=check if case == "health" else None)
    seen = supervised.seen
    v1 = digest_of(program("v1").encode())
    rev = await manifest_rev(store)
    new = program("v3", fail=True) if case == "crash" else program("v3")
    o = await approved(nc.jetstream(), order(app_swap(svc, new)))
    result, raw = await send(nc, svc, o)
    why = ("exited with code 1 within the 2s health window" if case == "crash" else
           "health command exited with code 3")
    assert (result.ok, result.error) == (
        False, f"artefact app unhealthy after the swap: {why}; rolled back, app is back at {v1}")
    assert result.inverse is None and not result.applied_id
    # the manifest is back at the LKG (a second write on top of the swap) and v1 runs again
    assert await store.manifest() == {"app": v1}
    assert await manifest_rev(store) == rev + 2
    pid = await running(store, seen, "v1")
    assert [v for v, _ in seen_lines(seen)] == ["v1", "v3", "v1"]
    assert store.supervision.artefacts["app"].path.read_text() == program("v1")
    entry, _ = await kv_service.read_json(store.ledger, o.proposal_id)
    assert (entry["health"], entry["revision"], entry["rollback_revision"]) == (
        "failed", rev + 1, rev + 2)
    # a redelivered order gets the same answer and changes nothing
    again, raw_again = await send(nc, svc, o)
    assert (again, raw_again) == (result, raw)
    assert await manifest_rev(store) == rev + 2
    assert store.supervision.artefacts["app"].proc.pid == pid
    assert await store.apply_count(o.proposal_id) == 1


async def test_a_process_that_dies_later_is_restarted_and_a_broken_restore_rolled_back(
        nc, svc, supervised):
    """Outside a window the store keeps the artefact running; and going back is checked like
    going forward: a restore to a version that crashes leaves the current one in place."""
    store = await supervised(window=1.5)
    seen = supervised.seen
    v1_pid = await running(store, seen, "v1")
    os.kill(v1_pid, signal.SIGKILL)
    await running(store, seen, "v1", other_than=v1_pid)  # restarted, on the same content

    # a broken version installed by hand (outside the loop), then a healthy swap from it
    await store.seed({"app": program("v0", fail=True)})
    broken = digest_of(program("v0", fail=True).encode())
    first, _ = await send(nc, svc, await approved(nc.jetstream(),
                                                  order(app_swap(svc, program("v2")))))
    assert first.ok, first.error
    assert first.inverse == {"restore": {"app": broken}}
    await running(store, seen, "v2")
    back, _ = await send(nc, svc, await approved(nc.jetstream(),
                                                 order(l4(svc, first.inverse, None))))
    v2 = digest_of(program("v2").encode())
    assert (back.ok, back.error) == (False, "artefact app unhealthy after the restore: exited "
                                     "with code 1 within the 1.5s health window; rolled back, "
                                     f"app is back at {v2}")
    assert await store.manifest() == {"app": v2}
    await running(store, seen, "v2")


async def test_an_interrupted_health_window_is_finished_by_the_next_order(nc, svc, supervised):
    """A crash between the swap and the verdict: the ledger says pending; the repeated order
    takes the health window then, and rolls back."""
    store = await supervised(window=1.0)
    seen = supervised.seen
    v1 = digest_of(program("v1").encode())
    o = await approved(nc.jetstream(), order(app_swap(svc, program("v4", fail=True))))
    real = store._settle
    calls = 0

    async def crash_once(*args):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("crashed before the verdict")
        return await real(*args)

    store._settle = crash_once  # type: ignore[method-assign]
    first, _ = await send(nc, svc, o)
    assert not first.ok and "crashed before the verdict" in first.error  # "not now"
    entry, _ = await kv_service.read_json(store.ledger, o.proposal_id)
    assert entry["health"] == "pending" and entry["revision"] is not None
    result, _ = await send(nc, svc, o)
    assert not result.ok and result.error.endswith(f"rolled back, app is back at {v1}")
    assert await store.manifest() == {"app": v1}
    await running(store, seen, "v1")


async def test_stopping_the_store_leaves_no_process_and_no_workdir(nc, svc, supervised):
    store = await supervised(window=1.0)
    seen = supervised.seen
    o = await approved(nc.jetstream(), order(app_swap(svc, program("v5", grandchild=True))))
    result, _ = await send(nc, svc, o)
    assert result.ok, result.error
    pid = await running(store, seen, "v5")
    child = dict(seen_lines(seen))["child"]
    assert alive(pid) and alive(child)
    workdir = store.supervision.workdir
    await store.stop()
    assert not alive(pid) and not alive(child)
    assert not workdir.exists() and store.supervision.artefacts == {}


@pytest.mark.parametrize("flags, error", [
    (["--run", "app"], "--run 'app': expected NAME=COMMAND"),
    (["--run", "app="], "--run 'app=': expected NAME=COMMAND"),
    (["--run", "app=python {path}", "--run", "app=true"], "--run app: given twice"),
    (["--run", 'app=python "{path}'], "--run app: cannot split"),
    (["--health", "app=true"], "--health app: artefact app has no --run command"),
    (["--run", "app=true", "--health-window", "0"], "--health-window 0: must be more than 0"),
    (["--run", "app=true", "--health-window", "soon"], "--health-window 'soon': expected"),
])
def test_bad_runner_flags_are_one_line_errors(capsys, flags, error):
    assert main(["--service", "deploy", "--nats", "nats://127.0.0.1:1", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"artefact store: {error}") and err.count("\n") == 1, err
