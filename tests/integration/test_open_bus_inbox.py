"""On the embedded open bus only the server answers the daemon. Anyone there may subscribe to
`improve.audit.>` and `$JS.API.>`, and so sees every append the daemon makes and every API
request it sends, each with its reply subject; on a bus with no users the first to answer
one wins. `improved run` therefore gives its open server two users (`runtime.open_bus`): the
daemon, and `anyone` — every client without credentials — which may not publish or subscribe
under the daemon's inbox prefix. The attacker here answers every reply subject it sees (but
its own service's) with a made-up acknowledgement, the form that, with no users, stops the
daemon serving (it is delivered into its consumer's fetch)."""

from __future__ import annotations

import json
import signal as signals

import nats
import pytest

from improved.client.answers import DAEMON_INBOX
from improved.client.sdk import MeshClient
from improved.runtime import bus
from improved_reference.ranking_store import RankingStore
from tests.bus import eventually
from tests.cli import improved
from tests.factories import rank_proposal
from tests.integration.test_embedded_broker import started

pytestmark = pytest.mark.asyncio(loop_scope="session")

SVC = "openinbox"
SERVICE_INBOX = "_INBOX_openinbox"  # the service's own prefix, so the attacker spares it


async def test_no_one_but_the_server_answers_the_daemon_on_the_open_bus(tmp_path):
    port = bus.free_port()
    # a checkpoint every second: the daemon's reads of the log (`client.pulls`) pull while the
    # attacker listens
    config = tmp_path / "improved.toml"
    config.write_text("checkpoint_interval_s = 1\n")
    daemon = started(tmp_path / "data", port, "--config", str(config))
    url = f"nats://127.0.0.1:{port}"
    refused: list[str] = []
    forged: list[str] = []
    asked: list[str] = []  # the subjects of the requests answered

    async def violation(exc: Exception) -> None:
        refused.append(str(exc))

    evil = await nats.connect(url, error_cb=violation)
    nc = await nats.connect(url, inbox_prefix=SERVICE_INBOX)
    store = RankingStore(nc, SVC)
    try:
        await store.start()

        async def answer_first(msg) -> None:
            if msg.reply and not msg.reply.startswith(SERVICE_INBOX):
                forged.append(msg.reply)
                asked.append(msg.subject)
                await evil.publish(msg.reply, json.dumps(
                    {"stream": "IMPROVE_AUDIT", "seq": 1}).encode())

        for subject in ("improve.audit.>", "$JS.API.>"):
            await evil.subscribe(subject, cb=answer_first)
        overheard: list[str] = []

        async def overhear(msg) -> None:
            overheard.append(msg.subject)

        await evil.subscribe(">", cb=overhear)
        await evil.flush()

        pid = (await MeshClient(nc, SVC).propose(rank_proposal(SVC, key="inbox.boost",
                                                               value=2.0))).proposal_id

        async def applied():
            state = await MeshClient(nc, SVC).state(pid)
            return state is not None and state.status == "applied"

        await eventually(applied, 15, what="the L0 applied with every reply forged")
        await eventually(lambda: _true(len(refused) >= len(forged) > 0), 5,
                         what="each forged answer refused by the server")
        assert all(reply.startswith(DAEMON_INBOX + ".") for reply in forged), forged
        # among them the inbound consumer's pull, whose inbox the deliveries come into: a
        # made-up message there is refused by the server like every other forged answer
        pull = "$JS.API.CONSUMER.MSG.NEXT.IMPROVE_IN.improved-loop"
        await eventually(lambda: _true(pull in asked), 10, what="a pull request answered")
        # and the pull of the checkpoint's read of the log, which the L0 appended to: made-up
        # deliveries there would be trailers the daemon checks and signs a checkpoint over
        read = "$JS.API.CONSUMER.MSG.NEXT.IMPROVE_AUDIT."
        await eventually(lambda: _true(any(s.startswith(read) for s in asked)), 10,
                         what="a pull of the log answered")
        await eventually(lambda: _true(len(refused) >= len(forged)), 5,
                         what="those answers refused too")
        assert all(reply.startswith(DAEMON_INBOX + ".") for reply in forged), forged
        assert daemon.poll() is None, "the daemon stopped serving"
        assert all("permissions violation" in line for line in refused), refused
        # what the server says on the daemon's inboxes reaches no one else either
        assert not [s for s in overheard if s.startswith(DAEMON_INBOX)], overheard
        assert daemon.poll() is None, "the daemon stopped serving"
        verified = improved("audit", "verify", "--data-dir", str(tmp_path / "data"),
                            "--nats", url)
        assert verified.returncode == 0 and "VERIFIED" in verified.stdout, verified.stdout
        # the daemon's password stays with the data directory, owner only
        pw = tmp_path / "data" / "open-bus" / "improved.pw"
        assert pw.stat().st_mode & 0o077 == 0
        assert pw.read_text().strip() not in daemon_log(tmp_path)
    finally:
        await store.stop()
        await nc.close()
        await evil.close()
        daemon.send_signal(signals.SIGTERM)
        daemon.wait(20)


async def _true(value: bool) -> bool:
    return value


def daemon_log(tmp_path) -> str:
    log = tmp_path / "data" / "nats-server.log"
    return log.read_text() if log.exists() else ""

