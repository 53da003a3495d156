"""Audit trailers as OMS Observation grains (issue 34), pure: any trailer maps onto a grain
whose canonical bytes re-encode to themselves and give the trailer back exactly; a chain's
grains link through derived_from and re-derive its trailers' hashes; an altered grain is
named."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from improved.core import oms_observation as oms
from improved.core.audit import trailer_hash
from improved.protocol import canonical

hexes = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)
texts = st.text(max_size=40)  # any unicode: NFC or not, controls, astral
trailers = st.fixed_dictionaries(
    {"proposal_id": hexes, "seq": st.integers(0, 10**6), "from_stage": st.sampled_from(
        ["observe", "propose", "triage", "apply", "learn-back"]),
     "to_stage": st.sampled_from(["propose", "triage", "apply", "learn-back"]),
     "gate_class": st.sampled_from(["L0", "L1", "L2", "L3", "L4"]),
     "scope": st.sampled_from(["knowledge", "code", "operation", "charter"]),
     "actor": texts, "observer_type": st.sampled_from(
         ["human", "rec:agent", "rec:policy", "rec:system"]),
     "reason": texts, "at": st.integers(0, 2**41), "prev": hexes, "hash": hexes},
    optional={"refs": st.lists(texts, max_size=4), "verdict": st.sampled_from(
        ["accept", "approve", "dispatched", "applied"]), "cause": st.sampled_from(
        ["expired", "invalid"]), "sig": texts,
        "envelope": st.fixed_dictionaries({"payloadType": texts, "payload": texts,
                                           "signatures": st.just([])})})


@settings(max_examples=300, deadline=None)
@given(body=trailers, seq=st.integers(1, 2**40), proposal=st.booleans())
def test_any_trailer_is_a_canonical_grain_that_gives_it_back(body, seq, proposal):
    links = ["ab" * 32] if proposal else []
    g = oms.observation(body, "svc", seq, oms.PROPOSAL_NAMESPACE, links)
    assert g.address == hashlib.sha256(g.blob).hexdigest()
    assert g.blob[:3] == bytes([0x01, 0x00, canonical.OBSERVATION])
    assert oms.blob_problem(g.address, g.blob) is None
    type_byte, fields = oms.decoded(g.blob)
    assert type_byte == canonical.OBSERVATION
    assert canonical.grain_blob(fields, type_byte) == g.blob  # decode, re-encode: same bytes
    assert oms.trailer_of(fields) == body
    assert fields["observer_id"] == canonical.normalize(body["actor"])
    assert fields["observer_type"] == body["observer_type"]
    assert fields["object"] == canonical.normalize(body["reason"])
    assert fields["created_at"] == body["at"] and fields["type"] == "observation"
    assert fields.get("derived_from") == (links or None)


def chain(n: int) -> list[tuple[int, dict]]:
    """A mesh chain of `n` hashed and linked trailers."""
    cid, prev, out = "cd" * 32, "cd" * 32, []
    for i in range(n):
        body = {"proposal_id": cid, "seq": i, "from_stage": "learn-back", "to_stage":
                "learn-back", "gate_class": "L0", "scope": "operation", "actor": "improved:1",
                "observer_type": "rec:system", "reason": f"step {i}", "at": 1_700_000_000_000 + i,
                "prev": prev, "verdict": "policy", "refs": [f"digest:{i}"]}
        body["hash"] = prev = trailer_hash(body)
        out.append((10 + i, body))
    return out


def test_a_chains_grains_link_and_re_derive_its_trailers():
    entries = chain(4)
    grains = oms.chain_grains("cd" * 32, "_policy", entries, proposal=False)
    assert [oms.trailer_of(g.fields) for g in grains] == [b for _, b in entries]
    assert grains[0].fields.get("derived_from") is None
    assert [g.fields["derived_from"] for g in grains[1:]] == [[g.address] for g in grains[:-1]]
    assert [g.fields["context"]["@stream_seq"] for g in grains] == ["10", "11", "12", "13"]
    assert oms.chain_problems("cd" * 32, grains, proposal=False) == []


def test_an_altered_grain_is_named_even_when_re_addressed():
    grains = oms.chain_grains("cd" * 32, "_policy", chain(3), proposal=False)
    forged = dict(grains[1].fields, object="step one, as someone else tells it")
    forged["context"] = dict(forged["context"])
    again = oms.grain(forged, canonical.OBSERVATION)
    # the bytes under the old name: the address no longer matches
    assert "content address" in (oms.blob_problem(grains[1].address, again.blob) or "")
    # re-addressed: the grain after it no longer derives from it, and the trailer's hash
    # no longer re-derives
    problems = oms.chain_problems("cd" * 32, [grains[0], again, grains[2]], proposal=False)
    assert any("observation 1: its trailer's hash does not re-derive" in p for p in problems)
    assert any(p.startswith("observation 2: derived_from") for p in problems)
    # one removed: the links break
    assert oms.chain_problems("cd" * 32, [grains[0], grains[2]], proposal=False)
