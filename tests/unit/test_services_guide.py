"""docs/services.md cannot drift from the wire types: every field table it marks
`<!-- fields: Name -->` lists exactly the fields of the msgspec Struct `Name` in
improved/protocol/model.py, by their wire names, each marked required as the Struct requires
it; and every message a service sends or receives has its table."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from improved.protocol import model

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "services.md"
MARK = re.compile(r"^<!-- fields: (\w+) -->$")
# What a mesh service sends, receives or reads: each must have its table in the guide.
SERVICE_FACING = ("Proposal", "Origin", "AnalyzerRef", "Summary", "ProposalEdit",
                  "MetricSnapshot", "ProposeReply", "ErrorBody", "ApplyOrder", "ApplyResult",
                  "ApplyReport", "ProposalState", "TriageDecision", "ApplyOutcome", "Signal",
                  "RefineReply", "LearnBack", "MeasureRequest", "MeasureReply")


def tables(text: str) -> dict[str, list[tuple[str, str]]]:
    """Each marked table: (field, required column) per row, in order."""
    found: dict[str, list[tuple[str, str]]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        mark = MARK.match(line.strip())
        if not mark:
            continue
        assert mark.group(1) not in found, f"two tables for {mark.group(1)}"
        rows = []
        for row in lines[i + 3:]:  # after the header and its separator
            if not row.startswith("|"):
                break
            cells = [c.strip() for c in row.strip("|").split("|")]
            name = re.fullmatch(r"`([^`]+)`", cells[0])
            assert name, f"{mark.group(1)}: the first cell of {row!r} is not a `field`"
            rows.append((name.group(1), cells[2]))
        found[mark.group(1)] = rows
    return found


GUIDE_TABLES = tables(GUIDE.read_text())


def test_every_service_facing_message_has_a_field_table():
    missing = [name for name in SERVICE_FACING if name not in GUIDE_TABLES]
    assert not missing, f"docs/services.md has no field table for {missing}"


@pytest.mark.parametrize("name", sorted(GUIDE_TABLES))
def test_a_field_table_lists_exactly_the_fields_of_its_struct(name):
    struct = getattr(model, name, None)
    assert isinstance(struct, type) and issubclass(struct, msgspec.Struct), \
        f"docs/services.md marks a table for {name}, which improved/protocol/model.py lacks"
    fields = {f.encode_name: f for f in msgspec.structs.fields(struct)}
    listed = [field for field, _ in GUIDE_TABLES[name]]
    assert sorted(listed) == sorted(fields), (
        f"{name}: the guide lists {sorted(set(listed) - set(fields))} that the Struct lacks "
        f"and lacks {sorted(set(fields) - set(listed))}")
    wrong = [f"{field}: guide says {said!r}" for field, said in GUIDE_TABLES[name]
             if (said == "yes") != fields[field].required
             and not (said == "one body" and not fields[field].required)]
    assert not wrong, f"{name}: required marked wrongly: {wrong}"


def test_the_parser_sees_a_drifted_table():
    """A table missing a field or listing one too many is caught, not parsed past."""
    text = ("<!-- fields: Summary -->\n| field | type | required | meaning |\n|---|---|---|---|\n"
            "| `template_id` | string | yes | x |\n| `extra` | string | no | x |\n\nafter\n")
    rows = tables(text)["Summary"]
    assert [f for f, _ in rows] == ["template_id", "extra"]
    assert sorted(f for f, _ in rows) != sorted(
        f.encode_name for f in msgspec.structs.fields(model.Summary))
