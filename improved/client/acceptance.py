"""Service-side check that an order was accepted (SPEC 09 conformance L2).

An owning service should not take the daemon's word that a proposal may be applied: the
evidence is public. An L2/L4 approval is a trailer on the proposal's hash-chained audit chain,
an L3 auto-apply rests on a retained grant record, and an operator-requested rollback is a
`rollback` trailer on the original's chain. `check` reads that evidence itself and answers None
(apply) or a refusal starting `not_accepted: `.

Chains are read whole through a consumer filtered on the one chain (`chains.read_sequenced`, a
read a deployment can limit to the service's own chains and the grant chains) and verified with
`improved.core.audit.verify_chain`, so the broker is not trusted either.
"""

from __future__ import annotations

import time
from typing import Any

from improved.client.chains import current_grant, read_chain
from improved.core import authority, propose
from improved.core.apply import rolls_back
from improved.core.audit import verify_chain
from improved.core.trailers import (
    VERDICTS,
    Approved,
    Data,
    Decided,
    Inherited,
    QuorumReached,
    RollbackAsked,
    Superseded,
    Unknown,
    kind_of_body,
)
from improved.protocol import canonical, wire
from improved.protocol import subjects as S
from improved.protocol.model import ApplyOrder

PREFIX = "not_accepted: "
# the trailers that accept, by their actor: an operator's approval, an inherited one, a quorum's
ACCEPTING: tuple[type[Data], ...] = (Approved, Inherited, QuorumReached)


def withdraws(body: dict[str, Any]) -> str | None:
    """The verdict of a trailer that undoes an earlier acceptance — a rejection (or expiry),
    new content — or None. Read as a triage verdict whatever stage the trailer claims, and
    by its verdict alone: what takes an acceptance back is never missed for its refs."""
    verdict = body.get("verdict")
    if not isinstance(verdict, str):
        return None
    kind, status = VERDICTS.get(("triage", verdict), (Unknown, None))
    return verdict if kind is Superseded or status == "rejected" else None


def _no(text: str) -> str:
    return PREFIX + text


async def _verified(js: Any, svc: str, chain_id: str) -> tuple[list[dict[str, Any]], str | None]:
    """(the chain's trailers, None) or ([], the refusal) when it is missing or does not verify."""
    bodies = await read_chain(js, S.audit(svc, chain_id))
    if not bodies:
        return [], _no(f"no audit chain for {chain_id[:8]}")
    broken = verify_chain(chain_id, bodies)
    if broken is not None:
        return [], _no(f"the audit chain of {chain_id[:8]} does not verify: {broken}")
    return bodies, None


async def _approved(js: Any, svc: str, pid: str, authority: str,
                    accepting: tuple[type[Data], ...] = ACCEPTING) -> str | None:
    """None when an accepting trailer by `authority` stands on the chain of `pid`."""
    bodies, refusal = await _verified(js, svc, pid)
    if refusal:
        return refusal
    accepted, withdrawn = False, None
    for body in bodies:
        if issubclass(kind_of_body(body), accepting) and body.get("actor") == authority:
            accepted, withdrawn = True, None
        elif withdraws(body) and accepted:
            accepted, withdrawn = False, withdraws(body)
    if accepted:
        return None
    if withdrawn:
        return _no(f"the approval by {authority} on the audit chain of {pid[:8]} was "
                   f"withdrawn ({withdrawn})")
    return _no(f"no approval by {authority} on the audit chain of {pid[:8]}")


async def _auto_accepted(js: Any, svc: str, pid: str) -> str | None:
    """None when triage accepted `pid` as L0 on its verified chain and nothing withdrew it: an
    L0 order is applied under the policy principal, so the evidence is triage's own accept."""
    bodies, refusal = await _verified(js, svc, pid)
    if refusal:
        return refusal
    accepted = False
    for body in bodies:
        if kind_of_body(body) is Decided and body.get("verdict") == "accept" \
                and body.get("gate_class") == "L0":
            accepted = True
        elif withdraws(body):
            accepted = False
    if accepted:
        return None
    return _no(f"triage never accepted {pid[:8]} as L0 on its audit chain")


async def _rollback_asked(js: Any, svc: str, original: str, authority: str) -> str | None:
    """None when `authority` asked for the rollback of `original` on its chain."""
    bodies, refusal = await _verified(js, svc, original)
    if refusal:
        return refusal
    if any(kind_of_body(body) is RollbackAsked and body.get("actor") == authority
           for body in bodies):
        return None
    return _no(f"no rollback by {authority} on the audit chain of {original[:8]}")


async def _granted(js: Any, skill: Any) -> str | None:
    """None when the skill the proposal carries has an active, unexpired grant on its verified
    grant chain (the retained Grant record is an output anyone could publish)."""
    if not isinstance(skill, dict):
        return _no("an L3 proposal must carry proposal_data.skill")
    try:
        identity = canonical.skill_identity(skill)
    except canonical.CanonicalError as exc:
        return _no(f"the skill has no identity: {exc}")
    grant = await current_grant(js, identity)
    if grant is None:
        return _no(f"no grant for {identity} on its chain")
    if not authority.grant_covers(grant, identity, int(time.time() * 1000)):
        return _no(f"the grant for {identity} is not active or has expired")
    return None


async def operator_approved(js: Any, order: ApplyOrder) -> str | None:
    """None when the order's authority is an operator whose own signed approval (an `approve`
    trailer, not a quorum's or an inherited one) stands on the proposal's verified chain: what
    a change the owner deems to need the operator (a breaking schema, SPEC 08 §7) rests on."""
    if not order.authority.startswith("operator:"):
        return _no(f"{order.authority} is not an operator")
    return await _approved(js, order.proposal.service, order.proposal_id, order.authority,
                           (Approved,))


def _bound(order: ApplyOrder) -> str | None:
    """Evidence is filed under the proposal id, so the id must be the content's address."""
    try:
        pid, _ = propose.identify(order.proposal)
    except wire.WireError as exc:
        return _no(f"the proposal has no content address: {exc.message}")
    if pid != order.proposal_id:
        return _no(f"proposal_id {order.proposal_id[:8]} is not the content address of the "
                   f"proposal ({pid[:8]})")
    return None


async def check(js: Any, order: ApplyOrder) -> str | None:
    """None when the order may be applied, else why not (`not_accepted: ...`)."""
    proposal = order.proposal
    cls = proposal.change_class
    if cls == "L1":
        return _no("L1 proposals are never applied")
    refusal = _bound(order)
    if refusal:
        return refusal
    svc = proposal.service
    if cls == "L0":
        return await _auto_accepted(js, svc, order.proposal_id)
    original = rolls_back(proposal)
    if original is not None and S.ID_RE.match(original):
        asked = await _rollback_asked(js, svc, original, order.authority)
        if asked is None:
            return None
        own = await _approved(js, svc, order.proposal_id, order.authority)
        return None if own is None else asked  # a learn-back rollback has a chain of its own
    if cls == "L3":
        refusal = await _granted(js, (proposal.proposal_data or {}).get("skill"))
        if refusal is None:
            return None
        # no grant: an operator may still have approved it (triage defers it as `no_grant`)
        return None if await _approved(js, svc, order.proposal_id, order.authority) is None \
            else refusal
    return await _approved(js, svc, order.proposal_id, order.authority)
