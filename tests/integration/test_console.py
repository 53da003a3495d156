"""`improved console` against the real broker and the session daemon, over HTTP: the queue, a
proposal's page with its timeline and verified chain, the audit log's status; read-only
without a key; with ALICE's key an approval signed and published as `improved approve` does,
only with this process's CSRF token; hostile fields rendered inert; a busy port one line.
The readable `show`/`review` views are checked here too, on a hostile proposal."""

from __future__ import annotations

import asyncio
import socket

import pytest

from improved.client.sdk import MeshClient
from improved.protocol.model import Summary
from improved.runtime.store import Store
from tests.bus import eventually
from tests.cli import improved
from tests.console import alice_pem, csrf_of, fetch, running
from tests.factories import skill_proposal

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
        status, queue = await get(base)
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
        assert status == 200 and "chains verified" in audit

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
