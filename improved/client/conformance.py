"""The conformance kit: which SPEC 09 conformance level (L0–L4) a live service meets, and why not
the next one.

A service author points it at a running service: `report = await probe(nc, "search")`, then
`print(render(report))`. Everything goes through NATS, as the daemon or an agent runtime would
talk to the service. The levels are cumulative: a service meets the highest level L such that
every check of L and of every level below passed.

What is probed, level by level:
- L0: `<svc>.spec.get` answers a JSON object saying `"improve": true` or `false`. A service that
  advertises `"improve": false` has advertised its omission: it is L0 and the probe stops there.
- L1: the spec says `"improve": true` and names `"apply": "<svc>.improve.apply"` (where the daemon
  sends its orders); a malformed ApplyOrder there gets a well-formed reply: an ApplyResult with
  `ok: false`, or an error reply `{"error": {...}}`. The service emits a valid proposal: asked
  on `<svc>.improve.conformance.propose`, it answers a sample as it publishes its own, read with
  the daemon's decoder (the wrong field named); and it takes triage decisions: one handed to it
  on `<svc>.improve.conformance.triage` is taken, one with an unknown verdict or about another
  service refused (`conformance_evidence`).
- L2: a well-formed L2 ApplyOrder whose proposal has no operator acceptance on record is refused,
  `ok: false` with an error starting `not_accepted:`, and so is an L0 order triage never accepted
  (anyone on the bus could label a change L0); sent again, the L2 order gets the very same reply.
- L3: the spec advertises `"identity": "<name>:<sha256>"` and a `"get"` subject (a skills read
  under a grant); asked for a random identity nobody granted, it answers an error `no_grant`,
  `grant_mismatch` or `not_found`, never a definition. A service that holds no skills (no
  `skill:` scheme, no skills read) passes L3 as not applicable: TOFU (§4) binds skills.
- L4: the spec advertises `"lkg": "<svc>.improve.lkg"`; asked to confirm a last-known-good for an
  artefact that does not exist, it answers `{"ok": false, ...}`; an L4 ApplyOrder carrying
  that `lkg` list, without an operator acceptance, is refused `not_accepted:`; the swaps on
  record in its advertised `"window"` were all or none; every applied L4 on its audit chains
  names its `revert_proposal_id`.

The probe never changes real state when the service is conformant: every order it sends must be
refused. Each order's proposal carries a random nonce (in its summary args), so its proposal id,
the proposal's content address, is fresh: no audit chain, hence no operator acceptance, exists
for it. Its target is `<first advertised scheme>conformance-probe` and its `proposal_data` is
`{}`, so even a service that wrongly applies it has little to apply. Probing stops at the first
level that fails: a service that did not refuse what it should have is not sent more orders.

What the kit cannot observe is reported as not probed, with why (such a check neither passes
nor fails its level): an L4 window nobody advertised, or no swap on record in it yet, and no
applied L4 on the chains (the kit applies nothing, so it judges only what happened). L2's gate
is seen from the refusing side only (an accepted order applied would change state; the loop's
end-to-end tests cover it), and L3's drift would need a stored skill to tamper with.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from improved.client import conformance_evidence as evidence
from improved.client.probing import Answer, Check, ask, describe_error, error_of, show
from improved.core import gradient, propose
from improved.protocol import subjects as S
from improved.protocol.model import (
    AnalyzerRef,
    ApplyOrder,
    ApplyResult,
    ChangeClass,
    Origin,
    Proposal,
    Summary,
)

__all__ = ["LEVELS", "Check", "MeshReport", "Report", "discover", "level_of", "probe",
           "probe_mesh", "probe_order", "probe_scheme", "render", "render_mesh"]

LEVELS = ("L0", "L1", "L2", "L3", "L4")
EMITS = evidence.EMITS
ACTOR = "conformance"
ANALYZER = "improved.conformance/1"
TEMPLATE = "conformance-probe"
AUTHORITY = "operator:conformance-probe"
PROBE_KEY = "conformance-probe"
DEFAULT_SCHEME = "config"
NOT_ACCEPTED = "not_accepted:"
GET_REFUSALS = ("no_grant", "grant_mismatch", "not_found")
IDENTITY = "<name>:<sha256>"
MALFORMED_ORDER = {"proposal_id": "x"}
_SCHEME_RE = re.compile(r"^[a-z][a-z0-9+.-]*\Z")
_SUBJECT_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\Z")  # no wildcards, no spaces


@dataclass
class Report:
    service: str
    level: str | None  # "L0".."L4"; None: not even L0
    checks: list[Check] = field(default_factory=list)
    spec: dict[str, Any] | None = None  # what spec.get answered, when it answered an object

    @property
    def claimed(self) -> str | None:
        """The level the service advertises of itself (`"conformance"` in its spec), if any."""
        claim = (self.spec or {}).get("conformance")
        return claim if isinstance(claim, str) else None

    @property
    def next_level(self) -> str | None:
        """The level above the one met; None when L4 is met."""
        index = -1 if self.level is None else LEVELS.index(self.level)
        return LEVELS[index + 1] if index + 1 < len(LEVELS) else None

    @property
    def first_failure(self) -> Check | None:
        return next((c for c in self.checks if c.failed), None)

    @property
    def not_probed(self) -> list[Check]:
        """What the kit could not look at, each saying why."""
        return [c for c in self.checks if not c.probed]


def level_of(checks: list[Check]) -> str | None:
    """The highest level none of whose checks, nor those of any level below, failed; a level
    with no checks (never probed) is not met, and a check the kit could not probe neither
    passes nor fails its level. Pure."""
    met = None
    for level in LEVELS:
        mine = [c for c in checks if c.level == level]
        if not mine or any(c.failed for c in mine):
            break
        met = level
    return met


def render(report: Report) -> str:
    """The report as text: one line per check, then the level met and why not the next."""
    lines = [f"conformance of {report.service} (SPEC 09):"]
    for c in report.checks:
        lines.append(f"  {_verdict(c)} {c.level} {c.name}: {c.detail}")
    lines.append(f"{report.service} meets {report.level}" if report.level is not None
                 else f"{report.service} meets no level")
    nxt = report.next_level
    if nxt is not None:
        failure = report.first_failure
        lines.append(f"not {nxt}: {failure.detail if failure else 'not probed'}")
    if report.claimed is not None and report.claimed != report.level:
        lines.append(f"(it advertises \"conformance\": {report.claimed!r})")
    return "\n".join(lines)


def _verdict(check: Check) -> str:
    return "PASS" if check.passed else "FAIL" if check.probed else "NOT PROBED"


# -- talking to the service -----------------------------------------------------------------------


def _apply_result(reply: Any) -> ApplyResult | None:
    if not isinstance(reply, dict) or error_of(reply) is not None:
        return None
    try:
        return msgspec.convert(reply, type=ApplyResult)
    except msgspec.ValidationError:
        return None


# -- the probe orders -----------------------------------------------------------------------------


def probe_scheme(spec: dict[str, Any]) -> str:
    """The first scheme the service advertises (`"rank:"` → `rank`), else `config`."""
    schemes = spec.get("schemes")
    if isinstance(schemes, list) and schemes and isinstance(schemes[0], str):
        scheme = schemes[0].rstrip(":")
        if _SCHEME_RE.match(scheme):
            return scheme
    return DEFAULT_SCHEME


def probe_order(service: str, spec: dict[str, Any], change_class: ChangeClass = "L2",
                lkg: list[dict[str, Any]] | None = None) -> ApplyOrder:
    """A well-formed order a conformant service must refuse: its proposal, made fresh by a random
    nonce, has no audit chain and so no operator acceptance."""
    scheme = probe_scheme(spec)
    proposal = Proposal(
        service=service, target_ref=f"{scheme}:{PROBE_KEY}", change_class=change_class,
        scope=gradient.implied_scope(scheme), origin=Origin(actor=ACTOR, service=ACTOR),
        analyzer=AnalyzerRef(id=ANALYZER),
        summary=Summary(template_id=TEMPLATE, args={"nonce": secrets.token_hex(16)}),
        proposal_data={}, created_at=int(time.time() * 1000), lkg=lkg)
    pid, _ = propose.identify(proposal)
    return ApplyOrder(proposal_id=pid, proposal=proposal, authority=AUTHORITY, attempt=1)


def probe_lkg() -> list[dict[str, Any]]:
    """An artefact that exists nowhere, so no service can hold a last-known-good for it."""
    return [{"artefact": f"{PROBE_KEY}-{secrets.token_hex(8)}", "digest": "sha256:" + "0" * 64,
             "smoke_test": "nonempty"}]


def _refusal(answer: Answer, subject: str, change_class: str) -> tuple[bool, str]:
    """Whether an order's answer is the refusal for lack of acceptance, and the detail."""
    what = f"an {change_class} order without an operator acceptance on record"
    if not answer.answered:
        return False, f"{answer.problem}: {what} must be refused, not left unanswered"
    result = _apply_result(answer.value)
    if result is None:
        err = error_of(answer.value)
        if err is not None:
            return False, (f"{what} was refused, but not for lack of acceptance (error reply "
                           f"{describe_error(err)}; a refusal is ok: false, "
                           f"error \"{NOT_ACCEPTED} ...\")")
        return False, f"{subject} answered {what} with no ApplyResult: {show(answer.value)}"
    if result.ok:
        return False, (f"{what} was applied (applied_id {result.applied_id!r}); check the "
                       f"service for target {PROBE_KEY!r}")
    if not (result.error or "").startswith(NOT_ACCEPTED):
        return False, (f"{what} was refused, but not for lack of acceptance (error: "
                       f"{result.error!r}; expected it to start {NOT_ACCEPTED!r})")
    return True, f"{what} was refused: {result.error}"


def _advertised_subject(spec: dict[str, Any], key: str, expected: str | None) -> str | None:
    """Why the spec's subject under `key` is not usable, or None when it is."""
    value = spec.get(key)
    if not isinstance(value, str) or not _SUBJECT_RE.match(value):
        return f"the spec advertises no {key!r} subject (got {value!r})"
    if expected is not None and value != expected:
        return (f"the spec advertises {key!r} on {value}, but the daemon sends to {expected}")
    return None


# -- the levels -----------------------------------------------------------------------------------


async def _l0(nc: Client, service: str, timeout: float,
              checks: list[Check]) -> dict[str, Any] | None:
    subject = S.service_spec(service)
    answer = await ask(nc, subject, {}, timeout)
    if not answer.answered:
        checks.append(Check("L0", "spec.get", False, (
            f"no answer on {subject}: a service must advertise, even the omission "
            f"({answer.problem})")))
        return None
    spec = answer.value
    if not isinstance(spec, dict) or error_of(spec) is not None:
        checks.append(Check("L0", "spec.get", False, (
            f"{subject} answered {show(spec)}, not the service's capabilities (a JSON object)")))
        return None
    checks.append(Check("L0", "spec.get", True, f"{subject} answered its capabilities"))
    improve = spec.get("improve")
    if not isinstance(improve, bool):
        checks.append(Check("L0", "improve advertised", False, (
            f"the spec must say \"improve\": true or false, not {improve!r}")))
        return None
    checks.append(Check("L0", "improve advertised", True, f"\"improve\": {show(improve)}"))
    return spec


async def _l1(nc: Client, service: str, spec: dict[str, Any], timeout: float,
              checks: list[Check]) -> bool:
    if spec["improve"] is False:
        checks.append(Check("L1", "takes part", False, (
            f"{service} advertises \"improve\": false: it does not take part in the loop")))
        return False
    checks.append(Check("L1", "takes part", True, "\"improve\": true"))
    subject = S.apply_request(service)
    problem = _advertised_subject(spec, "apply", subject)
    if problem is not None:
        checks.append(Check("L1", "apply advertised", False, problem))
        return False
    checks.append(Check("L1", "apply advertised", True, subject))
    answer = await ask(nc, subject, MALFORMED_ORDER, timeout)
    what = f"a malformed ApplyOrder {show(MALFORMED_ORDER)}"
    if not answer.answered:
        passed, detail = False, f"{answer.problem}: {what} must get a reply"
    elif (err := error_of(answer.value)) is not None:
        passed, detail = True, f"{what} got an error reply ({describe_error(err)})"
    elif (result := _apply_result(answer.value)) is None:
        passed, detail = False, (f"{what} got {show(answer.value)}: neither an ApplyResult "
                                 "nor an error reply")
    elif result.ok:
        passed, detail = False, f"{what} was answered ok: true"
    else:
        passed, detail = True, f"{what} was refused: {result.error}"
    checks.append(Check("L1", "malformed order answered", passed, detail))
    return passed and await evidence.emission(nc, service, timeout, checks)


async def _l2(nc: Client, service: str, spec: dict[str, Any], timeout: float,
              checks: list[Check]) -> bool:
    subject = S.apply_request(service)
    order = probe_order(service, spec, "L2")
    first = await ask(nc, subject, order, timeout)
    passed, detail = _refusal(first, subject, "L2")
    checks.append(Check("L2", "refuses without acceptance", passed, detail))
    if not passed:
        return False
    forged = await ask(nc, subject, probe_order(service, spec, "L0"), timeout)
    passed, detail = _refusal(forged, subject, "L0")
    checks.append(Check("L2", "refuses an L0 order triage never accepted", passed, detail))
    if not passed:
        return False
    second = await ask(nc, subject, order, timeout)
    if not second.answered:
        passed, detail = False, f"{second.problem}: a repeated order must get the same reply"
    elif second.value != first.value:
        passed, detail = False, (f"a repeated order got a different reply: first "
                                 f"{show(first.value)}, then {show(second.value)}")
    else:
        passed, detail = True, "a repeated order got the same reply"
    checks.append(Check("L2", "idempotent", passed, detail))
    return passed


def holds_skills(spec: dict[str, Any]) -> bool:
    """TOFU by content hash (SPEC 09 §4) is about skills: a service that advertises no
    `skill:` scheme and no skills read has nothing for L3 to ask of it."""
    schemes = spec.get("schemes")
    return ("get" in spec or "identity" in spec
            or (isinstance(schemes, list) and "skill:" in schemes))


async def _l3(nc: Client, service: str, spec: dict[str, Any], timeout: float,
              checks: list[Check]) -> bool:
    if not holds_skills(spec):
        checks.append(Check("L3", "content-addressed skills", True,
                            "not applicable: the service holds no skills (no skill: scheme, "
                            "no skills read), so no TOFU grant can drift here"))
        return True
    problem = _advertised_subject(spec, "get", None)
    checks.append(Check("L3", "get advertised", problem is None,
                        str(spec.get("get")) if problem is None else
                        f"{problem}: a skills read under a grant"))
    identity = spec.get("identity")
    checks.append(Check("L3", "identity advertised", identity == IDENTITY, (
        f"\"identity\": {IDENTITY!r}" if identity == IDENTITY else
        f"the spec must advertise \"identity\": {IDENTITY!r} (got {identity!r})")))
    if problem is not None:
        return False
    subject = spec["get"]
    probe = f"probe:{secrets.token_hex(32)}"
    answer = await ask(nc, subject, {"skill": probe}, timeout)
    what = f"a read of {probe}, which nobody granted,"
    err = error_of(answer.value) if answer.answered else None
    if not answer.answered:
        passed, detail = False, f"{answer.problem}: {what} must be refused"
    elif isinstance(answer.value, dict) and "definition" in answer.value:
        passed, detail = False, f"{what} returned a definition"
    elif err is None:
        passed, detail = False, f"{what} got {show(answer.value)}, not an error reply"
    elif err.get("code") not in GET_REFUSALS:
        passed, detail = False, (f"{what} was refused with code {err.get('code')!r}, not one of "
                                 f"{', '.join(GET_REFUSALS)}")
    else:
        passed, detail = True, f"{what} was refused ({describe_error(err)})"
    checks.append(Check("L3", "no read without a grant", passed, detail))
    return all(c.passed for c in checks if c.level == "L3")


async def _l4(nc: Client, service: str, spec: dict[str, Any], timeout: float,
              checks: list[Check]) -> bool:
    subject = S.lkg_request(service)
    problem = _advertised_subject(spec, "lkg", subject)
    if problem is not None:
        checks.append(Check("L4", "lkg advertised", False,
                            f"{problem}: the pre-apply last-known-good check"))
        return False
    checks.append(Check("L4", "lkg advertised", True, subject))
    lkg = probe_lkg()
    order = probe_order(service, spec, "L4", lkg)
    answer = await ask(nc, subject, {"proposal_id": order.proposal_id, "lkg": lkg}, timeout)
    what = f"a last-known-good check of {lkg[0]['artefact']}, which exists nowhere,"
    value = answer.value
    if not answer.answered:
        passed, detail = False, f"{answer.problem}: {what} must be answered ok: false"
    elif not isinstance(value, dict) or not isinstance(value.get("ok"), bool):
        passed, detail = False, f"{what} got {show(value)}, not {{\"ok\": false, ...}}"
    elif value["ok"]:
        passed, detail = False, f"{what} was confirmed"
    else:
        passed, detail = True, f"{what} was refused: {show(value)}"
    checks.append(Check("L4", "no unknown last-known-good", passed, detail))
    if not passed:
        return False
    apply_subject = S.apply_request(service)
    passed, detail = _refusal(await ask(nc, apply_subject, order, timeout), apply_subject, "L4")
    checks.append(Check("L4", "refuses without acceptance", passed, detail))
    return (passed and await evidence.atomic_window(nc, service, spec, timeout, checks)
            and await evidence.reversal_ids(nc, service, checks))


async def probe(nc: Client, service: str, timeout: float = 2.0) -> Report:
    """Probe the live `service` over `nc`; each request waits at most `timeout` seconds."""
    if not S.SERVICE_RE.match(service):
        raise ValueError(f"service name {service!r} must match {S.SERVICE_RE.pattern}")
    checks: list[Check] = []
    spec = await _l0(nc, service, timeout, checks)
    if spec is not None:
        for level in (_l1, _l2, _l3, _l4):
            if not await level(nc, service, spec, timeout, checks):
                break
    return Report(service=service, level=level_of(checks), checks=checks, spec=spec)


# -- the mesh ----------------------------------------------------------------------------------


@dataclass
class MeshReport:
    """Every service found or named, its report, and the level the mesh meets."""

    reports: list[Report]

    @property
    def participants(self) -> list[Report]:
        """The services in the loop: all but those that advertised their omission (an L0
        service does not participate) — a named service that did not answer counts, unrated."""
        return [r for r in self.reports
                if not (r.level == "L0" and (r.spec or {}).get("improve") is False)]

    @property
    def level(self) -> str | None:
        """SPEC 09: "the mesh as a whole is conformant at the lowest conformance level of any
        participating service"; None when a participant meets no level, or there is none."""
        levels = [r.level for r in self.participants]
        if not levels or any(level is None for level in levels):
            return None
        return min(levels, key=lambda level: LEVELS.index(level or "L0"))


def mesh_level_line(mesh: MeshReport) -> str:
    if not mesh.participants:
        return "the mesh: no service takes part in the improve loop"
    level = mesh.level
    lowest = [r.service for r in mesh.participants if r.level == level]
    if level is None:
        return (f"the mesh meets no level: {', '.join(lowest)} "
                f"{'meets' if len(lowest) == 1 else 'meet'} none")
    return f"the mesh meets {level} (its lowest participant: {', '.join(lowest)})"


def in_loop(report: Report) -> bool:
    """Whether the service takes part: all but one that advertised its omission."""
    return not (report.level == "L0" and (report.spec or {}).get("improve") is False)


def failed(report: Report) -> bool:
    """A level the kit probed failed (for a service in the loop; an advertised omission is
    not a failure). `improved conformance` exits 1 then."""
    return in_loop(report) and report.first_failure is not None


def level_lines(report: Report) -> list[str]:
    """Per level: what passed, what failed, and what was not probed and why."""
    out: list[str] = []
    stopped: str | None = None
    for level in LEVELS:
        mine = [c for c in report.checks if c.level == level]
        if not mine:
            out.append(f"{level}  not probed: " + (f"{stopped} failed first" if stopped
                                                   else "the service answered nothing"))
            continue
        bad = next((c for c in mine if c.failed), None)
        if bad is not None:
            out.append(f"{level}  FAIL {bad.name}: {bad.detail}")
            stopped = stopped or level
        else:
            names = [c.name for c in mine if c.passed]
            out.append(f"{level}  pass: {', '.join(names) if names else 'nothing to probe'}")
        out += [f"{level}  not probed: {c.name}: {c.detail}" for c in mine if not c.probed]
    return out


def render_mesh(mesh: MeshReport) -> str:
    """Per service its level (and why not the next), then per level what was probed and what
    could not be; the services that emit an invalid proposal; then the mesh's level."""
    if not mesh.reports:
        return ("no service answered improved.spec.discover (each service that serves "
                "spec.get with improved.serve_spec answers it); name services to probe them")
    width = max(len(r.service) for r in mesh.reports)
    lines = ["conformance of the mesh (SPEC 09):"]
    for r in mesh.reports:
        met = r.level or "none"
        if not in_loop(r):
            lines.append(f"  {r.service:<{width}}  {met:<4}  advertises no improvement "
                         "surface: not in the loop")
            continue
        failure = r.first_failure
        why = "—" if r.next_level is None and failure is None else (
            f"not {r.next_level}: {failure.detail if failure else 'not probed'}")
        lines.append(f"  {r.service:<{width}}  {met:<4}  {why}")
        lines += [f"      {line}" for line in level_lines(r)]
    invalid = [r.service for r in mesh.reports if any(
        c.failed and c.name == EMITS for c in r.checks)]
    if invalid:
        lines.append(f"emits invalid proposals: {', '.join(invalid)}")
    lines.append(mesh_level_line(mesh))
    return "\n".join(lines)


async def discover(nc: Client, timeout: float = 1.0) -> dict[str, dict[str, Any]]:
    """The services that answer the `improved.spec.discover` broadcast within `timeout`, by
    name, with what they advertise; answers that name no valid service are left out."""
    found: dict[str, dict[str, Any]] = {}
    inbox = nc.new_inbox()

    async def on_answer(msg: Msg) -> None:
        try:
            spec = msgspec.json.decode(msg.data)
        except msgspec.DecodeError:
            return
        name = spec.get("service") if isinstance(spec, dict) else None
        if isinstance(name, str) and S.SERVICE_RE.match(name):
            found.setdefault(name, spec)

    sub = await nc.subscribe(inbox, cb=on_answer)
    try:
        await nc.publish(S.SPEC_DISCOVER, b"{}", reply=inbox)
        await nc.flush()
        await asyncio.sleep(timeout)
    finally:
        await sub.unsubscribe()
    return found


async def probe_mesh(nc: Client, named: list[str] | None = None,
                     timeout: float = 2.0) -> MeshReport:
    """Probe every service that answers discovery, and every one `named` (found or not)."""
    for service in named or []:
        if not S.SERVICE_RE.match(service):
            raise ValueError(f"service name {service!r} must match {S.SERVICE_RE.pattern}")
    services = sorted(set(await discover(nc, min(timeout, 1.0))) | set(named or []))
    return MeshReport([await probe(nc, service, timeout) for service in services])
