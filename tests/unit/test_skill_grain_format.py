"""The Skill grain as OMS defines it: the `agent:skills` namespace in the header, the compaction
keys of the skill fields, and a Tool definition grain's type byte."""

from __future__ import annotations

import hashlib

from improved.protocol import canonical
from improved_reference.skill_competence import NAMESPACE, competence_grain
from improved_reference.skill_definitions import definition_record
from improved_reference.skill_grains import definition_grain, indexed

SKILL_KEYS = {  # OMS Skill grain, field compaction (definition and learned groups)
    "name": "skname", "description": "desc", "instructions": "instr", "when_to_use": "wtu",
    "version": "sver", "allowed_tools": "atls", "resources": "res", "dependencies": "deps",
    "input_modalities": "imod", "output_modalities": "omod", "domain": "dom",
    "holder_did": "hdid", "proficiency": "prof", "practice_count": "prcnt",
    "last_practiced_at": "lpa", "strategies": "strat", "transferable": "xfer",
    "license": "lic", "content_refs": "cr",
}


def full_skill() -> dict:
    return {"type": "skill", "name": "code_review", "description": "Review code changes",
            "version": "2.1.0", "instructions": "Read the diff.", "when_to_use": "a diff",
            "allowed_tools": ["read"], "resources": ["mg:sha256:" + "c" * 64],
            "dependencies": ["mg:sha256:" + "f" * 64], "domain": "software",
            "input_modalities": ["code"], "output_modalities": ["text"],
            "holder_did": "did:key:z6Mk", "proficiency": 0.82, "practice_count": 47,
            "last_practiced_at": 1711929600000, "transferable": True,
            "strategies": [{"condition": "security", "workflow": "mg:sha256:" + "a" * 64}],
            "license": "MIT", "content_refs": [], "created_at": 1711929600000,
            "namespace": NAMESPACE}


def test_each_skill_field_compacts_to_its_oms_key():
    compacted = canonical.compact(full_skill())
    for field, key in SKILL_KEYS.items():
        assert key in compacted and field not in compacted, field
    assert compacted["t"] == "skill" and compacted["ns"] == "agent:skills"


def test_skill_grains_are_in_the_agent_skills_namespace_and_its_header_says_so():
    """Both grains the store writes, a definition's and a holder's, carry the namespace, and
    bytes 3-4 of the header are its hash: a store filters skills without decoding."""
    record = definition_record({"name": "review", "description": "review a diff"}, 1711929600000)
    definition = definition_grain(record, NAMESPACE)
    held = competence_grain(record["definition"], holder_did="did:key:z6Mk", proficiency=0.2,
                            practice_count=1, created_at=1711929600000,
                            derived_from=[record["address"]])
    ns_hash = hashlib.sha256(b"agent:skills").digest()[:2]
    for grain in (definition, held):
        assert grain["namespace"] == NAMESPACE == "agent:skills"
        blob = canonical.grain_blob(grain, canonical.SKILL)
        assert blob[:3] == bytes([0x01, 0x00, 0x0B]) and blob[3:5] == ns_hash
    assert canonical.content_address(definition, canonical.SKILL) == record["address"]


def test_index_layer_fields_stay_out_of_a_grains_address():
    record = definition_record({"name": "review", "description": "d"}, 1711929600000)
    first = competence_grain(record["definition"], holder_did="h", proficiency=0.2,
                             practice_count=1, created_at=1711929601000,
                             derived_from=[record["address"]])
    second = {**first, "proficiency": 0.36, "confidence": 0.36, "practice_count": 2,
              "created_at": 1711929602000}
    view = indexed([first, second])
    assert view[0]["superseded_by"] == view[1]["address"]
    assert view[0]["system_valid_to"] == 1711929602000
    assert view[0]["address"] == canonical.content_address(first, canonical.SKILL)
    assert (view[1]["superseded_by"], view[1]["system_valid_to"]) == (None, None)


def test_a_tool_grain_has_the_tool_type_byte():
    tool = {"type": "tool", "name": "read", "created_at": 1711929600000}
    assert canonical.grain_blob(tool, canonical.TOOL)[2] == 0x05
