"""`improved mcp`'s tools without a broker: exactly four, none that carries authority; bad
arguments are a tool error naming the field, before anything is sent; the proposal is always
the agent's service's and names the agent; the classes resource comes from the core's tables
under the policy in force; and without the agents extra the command says so in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from improved.cli import errors
from improved.cli.agent_tools import Agent, ToolError, checked_args, classes_view, completed, tools
from improved.core import gradient
from improved.core.guards import DEFAULT_FORBIDDEN
from improved.core.policy import Policy
from tests.cli import ENV

AGENT = Agent("ranking", "tuner")
EXTRA_LINE = "improved mcp needs the agents extra: pip install 'improved[agents]'"


def test_there_are_four_tools_and_none_carries_authority():
    found = tools(AGENT)
    assert set(found) == {"propose", "show", "list_proposals", "signal"}
    for name, (description, schema) in found.items():
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        assert len(description) > 80, name  # enough for an agent to act on
        assert not any(word in name for word in
                       ("approve", "reject", "grant", "revoke", "vote", "crisis"))


@pytest.mark.parametrize(("tool", "args", "field"), [
    ("propose", {}, "proposal"),
    ("propose", {"proposal": "text"}, "proposal"),
    ("propose", {"proposal": {}, "extra": 1}, "extra"),
    ("show", {"proposal_id": 7}, "proposal_id"),
    ("signal", {"proposal_id": "abcd", "kind": "vote", "positive": True}, "kind"),
    ("signal", {"proposal_id": "abcd", "kind": "check", "positive": "yes"}, "positive"),
    ("signal", {"proposal_id": "abcd", "kind": "metric", "positive": True,
                "value": float("nan")}, "value"),
    ("list_proposals", {"status": "done"}, "status"),
])
def test_a_bad_argument_is_a_tool_error_naming_it(tool, args, field):
    with pytest.raises(ToolError) as refused:
        checked_args(tool, args, AGENT)
    assert refused.value.field == field
    assert str(refused.value).startswith(f"{field}: ")


def test_the_proposal_is_the_agents_services_and_names_the_agent():
    filled = completed({"target_ref": "rank:x"}, AGENT, 1_700_000_000_000)
    assert filled["service"] == "ranking"
    assert filled["origin"] == {"actor": "agent:ranking:tuner", "service": "ranking"}
    assert filled["created_at"] == 1_700_000_000_000
    assert completed({"created_at": 5}, AGENT, 9)["created_at"] == 5
    with pytest.raises(ToolError, match=r"^proposal\.service: 'skills'"):
        completed({"service": "skills"}, AGENT, 0)
    with pytest.raises(ToolError, match=r"^proposal\.origin: must name this agent"):
        completed({"origin": {"actor": "operator:alice", "service": "ranking"}}, AGENT, 0)


def test_the_classes_come_from_the_core_under_the_policy_in_force():
    default = classes_view(Policy(), recorded=False)
    assert list(default["classes"]) == list(gradient.CLASSES)
    assert default["classes"]["L0"]["applies_automatically"] is True
    assert default["schemes"]["rank"] == {"min_class": "L0", "scope": "knowledge"}
    assert default["forbidden_targets"] == list(DEFAULT_FORBIDDEN)
    raised = classes_view(Policy(min_class={"rank": "L2"}, forbidden_targets=("secrets/**",)),
                          recorded=True)
    assert raised["schemes"]["rank"]["min_class"] == "L2"
    assert raised["forbidden_targets"][-1] == "secrets/**"
    assert raised["policy"].startswith("as the daemon's _policy chain")


# the install without the agents extra, as far as Python can tell
BASE = ("import sys\n"
        "sys.modules['mcp'] = None\n"
        "from improved.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n")


def test_without_the_agents_extra_the_command_says_so_in_one_line(tmp_path: Path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", BASE, *args], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path, env=ENV)

    ran = run("mcp", "--service", "ranking", "--agent", "tuner", "--http", "1")
    assert (ran.returncode, ran.stderr, ran.stdout) == (errors.USAGE, EXTRA_LINE + "\n", "")
    helped = run("mcp", "--help")
    assert helped.returncode == 0 and EXTRA_LINE in " ".join(helped.stdout.split())
    assert errors.extra_note("mcp", "agents", errors.AGENTS_MODULES) is None  # installed here
