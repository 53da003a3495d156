"""The reference doc store against a real nats-server: an edit applied only on the allowlist
and on the head it was made against, exactly once, with a reverse diff that replays; hostile
orders refused with nothing changed; and apply + rollback through the real daemon."""

from __future__ import annotations

import pytest
import pytest_asyncio

from improved import testing
from improved.client.sdk import MeshClient
from improved.core import propose
from improved.protocol import subjects
from improved.protocol.model import (
    ApplyOrder,
    Origin,
    Proposal,
    ProposalEdit,
)
from improved_reference import diffs
from improved_reference.doc_store import DocStore, bucket_names, digest, doc_key, main
from tests.bus import (
    crash_once_after_the_write,
    eventually,
    kv_revisions,
    publish,
    rolled_back,
    send,
    serving,
    trailers,
)
from tests.factories import review

GUIDE = "docs/guide.md"
V1 = "# Guide\n\nRun `improved demo`.\n"
V2 = "# Guide\n\nRun `improved demo` to see the loop.\n"


def edit(svc: str, old: str, new: str, path: str = GUIDE, *, target: str | None = None,
         base: str | None = None, diff: str | None = None) -> Proposal:
    return testing.proposal(
        svc, target or f"doc:{path}", template="edit_doc", analyzer="acme.docs/1",
        actor=f"mcp:{svc}-writer:1",
        proposal_edit=ProposalEdit(format="unified", base_digest=base or digest(old),
                                   diff=diff if diff is not None else diffs.make(old, new, path)))


def undo(svc: str, inverse: dict, path: str = GUIDE) -> Proposal:
    return testing.proposal(svc, f"doc:{path}", template="rollback",
                            analyzer="improved.rollback/1",
                            origin=Origin(actor="improved", service="improved"),
                            proposal_data=inverse)


def order(p: Proposal, attempt: int = 1) -> ApplyOrder:
    pid, _ = propose.identify(p)
    return ApplyOrder(proposal_id=pid, proposal=p, authority="operator:alice", attempt=attempt)


@pytest_asyncio.fixture(loop_scope="session")
async def store(nc, svc):
    async with serving(nc, DocStore(nc, svc), bucket_names(svc)) as s:
        await s.put(GUIDE, V1)
        yield s


async def revisions(nc, svc: str, path: str = GUIDE) -> int:
    return await kv_revisions(nc, bucket_names(svc)[0], doc_key(path))


async def test_an_edit_applies_once_and_its_inverse_replays(nc, svc, store):
    o = order(edit(svc, V1, V2))
    first, first_bytes = await send(nc, svc, o)
    assert first.ok and first.rollbackable, first.error
    assert first.applied_id == f"doc:{GUIDE}@{digest(V2)}"
    assert await store.document(GUIDE) == V2
    assert first.inverse["edit"]["base_digest"] == digest(V2)
    _, again = await send(nc, svc, order(o.proposal, attempt=2))
    assert again == first_bytes and await revisions(nc, svc) == 2  # the seed, the edit
    back, _ = await send(nc, svc, order(undo(svc, first.inverse)))
    assert back.ok and await store.document(GUIDE) == V1
    forth, _ = await send(nc, svc, order(undo(svc, back.inverse)))
    assert forth.ok and await store.document(GUIDE) == V2
    assert store.applies == 3


async def test_a_diff_from_dev_null_creates_a_document(nc, svc, store):
    result, _ = await send(nc, svc, order(edit(svc, "", "# New\n", "docs/new.md")))
    assert result.ok and await store.document("docs/new.md") == "# New\n"
    back, _ = await send(nc, svc, order(undo(svc, result.inverse, "docs/new.md")))
    assert back.ok and await store.document("docs/new.md") is None


async def test_crash_after_the_write_adopts_it_without_writing_again(nc, svc, store):
    crash_once_after_the_write(store)
    o = order(edit(svc, V1, V2))
    crashed, _ = await send(nc, svc, o)
    assert not crashed.ok and "crashed after the write" in crashed.error
    result, _ = await send(nc, svc, o)
    assert result.ok and await store.document(GUIDE) == V2
    assert await revisions(nc, svc) == 2 and store.applies == 1


# -- hostile bus participants: refused, nothing changed ---------------------------------------------


async def unchanged(nc, svc, store) -> None:
    assert await store.document(GUIDE) == V1 and await revisions(nc, svc) == 1
    assert store.applies == 0


async def test_a_stale_base_digest_is_refused_as_the_document_having_moved(nc, svc, store):
    result, _ = await send(nc, svc, order(edit(svc, "# Old guide\n", V2)))
    assert not result.ok and result.error.startswith("the document moved")
    assert digest(V1) in result.error
    await unchanged(nc, svc, store)


async def test_a_late_rollback_over_a_later_edit_is_refused(nc, svc, store):
    first, _ = await send(nc, svc, order(edit(svc, V1, V2)))
    v3 = V2 + "\nMore.\n"
    assert (await send(nc, svc, order(edit(svc, V2, v3))))[0].ok
    late, _ = await send(nc, svc, order(undo(svc, first.inverse)))
    assert not late.ok and "the document moved" in late.error
    assert await store.document(GUIDE) == v3


@pytest.mark.parametrize(("path", "why"), [
    ("src/main.py", "is not on this store's allowlist"),
    ("../docs/guide.md", "climbs above the document root"),
    ("docs/../../etc/passwd.md", "climbs above the document root"),
    ("/etc/motd.md", "must be relative"),
])
async def test_a_path_off_the_allowlist_or_above_the_root_is_refused(nc, svc, store, path, why):
    result, _ = await send(nc, svc, order(edit(svc, "", "x\n", path)))
    assert not result.ok and why in result.error
    await unchanged(nc, svc, store)


@pytest.mark.parametrize(("over", "why"), [
    ({"diff": diffs.make(V1, V2, "docs/other.md")}, "the diff edits 'docs/other.md'"),
    ({"diff": diffs.make(V1, V2, "../guide.md")}, "the diff edits '../guide.md'"),
    ({"diff": diffs.make(V1, V2, GUIDE) + diffs.make("", "x\n", "docs/b.md")}, "2 patches"),
    ({"diff": "--- a/docs/guide.md\n+++ b/docs/guide.md\n@@ -9 +9 @@\n-x\n+y\n"},
     "does not apply"),
    ({"diff": "not a diff"}, "does not parse"),
    ({"target": "rank:x"}, "unsupported target scheme"),
])
async def test_a_diff_that_is_not_this_documents_edit_is_refused(nc, svc, store, over, why):
    result, _ = await send(nc, svc, order(edit(svc, V1, V2, **over)))
    assert not result.ok and why in result.error
    await unchanged(nc, svc, store)


async def test_a_forged_order_is_refused_when_the_store_verifies_acceptance(daemon, nc, svc):
    store = DocStore(nc, svc, verify_acceptance=True)
    await store.start()
    try:
        await store.put(GUIDE, V1)
        result, _ = await send(nc, svc, order(edit(svc, V1, V2)))
        assert not result.ok and result.error.startswith("not_accepted:")
        await unchanged(nc, svc, store)
        assert store.capabilities()["conformance"] == "L3"
    finally:
        await store.stop()


def test_main_help_and_a_bad_seed(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "--allow" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["--service", "d", "--seed", f"{GUIDE}={tmp_path / 'missing.md'}"])
    assert exit_.value.code == 2 and "cannot read" in capsys.readouterr().err


# -- through the daemon: approved, applied, rolled back by its inverse ---------------------------


async def test_an_approved_edit_is_applied_and_rolled_back_through_the_daemon(daemon, nc, svc,
                                                                               store):
    """The daemon's default doc allowlist lets a docs/ edit through; the store checks the base
    and hands back the reverse diff, which the operator's rollback replays."""
    client = MeshClient(nc, svc)
    pid = (await client.propose(edit(svc, V1, V2))).proposal_id
    decision = await eventually(lambda: client.decision(pid))
    assert decision.cause == "awaiting_operator", decision.rationale
    await publish(nc, subjects.inbound_review(svc), review(pid))
    out = await eventually(lambda: client.outcome(pid))
    assert out.ok and out.rollbackable and await store.document(GUIDE) == V2
    await rolled_back(nc, client, svc, pid, "the old wording was clearer")
    assert await store.document(GUIDE) == V1
    assert (await trailers(daemon, svc, pid))[-1]["verdict"] == "rolled_back"


async def test_a_document_overwritten_in_kv_by_someone_else_is_not_edited(nc, svc, store):
    kv = await nc.jetstream().key_value(bucket_names(svc)[0])
    await kv.put(doc_key(GUIDE), b"raw text, not this store's record")
    result, _ = await send(nc, svc, order(edit(svc, V1, V2)))
    assert not result.ok and "holds a value this store did not write" in result.error
    assert store.applies == 0
