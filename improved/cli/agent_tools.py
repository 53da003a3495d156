"""What `improved mcp` lets an AI agent do, as ONE agent of ONE service: propose as
`agent:<svc>:<name>` (signed when it holds that key), follow a proposal, list its own, send a
learn-back signal, and read the classes and the daemon's spec before it proposes.

Nothing here approves, rejects, grants, revokes, votes or resolves a crisis: those are signed
acts of an operator or a quorum voter, and no key of theirs comes near this module. What the
agent sends is what any mesh service may send (`client.sdk.MeshClient`), and what it reads is
what `improved show` reads (`cli.proposals.shown`). The MCP wiring is `cli.mcp_server`; this
module needs no MCP package, so its checks are tested without one."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.js.errors import NotFoundError

from improved.cli import ids, render, verdicts
from improved.cli.common import chain_record
from improved.cli.errors import Failure
from improved.cli.proposals import shown
from improved.client.config import Config
from improved.client.deployment import Deployment
from improved.client.sdk import ImproveError, MeshClient
from improved.core import gradient
from improved.core.policy import POLICY_ID, Policy
from improved.core.record import status_at
from improved.core.trailers import PolicyInForce, body_as
from improved.protocol import subjects as S
from improved.protocol.model import Signal

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from improved.core.record import ProposalRecord

# An agent's name: the last token of its actor, `agent:<svc>:<name>` (protocol.model.Actor).
AGENT_NAME_RE = re.compile(r"^[A-Za-z0-9._@+-]{1,128}\Z")
STATUSES = ("pending", "approved", "rejected", "applied", "rolled_back", "expired")
SIGNAL_KINDS = ("refine", "check", "world", "metric")
LIST_SCAN = 2000  # chains of the service read, at most, to list an agent's proposals
READ_AT_ONCE = 16
CLASSES_URI = "improved://classes"
SPEC_URI = "improved://spec"


@dataclass(frozen=True)
class Agent:
    """Who the server speaks as: one agent of one service, with its key if it has one."""

    service: str
    name: str
    key: Ed25519PrivateKey | None = None

    @property
    def actor(self) -> str:
        return f"agent:{self.service}:{self.name}"


class ToolError(Exception):
    """Bad input, or the loop's no: said to the agent as a tool error naming the field."""

    def __init__(self, field: str | None, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def now_ms() -> int:
    return int(time.time() * 1000)


# -- the tools' descriptions and schemas ---------------------------------------------------------

PROPOSAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "A Proposal as in the repository's examples/*.json; service, origin and "
                   "created_at may be left out (they are filled in).",
    "properties": {
        "target_ref": {"type": "string", "description": "scheme:rest, e.g. rank:search.boost"},
        "change_class": {"enum": list(gradient.CLASSES)},
        "scope": {"enum": ["knowledge", "code", "operation", "charter"]},
        "analyzer": {"type": "object",
                     "description": '{"id": "publisher.name/major, e.g. acme.tuner/1", '
                                    '"params"?: {...}}'},
        "summary": {"type": "object",
                    "description": '{"template_id": "...", "args": {...}}'},
        "proposal_data": {"type": "object"},
        "proposal_edit": {"type": "object"},
        "proposal_cal": {"type": "string"},
        "target_files": {"type": "array", "items": {"type": "string"}},
        "metric_snapshot": {"type": "object"},
        "valid_to": {"type": "integer"},
    },
    "required": ["target_ref", "change_class", "scope", "analyzer", "summary"],
}
PROPOSAL_ID_SCHEMA: dict[str, Any] = {
    "type": "string", "pattern": "^[0-9a-fA-F]{4,64}$",
    "description": "the proposal's id, or a unique prefix of it (at least 4 hex digits)"}


def tools(agent: Agent) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each tool's description and input schema, by name: exactly these four."""
    who = f"{agent.actor} of service {agent.service}"
    return {
        "propose": (
            f"Propose a change to service {agent.service} as {who}. First read the "
            f"{CLASSES_URI} resource to pick the change_class and scope the target's scheme "
            "needs; a forbidden target is always rejected. service, origin and created_at "
            "may be left out. Returns the proposal id, its class and gate, and the daemon's "
            "triage decision with its cause in words: accepted (an L0 is then applied by its "
            "service), deferred (it waits for an operator, a grant or an independent signal) "
            "or rejected with what to fix. The same content proposed again has the same id.",
            _object({"proposal": PROPOSAL_SCHEMA}, ["proposal"])),
        "show": (
            "Follow one proposal: its status, the triage decision and its cause, what it "
            "waits for now, the apply outcome, the learn-back and whether its audit chain "
            "verifies.",
            _object({"proposal_id": PROPOSAL_ID_SCHEMA}, ["proposal_id"])),
        "list_proposals": (
            f"List the proposals {agent.actor} made for {agent.service}, newest first, each "
            "with its id, status, class, gate, target and what it waits for; `status` keeps "
            "only those with that status.",
            _object({"status": {"enum": list(STATUSES)}}, [])),
        "signal": (
            f"Send learn-back evidence about a proposal as {agent.actor}: kind `check` (an "
            "out-of-band check), `world` (an effect seen after the apply), `metric` (a "
            "reading: give `name` and `value`) or `refine`; `positive` says for or against. "
            "Returns whether it was counted and whether it counts as independent of the "
            "proposer (a signal on a proposal of your own never does). It is recorded on "
            "the proposal's audit chain.",
            _object({"proposal_id": PROPOSAL_ID_SCHEMA, "kind": {"enum": list(SIGNAL_KINDS)},
                     "positive": {"type": "boolean"},
                     "name": {"type": "string", "maxLength": 128,
                              "description": "the metric's name"},
                     "value": {"type": "number", "description": "the metric's reading"}},
                    ["proposal_id", "kind", "positive"])),
    }


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def instructions(agent: Agent) -> str:
    """What the server tells the agent about itself when it connects."""
    signed = "signed with its key" if agent.key is not None else "unsigned (no --key)"
    return (f"You act as {agent.actor}, one agent of the mesh service {agent.service}, "
            f"{signed}. You may propose changes to {agent.service}, follow and list your "
            "proposals and send learn-back signals; you cannot approve, reject, grant, "
            "revoke, vote or resolve a crisis: operators do, with their own keys. Read "
            f"{CLASSES_URI} before proposing.")


# -- checking the arguments (pure) ---------------------------------------------------------------


def checked_args(name: str, args: dict[str, Any] | None, agent: Agent) -> dict[str, Any]:
    """The arguments of tool `name`, or a ToolError naming the first that is missing,
    unknown or of the wrong type (the schema's `required`, `properties`, `enum` and types)."""
    schema = tools(agent)[name][1]
    args = dict(args or {})
    for key in args:
        if key not in schema["properties"]:
            raise ToolError(key, f"unknown argument; {name} takes "
                                 f"{', '.join(schema['properties']) or 'none'}")
    for key in schema["required"]:
        if key not in args:
            raise ToolError(key, "missing: this argument is required")
    for key, value in args.items():
        problem = _type_problem(schema["properties"][key], value)
        if problem is not None:
            raise ToolError(key, problem)
    return args


def _type_problem(spec: dict[str, Any], value: Any) -> str | None:
    if "enum" in spec and value not in spec["enum"]:
        return f"{value!r} is not one of {', '.join(map(str, spec['enum']))}"
    kind = spec.get("type")
    if kind == "object" and not isinstance(value, dict):
        return "must be a JSON object"
    if kind == "boolean" and not isinstance(value, bool):
        return "must be true or false"
    if kind == "number" and (isinstance(value, bool) or not isinstance(value, int | float)
                             or not math.isfinite(value)):
        return "must be a finite number"
    if kind == "string":
        if not isinstance(value, str):
            return "must be a string"
        if len(value) > spec.get("maxLength", len(value)):
            return f"is longer than {spec['maxLength']} characters"
    return None


def completed(doc: dict[str, Any], agent: Agent, now: int) -> dict[str, Any]:
    """The proposal as sent: the service always the agent's, the origin naming the agent,
    `created_at` now unless given; a ToolError naming the field that says otherwise."""
    out = dict(doc)
    service = out.setdefault("service", agent.service)
    if service != agent.service:
        raise ToolError("proposal.service", f"{service!r}: this server proposes for service "
                        f"{agent.service} only; leave service out")
    origin = {"actor": agent.actor, "service": agent.service}
    if out.setdefault("origin", origin) != origin:
        raise ToolError("proposal.origin", f"must name this agent ({json.dumps(origin)}); "
                        "leave origin out")
    out.setdefault("created_at", now)
    return out


def in_proposal(field: str | None) -> str:
    """A field the daemon named in a proposal, as the agent wrote it (`proposal.<field>`)."""
    return f"proposal.{field}" if field else "proposal"


# -- the surface: the tools against a running deployment ------------------------------------------


class AgentSurface:
    """The four tools and two resources of one agent, on one connection to the deployment."""

    def __init__(self, nc: Client, agent: Agent, config: Config, timeout: float = 10.0):
        self.nc = nc
        self.agent = agent
        self.config = config
        self.timeout = timeout
        self.store = Deployment(nc)
        self.client = MeshClient(nc, agent.service, timeout=timeout)

    async def call(self, name: str, args: dict[str, Any] | None) -> dict[str, Any]:
        """Run tool `name`; every known way it can fail is a ToolError, said to the agent."""
        handlers: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            "propose": self.propose, "show": self.show,
            "list_proposals": self.list_proposals, "signal": self.signal}
        if name not in handlers:
            raise ToolError(None, f"no tool {name!r}: the tools are {', '.join(handlers)}")
        checked = checked_args(name, args, self.agent)
        try:
            return await handlers[name](checked)
        except NoRespondersError:
            raise ToolError(None, "no daemon answers on this bus: is `improved run` running "
                                  "(on the server --nats names)?") from None
        except TimeoutError:
            raise ToolError(None, f"no answer within {self.timeout:g} s: the daemon is busy "
                                  "or stuck; try again") from None

    async def propose(self, args: dict[str, Any]) -> dict[str, Any]:
        doc = completed(args["proposal"], self.agent, now_ms())
        try:
            reply = await self.client.propose(doc, key=self.agent.key)
        except ImproveError as err:
            raise ToolError(in_proposal(err.field), f"refused {err.code}: {err.message}") \
                from None
        pid = reply.proposal_id
        chain = [body for _, body in await self.store.read_chain(self.agent.service, pid)]
        target = doc.get("target_ref")
        said = verdicts.of_triage(pid, reply.status, chain,
                                  target if isinstance(target, str) else "")
        decided: dict[str, Any] = next(
            (b for b in reversed(chain) if b.get("to_stage") == "triage"), {})
        return {"proposal_id": pid, "status": reply.status, "class": doc.get("change_class"),
                "gate": decided.get("gate_class"),
                "decision": {"verdict": decided.get("verdict"), "cause": decided.get("cause"),
                             "reason": decided.get("reason")} if decided else None,
                "says": said.line,
                "signed_as": self.agent.actor if self.agent.key is not None else None}

    async def resolve(self, text: str) -> tuple[str, str]:
        """(service, full id) of the proposal `text` names; a ToolError naming
        `proposal_id` when none does or the prefix is ambiguous."""
        try:
            return await ids.resolve(self.store, ids.id_arg(text))
        except argparse.ArgumentTypeError as exc:
            raise ToolError("proposal_id", str(exc)) from None
        except Failure as exc:
            raise ToolError("proposal_id", str(exc)) from None

    async def show(self, args: dict[str, Any]) -> dict[str, Any]:
        svc, pid = await self.resolve(args["proposal_id"])
        seen = await shown(self.store, pid, self.config, readable=False)
        facts, view = seen.facts, seen.view
        decision = facts.get("decision") or {}
        return {"proposal_id": pid, "service": svc, "target": facts.get("target"),
                "class": facts.get("class"), "gate": facts.get("gate"),
                "status": facts.get("status"),
                "decision": {k: decision.get(k) for k in ("verdict", "cause", "rationale")}
                if decision else None,
                "waits_for": render.waits_for(*render.waiting(facts)),
                "outcome": view.get("outcome"), "learn_back": view.get("learn_back"),
                "proposer": facts.get("proposer"), "origin": facts.get("origin"),
                "chain": view.get("chain")}

    async def list_proposals(self, args: dict[str, Any]) -> dict[str, Any]:
        svc, now = self.agent.service, now_ms()
        pids = await self._chains_of(svc)
        limit = asyncio.Semaphore(READ_AT_ONCE)

        async def record(pid: str) -> ProposalRecord | None:
            async with limit:
                return await chain_record(self.store, svc, pid)

        records = await asyncio.gather(*(record(pid) for pid in pids[:LIST_SCAN]))
        rows = [_row(r, now) for r in records
                if r is not None and r.proposal.origin.actor == self.agent.actor]
        wanted = args.get("status")
        rows = sorted((r for r in rows if wanted is None or r["status"] == wanted),
                      key=lambda r: (-int(r["created_at"]), str(r["proposal_id"])))
        return {"service": svc, "agent": self.agent.actor, "count": len(rows),
                "proposals": rows, "complete": len(pids) <= LIST_SCAN}

    async def _chains_of(self, svc: str) -> list[str]:
        """The ids of every proposal chain of `svc` on the audit stream."""
        try:
            info = await self.store.js.stream_info(S.STREAM_AUDIT,
                                                   subjects_filter=S.audit(svc, "*"))
        except NotFoundError:
            return []
        return sorted(str(S.token(s, 3)) for s in (info.state.subjects or {}))

    async def signal(self, args: dict[str, Any]) -> dict[str, Any]:
        _, pid = await self.resolve(args["proposal_id"])
        if args["kind"] == "metric" and ("name" not in args or "value" not in args):
            raise ToolError("name" if "name" not in args else "value",
                            "a metric signal carries the metric's name and value")
        sig = Signal(kind=args["kind"], actor=self.agent.actor, service=self.agent.service,
                     positive=args["positive"], at=now_ms(), proposal_id=pid,
                     name=args.get("name"),
                     value=float(args["value"]) if "value" in args else None)
        try:
            reply = await self.client.refine(sig, key=self.agent.key)
        except ImproveError as err:
            raise ToolError(err.field, f"refused {err.code}: {err.message}") from None
        return {"proposal_id": reply.proposal_id, "counted": reply.counted,
                "independent": reply.independent,
                "says": ("counted" if reply.counted else "counted already") + ", "
                        + ("independent of the proposer" if reply.independent else
                           "not independent of the proposer")}

    # -- resources ---------------------------------------------------------------------------

    async def classes(self) -> dict[str, Any]:
        """The classes, the schemes' minimum classes and scopes, and the forbidden targets,
        from the core's tables under the policy the daemon's `_policy` chain records."""
        policy, recorded = await self._policy_in_force()
        return classes_view(policy, recorded)

    async def _policy_in_force(self) -> tuple[Policy, bool]:
        try:
            _, head = await self.store.chain_head(S.policy_audit(POLICY_ID))
        except (NotFoundError, NoRespondersError, TimeoutError):  # no stream, no chain yet
            return Policy(), False
        if head is None:
            return Policy(), False
        try:
            return msgspec.convert(body_as(PolicyInForce, head).changed, Policy), True
        except (ValueError, msgspec.MsgspecError):
            return Policy(), False

    async def spec(self) -> dict[str, Any]:
        """The daemon's own answer on `improved.spec.get`."""
        try:
            reply = await self.nc.request(S.SPEC_GET, b"", timeout=self.timeout)
            answer = msgspec.json.decode(reply.data)
        except NoRespondersError:
            raise ToolError(None, f"nothing serves {S.SPEC_GET}: is `improved run` running "
                                  "(on the server --nats names)?") from None
        except TimeoutError:
            raise ToolError(None, f"no answer on {S.SPEC_GET} within {self.timeout:g} s") \
                from None
        except msgspec.DecodeError:
            raise ToolError(None, f"the answer on {S.SPEC_GET} is no JSON") from None
        return answer if isinstance(answer, dict) else {"answer": answer}


def _row(record: ProposalRecord, now: int) -> dict[str, Any]:
    """One line of `list_proposals`."""
    d = record.decision
    status = status_at(record, now)
    return {"proposal_id": record.proposal_id, "status": status,
            "class": record.proposal.change_class, "gate": record.gate_class,
            "target": record.proposal.target_ref, "cause": d.cause if d is not None else None,
            "waits_for": render.waits_for(status, d.cause if d is not None else None,
                                          record.in_flight, record.superseded_by is not None),
            "created_at": record.proposal.created_at}


def classes_view(policy: Policy, recorded: bool) -> dict[str, Any]:
    """What an agent reads to pick a class and scope (pure: the core's tables, `policy`)."""
    fallback = gradient.higher(policy.fallback_min_class, gradient.FALLBACK_MIN_CLASS)
    schemes = sorted({*gradient.DEFAULT_MIN_CLASS, *gradient.SCHEME_SCOPE, *policy.min_class})
    return {
        "classes": {c: {"meaning": meaning, "gate": gate,
                        "applies_automatically": c in gradient.AUTO_APPLY_CLASSES}
                    for c, (meaning, gate) in gradient.CLASS_MEANING.items()},
        "schemes": {s: {"min_class": gradient.min_class(s, policy.min_class, fallback),
                        "scope": gradient.implied_scope(s)} for s in schemes},
        "any_other_scheme": {"min_class": fallback, "scope": gradient.FALLBACK_SCOPE},
        "rules": [
            "a class below the scheme's min_class is rejected class_mismatch; L1 fits any "
            "target (it only surfaces), L3 fits skill: targets only",
            "the scope is the one the scheme implies (scope_mismatch otherwise); charter, a "
            "constitution edit, only on " + ", ".join(f"{s}:" for s in
                                                      sorted(gradient.CHARTER_SCHEMES)),
            "a proposal touching a forbidden target (its target, target_files, every path a "
            "diff names) is rejected forbidden_target whatever its class",
        ],
        "forbidden_targets": list(policy.forbidden),
        "policy": "as the daemon's _policy chain records it" if recorded else
                  "the built-in defaults (the daemon recorded no policy that could be read)",
    }
