"""Who and what the demo's walk is about: its actors, the skill, the values and artefacts it
seeds, and the changes it proposes. Shared by the mesh that seeds them and the scenes that change
them, so a name is spelt once."""

from __future__ import annotations

import msgspec

OPERATOR = "operator:demo"
AGENT = "mcp:agent-7f3a:1"  # proposes the skill (an MCP runtime session, call 1)
TUNER = "mcp:tuner-51c0:1"  # proposes the ranking change
TUNER_AGAIN = "mcp:tuner-51c0:2"  # the same session, a later call: not independent
SERVICES = ("skills", "search", "deploy", "memory", "docs")  # the reference services it runs
EVALUATOR = "agent:evaluator:run-0042"  # an agent of another service, by its key: independent
SKILL = {
    "name": "summarize",
    "description": "Summarise a text in three bullet points",
    "instructions": "Read the text. Write three bullet points, most important first.",
}
EXTRA_SENTENCE = " Keep each bullet under twenty words."
RANK_KEY = "search.title_boost"
SNIPPET_KEY = "search.snippet_weight"  # set by the learn-back step, then rolled back
DEPLOYER = "agentd:release-9c1e:1"  # proposes the L4 binary swap
ARTEFACTS = {"app": '{"release": 1}', "config": '{"workers": 4}'}
PRIOR, NEW = 1.0, 1.5
FORBIDDEN = "notes/../_spec/2026-04-20-00-constitution.md"
CURATOR = "mcp:curator-2b7d:1"  # proposes the CAL batch and the doc edit
NAMESPACE = "agent:recommendations"
DUPLICATES = "\n".join(  # what an extractor wrote twice: the OMS seed's example, small
    f'ADD fact SET subject = "user:john-smith" SET relation = "preferred_activity" '
    f'SET object = "{obj}" REASON "extracted from a chat"' for obj in ("morning run", "running"))
MERGE = ('SUPERSEDE facts WHERE subject = "user:john-smith" AND relation = "preferred_activity" '
         'SET object = "morning_run_5k" REASON "merge 2 duplicate extractions"')
GUIDE = "docs/guide.md"
GUIDE_V1 = "# Guide\n\nRun the demo.\n"
GUIDE_V2 = "# Guide\n\nRun `improved demo`: the whole loop in ten seconds.\n"


def orders_schema(qty_maximum: int) -> str:
    """The JSON Schema of an order whose `qty` is at most `qty_maximum` (the seed: 100)."""
    return msgspec.json.encode({
        "type": "object", "required": ["sku"], "additionalProperties": False,
        "properties": {"sku": {"type": "string"},
                       "qty": {"type": "integer", "maximum": qty_maximum}}}).decode()
