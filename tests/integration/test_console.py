"""`improved console` against the real broker and the session daemon, over HTTP: every
proposal on the front page, filtered and paged; the queue, a proposal's page with its timeline
and verified chain, the mesh's state, the audit log verified since the last checkpoint on each
load and whole on request, in the background, with no path of the host on a page; read-only
without a key; with ALICE's key an approval signed and published as `improved approve` does,
only with this process's CSRF token; hostile fields rendered inert; a busy port one line.
The readable `show`/`review` views are checked here too, on a hostile proposal."""

from __future__ import annotations

import asyncio
import html
import socket

import pytest

from improved.client.sdk import MeshClient
from improved.protocol.model import ApplyResult, Summary
from improved.runtime.store import Store
from tests.bus import eventually, own_daemon
from tests.cli import improved
from tests.console import alice_pem, csrf_of, fetch, running, verdict_of
from tests.factories import rank_proposal, skill_proposal

pytestmark = pytest.mark.asyncio(loop_scope="session")

SCRIPT = "<script>alert('pwned')</script>"


def hostile(svc: str):
    """A proposal whose free-text fields carry markup and an escape sequence."""
    return skill_proposal(svc, instructions=f"{SCRIPT}\x1b[2J\"><img src=x onerror=alert(1)>",
                          summary=Summary(template_id="new_skill", args={"name": SCRIPT}))


async def _proposed(nc, svc: str, proposal) -> str:
    client = MeshClient(nc, svc)
    pid = await client.publish(proposal)
    await eventually(lambda: client.decision(pid))
    return pid


def get(url: str, **kw):
    return asyncio.to_thread(fetch, url, **kw)


async def test_the_console_shows_the_queue_a_proposal_and_the_log_read_only(
        daemon, nc, svc, nats_url, tmp_path):
    first = await _proposed(nc, svc, skill_proposal(svc))
    pid = await _proposed(nc, svc, hostile(svc))
    with running(nats_url, tmp_path, daemon.config.checkpoint_key) as base:
        status, queue = await get(f"{base}queue")
        assert status == 200 and "<table id=queue>" in queue
        assert f'<a class=proposal href="/p/{pid}">{pid[:12]}</a>' in queue
        assert f"/p/{first}" not in queue  # superseded by the hostile one: not waiting
        assert "read-only (no operator key)" in queue
        assert "<script>" not in queue and "&lt;script&gt;alert(&#x27;pwned&#x27;)" in queue

        status, page = await get(f"{base}p/{pid[:12]}")  # a prefix names it, as on the CLI
        assert status == 200
        assert '<p id=chain class=ok>VERIFIED: hashes, links, daemon signatures and signed ' \
            'acts, against daemon key ' in page
        assert "<script" not in page and "<img" not in page and "\x1b" not in page
        assert "\\u001b[2J" in page  # the escape sequence shown (as JSON), not obeyed
        assert f"as a diff against {first[:12]}, which it superseded" in page
        assert "<form" not in page  # read-only: nothing to sign with
        chain = [body for _, body in await Store(nc).read_chain(svc, pid)]
        timeline = page.split("<table id=timeline>", 1)[1]
        positions = [timeline.index(body["hash"]) for body in chain]
        assert positions == sorted(positions) and len(chain) >= 2  # every trailer, in order
        assert "defer/awaiting_operator" in timeline

        status, refused = await get(f"{base}p/{pid}/approve", form={"reason": "x",
                                                                     "csrf": "anything"})
        assert status == 403 and "started without an operator key" in refused

        status, audit = await get(f"{base}audit")
        assert status == 200 and "<p id=since class=" in audit  # the shared log's verdict

        status, missing = await get(f"{base}p/{'f' * 64}")
        assert status == 404 and "no proposal" in missing
        status, _ = await get(f"{base}nope")
        assert status == 404
        status, _ = await get(base, headers={"Host": "rebound.example:80"})
        assert status == 421  # a page from another origin cannot read it through DNS


async def test_an_operator_approves_from_the_console_with_its_token_only(
        daemon, nc, svc, nats_url, tmp_path):
    pid = await _proposed(nc, svc, skill_proposal(svc))
    key = alice_pem(tmp_path)
    with running(nats_url, tmp_path, daemon.config.checkpoint_key, "--key", str(key),
                 "--principal", "operator:alice") as base:
        status, page = await get(f"{base}p/{pid}")
        assert status == 200 and "signing as operator:alice" in page
        token = csrf_of(page)
        assert f'action="/p/{pid}/approve"' in page and f'action="/p/{pid}/reject"' in page

        for form in ({"reason": "read it"}, {"reason": "read it", "csrf": token[:-1] + "x"}):
            status, refused = await get(f"{base}p/{pid}/approve", form=form)
            assert status == 403 and "CSRF token" in refused
        status, bare = await get(f"{base}p/{pid}/approve", form={"reason": " ", "csrf": token})
        assert status == 400 and "give a reason" in bare
        chain = [body for _, body in await Store(nc).read_chain(svc, pid)]
        assert not any(b.get("verdict") == "approve" for b in chain)  # nothing was signed

        status, done = await get(f"{base}p/{pid}/approve",
                                 form={"reason": "read it in the console", "csrf": token})
        assert status == 200, done
        assert f"accepted: approve of {pid} signed by operator:alice" in done
        chain = [body for _, body in await Store(nc).read_chain(svc, pid)]
        approvals = [b for b in chain if b.get("verdict") == "approve"]
        assert [b["actor"] for b in approvals] == ["operator:alice"]
        assert approvals[0]["envelope"]["signatures"]  # the signed act rides on the chain

        status, after = await get(f"{base}p/{pid}")
        assert "approve by operator:alice" in after and "<form" not in after


async def applied_and_waiting(nc, svc: str) -> tuple[str, str]:
    """An L0 applied (by an owning service that applies every order) and, after it, an L2
    waiting for an operator: (the L0's id, the L2's id)."""
    client = MeshClient(nc, svc)

    async def applier(order) -> ApplyResult:
        return ApplyResult(ok=True, applied_id="x", inverse={"delete": "x"}, rollbackable=True)

    sub = await client.serve_apply(applier)
    try:
        l0 = (await client.propose(rank_proposal(svc, key="front"))).proposal_id
        assert (await eventually(lambda: client.outcome(l0), timeout=15)).ok
    finally:
        await sub.unsubscribe()
    return l0, await _proposed(nc, svc, skill_proposal(svc))


async def test_the_front_page_lists_every_proposal_filtered_and_paged(
        daemon, nc, svc, nats_url, tmp_path):
    l0, l2 = await applied_and_waiting(nc, svc)
    with running(nats_url, tmp_path, daemon.config.checkpoint_key) as base:
        status, front = await get(f"{base}?service={svc}")
        assert status == 200, front
        rows = front.split("<table id=proposals>", 1)[1].split("</table>", 1)[0]
        assert rows.index(f'href="/p/{l2}"') < rows.index(f'href="/p/{l0}"')  # newest first
        assert "<td class=status>applied</td>" in rows and "<td class=status>pending</td>" in rows
        assert "1–2 of 2" in front and 'href="/queue"' in front
        assert "breaker" in front and "no crisis" in front  # the mesh in one line

        _, applied = await get(f"{base}?service={svc}&status=applied")
        assert f"/p/{l0}" in applied and f"/p/{l2}" not in applied
        _, l2s = await get(f"{base}?service={svc}&class=L2")
        assert f"/p/{l2}" in l2s and f"/p/{l0}" not in l2s
        _, none = await get(f"{base}?service={svc}&status=rejected")
        assert "No proposal matches." in none

        _, first = await get(f"{base}?service={svc}&n=1")
        assert f"/p/{l2}" in first and f"/p/{l0}" not in first and "id=newer" not in first
        older = first.split('id=older', 1)[0].rsplit('href="', 1)[1].split('"', 1)[0]
        assert older == f"/?service={svc}&amp;page=2&amp;n=1"
        _, second = await get(base.rstrip("/") + older.replace("&amp;", "&"))
        assert f"/p/{l0}" in second and f"/p/{l2}" not in second
        assert "id=newer" in second and "id=older" not in second

        for bad, says in (("status=done", "no status 'done'"), ("class=L9", "no class 'L9'"),
                          ("service=A.b", "no service can be named 'A.b'"),
                          ("page=0", "page must be a whole number from 1 to")):
            status, page = await get(f"{base}?{bad}")
            assert status == 400 and says in html.unescape(page), bad


async def test_the_mesh_page_shows_the_state_and_the_trusted_daemon_key(
        daemon, nats_url, tmp_path):
    from improved.client.keys import load_key
    from improved.core import signing

    keyid = signing.keyid_of(signing.raw_public(
        load_key(daemon.config.checkpoint_key).public_key()))
    with running(nats_url, tmp_path, daemon.config.checkpoint_key) as base:
        status, mesh = await get(f"{base}mesh")
    assert status == 200, mesh
    assert "<span id=crisis class=ok>none</span>" in mesh
    assert "<span id=breaker>closed</span>" in mesh
    assert "<span id=autonomy>" in mesh and "<span id=autonomy-chain>" in mesh
    assert f"<ul id=daemons><li><code>{keyid}</code></li></ul>" in mesh
    assert "operator:alice" not in mesh or "<div id=keys>" in mesh
    assert "<span id=checkpoint" in mesh


async def test_the_audit_page_verifies_since_the_checkpoint_and_the_whole_log_on_request(
        own_server, tmp_path):
    async with own_daemon(own_server, tmp_path, "console-audit") as (nc, daemon):
        svc = "audited"
        for i in range(3):
            await _proposed(nc, svc, skill_proposal(svc, name=f"before{i}"))
        assert await daemon.engine.checkpoints.checkpoint(daemon._checkpoint_key) is None
        await _proposed(nc, svc, skill_proposal(svc, name="after"))
        with running(own_server.url, tmp_path, daemon.config.checkpoint_key) as base:
            status, audit = await get(f"{base}audit")
            assert status == 200, audit
            assert verdict_of(audit, "since") == "VERIFIED"
            assert "trailers after the checkpoint of" in audit
            assert "id=full-verify" in audit and "Not run from this console yet" in audit
            assert str(tmp_path) not in audit and "/data" not in audit

            status, refused = await get(f"{base}audit/verify", form={"csrf": "forged"})
            assert status == 403 and "CSRF token" in refused
            assert "Not run from this console yet" in (await get(f"{base}audit"))[1]

            status, started = await get(f"{base}audit/verify", form={"csrf": csrf_of(audit)})
            assert status == 200  # redirected to the audit page

            async def done():
                page = (await get(f"{base}audit"))[1]
                return page if "id=full-lines" in page else None

            finished = await eventually(done, timeout=60, interval=0.5)
    assert verdict_of(finished, "full") == "VERIFIED"
    assert "chains verified" in finished and "checkpoint file the data directory" in finished
    assert str(tmp_path) not in finished


async def test_the_readable_views_on_a_hostile_proposal(daemon, nc, svc, nats_url):
    pid = await _proposed(nc, svc, hostile(svc))
    shown = await asyncio.to_thread(improved, "show", "--nats", nats_url, pid, "--format",
                                    "text")
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and "\\u001b[2J" in shown.stdout
    assert "  waits for an operator's signed approval" in shown.stdout
    assert "  class     L2, gated L2" in shown.stdout
    piped = await asyncio.to_thread(improved, "show", "--nats", nats_url, pid)
    assert piped.stdout.startswith("{\n")  # to a pipe: the JSON it always printed
    queue = await asyncio.to_thread(improved, "review", "--nats", nats_url)
    mine = queue.stdout.split(pid, 1)[1].split("decide:", 1)[0]
    assert "waits for an operator's signed approval" in mine and "\x1b" not in queue.stdout


async def test_a_busy_port_is_one_line_and_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = await asyncio.to_thread(improved, "console", "--port", str(port), "--nats",
                                         "nats://127.0.0.1:1")
    assert result.returncode == 2
    assert result.stderr == (f"improved console: port {port} on 127.0.0.1 is taken: stop what "
                             "listens there or give another --port\n")


async def test_no_broker_is_one_line_and_exit_2():
    from improved.runtime import bus

    result = await asyncio.to_thread(improved, "console", "--port", "0", "--nats",
                                     f"nats://127.0.0.1:{bus.free_port()}")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("improved: cannot reach NATS at nats://127.0.0.1:")
    assert len(result.stderr.splitlines()) == 1


async def test_a_forged_retained_state_is_listed_as_a_hint_and_offers_nothing_to_sign(
        daemon, nc, svc, nats_url, tmp_path):
    """Anyone on the open bus may write a retained state: the front page lists what the
    records say, but the proposal's page reads its chain, so a made-up waiting proposal gets
    no approval form, and an approval posted for it signs and publishes nothing."""
    import msgspec

    from improved.protocol import subjects as S
    from improved.protocol.model import to_json

    real = await _proposed(nc, svc, skill_proposal(svc))
    state = await eventually(lambda: MeshClient(nc, svc).state(real))
    fake = "f" * 64
    await nc.jetstream().publish(S.proposal_state(svc, fake), to_json(
        msgspec.structs.replace(state, proposal_id=fake)))
    key = alice_pem(tmp_path)
    with running(nats_url, tmp_path, daemon.config.checkpoint_key, "--key", str(key),
                 "--principal", "operator:alice") as base:
        status, front = await get(f"{base}?service={svc}")
        assert status == 200 and fake[:12] in front  # a hint, as the records say
        status, page = await get(f"{base}p/{fake}")
        assert f'action="/p/{fake}/approve"' not in page
        token = csrf_of((await get(f"{base}p/{real}"))[1])
        status, refused = await get(f"{base}p/{fake}/approve",
                                    form={"reason": "looks fine", "csrf": token})
        assert status >= 400 and "accepted" not in refused and "Traceback" not in refused, refused
    assert await Store(nc).read_chain(svc, fake) == []  # nothing reached the loop
