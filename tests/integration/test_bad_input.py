"""Bad input over the real bus: a clear error naming the problem, nothing stored, and the daemon
keeps serving."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from improved.client.sdk import MeshClient
from improved.protocol import subjects as S
from improved.protocol.model import ApplyOrder, to_json
from tests.bus import chain_ids, eventually, trailers, trusted_service
from tests.factories import rank_proposal, signal

pytestmark = pytest.mark.asyncio(loop_scope="session")


def good(svc: str) -> dict:
    return msgspec.to_builtins(rank_proposal(svc))


def cases(svc: str) -> list[tuple[str, bytes, str, str | None]]:
    """(name, bytes, expected code, expected field)."""
    base = good(svc)
    return [
        ("malformed JSON", b'{"service": ', "invalid_json", None),
        ("not an object", b"[1, 2]", "invalid_type", None),
        ("wrong type", json.dumps({**base, "created_at": "yesterday"}).encode(),
         "invalid_type", "created_at"),
        ("nested wrong type", json.dumps({**base, "origin": {"actor": 5, "service": svc}})
         .encode(), "invalid_type", "origin.actor"),
        ("missing field", json.dumps({k: v for k, v in base.items() if k != "analyzer"})
         .encode(), "missing_field", "analyzer"),
        ("two bodies", json.dumps({**base, "proposal_cal": 'ADD fact SET subject "x" '
                                   'REASON "y"'}).encode(), "body_count", "proposal_data"),
        ("no body", json.dumps({k: v for k, v in base.items() if k != "proposal_data"})
         .encode(), "body_count", "proposal_cal"),
        ("over the limit", json.dumps({**base, "proposal_data": {"blob": "x" * 300_000}})
         .encode(), "too_large", None),
        ("subject disagrees", json.dumps({**base, "service": "someone-else"}).encode(),
         "subject_mismatch", "service"),
        ("forged status", json.dumps({**base, "status": "applied"}).encode(),
         "status_forbidden", "status"),
        ("invalid UTF-8", b'{"service": "\xff\xfe"}', "invalid_json", None),
        ("bad class", json.dumps({**base, "change_class": "L9"}).encode(),
         "invalid_value", "change_class"),
    ]


async def test_every_bad_proposal_gets_an_error_naming_the_problem(daemon, nc, svc):
    client = MeshClient(nc, svc)
    for name, data, code, field in cases(svc):
        reply = await client.propose_raw(data, service=svc)
        assert "error" in reply, name
        err = reply["error"]
        assert err["code"] == code, (name, err)
        assert err.get("field") == field, (name, err)
        assert err["message"], name
    # Nothing was stored for this service, and the daemon still serves a good proposal.
    assert not await chain_ids(daemon, svc)
    reply = await client.propose(rank_proposal(svc))
    assert reply.status == "pending"


async def test_bad_messages_on_the_stream_are_refused_and_recorded(daemon, nc, svc):
    js = nc.jetstream()
    await js.publish(S.inbound_proposal(svc), b"not json at all")
    await js.publish(S.inbound_proposal(svc), json.dumps({**good(svc), "service": "x"}).encode())
    await js.publish(S.inbound_outcome(svc), b'{"kind": "refine"}')
    sub = await js.subscribe(S.refused(svc), ordered_consumer=True, stream=S.STREAM_REFUSED)
    seen = []

    async def three():
        try:
            msg = await sub.next_msg(timeout=0.5)
            seen.append(msgspec.json.decode(msg.data))
        except Exception:
            pass
        return len(seen) >= 3

    await eventually(three)
    await sub.unsubscribe()
    assert [r["code"] for r in seen] == ["invalid_json", "subject_mismatch", "missing_field"]
    assert all("payload" not in r and r["size"] > 0 for r in seen)
    assert not await chain_ids(daemon, svc)


async def test_a_signal_for_an_unknown_proposal_is_answered_not_found(daemon, nc, svc):
    client = MeshClient(nc, svc)
    reply = await nc.request(S.refine_request(svc), to_json(
        signal(svc, "mcp:x:1", proposal_id="0" * 64)), timeout=5)
    err = msgspec.json.decode(reply.data)["error"]
    assert err["code"] == "not_found" and err["field"] == "proposal_id"
    reply = await nc.request(S.triage_request(svc), b'{"proposal_id": "nope"}', timeout=5)
    err = msgspec.json.decode(reply.data)["error"]
    assert (err["code"], err["field"]) == ("invalid_value", "proposal_id")
    assert (await client.propose(rank_proposal(svc))).status == "pending"


async def test_an_apply_result_the_loop_cannot_record_is_one_failed_apply(daemon, nc, svc):
    """A service answers with an inverse holding an integer beyond 64 bits: the result cannot
    be encoded canonically, so it is a failed apply, recorded once — not an outcome that
    fails to save and is retried forever — and the daemon goes on serving."""
    client = MeshClient(nc, svc)
    answered = []

    async def poison(order):
        answered.append(order.proposal_id)
        return {"ok": True, "applied_id": "x", "inverse": {"n": 2**70}, "rollbackable": True}

    async def on_order(msg):
        await msg.respond(json.dumps(await poison(msgspec.json.decode(msg.data,
                                                                      type=ApplyOrder))).encode())

    sub = await nc.subscribe(S.apply_request(svc), cb=on_order)
    try:
        pid = (await client.propose(rank_proposal(svc, key="poison"))).proposal_id
        out = await eventually(lambda: client.outcome(pid))
        assert not out.ok and "cannot be recorded" in (out.error or "")
        await asyncio.sleep(0.5)
        chain = await trailers(daemon, svc, pid)
        assert [t.get("verdict") for t in chain].count("failed") == 1
        assert chain[-1]["verdict"] == "failed"
        again = (await client.propose(rank_proposal(svc, key="after-poison"))).proposal_id
        assert (await client.triage(again)).verdict == "accept"
    finally:
        await sub.unsubscribe()


async def test_a_service_that_advertises_no_surface_gets_no_proposals(daemon, nc, svc):
    """SPEC 09 conformance L0: a service that says it does not take part (`"improve": false`
    on its spec.get) has every proposal for it refused `no_surface`, by request and on the
    stream, and nothing is registered; a silent service (down, or not started yet) is not
    refused; its proposals wait for it."""
    from improved.client.sdk import serve_spec

    client = MeshClient(nc, svc)
    # its own answer, signed: on this open bus an unsigned one could be anyone's
    spec = await serve_spec(nc, svc, key=await trusted_service(daemon, svc))
    try:
        reply = await client.propose_raw(to_json(rank_proposal(svc)), service=svc)
        assert reply["error"]["code"] == "no_surface"
        assert reply["error"]["field"] == "service"
        assert '"improve": false' in reply["error"]["message"]
        js = nc.jetstream()
        sub = await js.subscribe(S.refused(svc), ordered_consumer=True,
                                 stream=S.STREAM_REFUSED)
        await js.publish(S.inbound_proposal(svc), to_json(rank_proposal(svc, key="streamed")))
        refused = msgspec.json.decode((await sub.next_msg(timeout=5)).data)
        await sub.unsubscribe()
        assert refused["code"] == "no_surface"
        assert not await chain_ids(daemon, svc)
    finally:
        await spec.unsubscribe()
    silent = f"{svc}-silent"
    assert (await MeshClient(nc, silent).propose(rank_proposal(silent))).status == "pending"
