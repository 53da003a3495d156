"""The daemon's answer to what an operator just did, read on the chain it lands on.

A signed act (a review, a grant, a vote, a crisis resolution) is published on the inbound
stream; the daemon answers it on an audit chain: a trailer that carries the act — its `act:`
ref is the envelope's digest (docs/protocol.md, "Signed operator acts") — either counting it
(`approve`, `reject`, `rollback`, `grant`, `revoke`, `vote`, `crisis_resolved`) or `refused`
with a `code:`. A command reads that chain from the head it saw before publishing, with direct
gets (never the whole log), until the verdict is there or its time is up.

The top of this module is pure: given the act's digest and the trailers read, the verdict and
its one line (`of_act`); the same for a proposal's triage (`of_triage`), a reversal published
by `improved revert` (`of_reversal`) and an apply resumed by `improved retry` (`of_apply`). The
wait (`watch`) is at the bottom."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from improved.cli.errors import Failure
from improved.client.connection import Target
from improved.client.deployment import Deployment
from improved.core import gradient
from improved.core.trailers import (
    Applied,
    Decided,
    Inherited,
    LkgRefused,
    Refused,
    Rejected,
    RolledBack,
    TrailerData,
    TrailerDataError,
    Undelivered,
    decode_body,
    moves_to,
    verdict_of,
)

DEFAULT_TIMEOUT_S = 10.0
POLL_S = 0.1

# what a refusal code means for the operator: what to do next ({id}: how to name the subject)
FIXES: dict[str, str] = {
    "unsigned": "sign it: `improved approve|reject|rollback` sign with your operator key",
    "malformed": "the act is not a valid one; sign it again with the `improved` command",
    "wrong_type": "the act is of another kind; sign it again with the `improved` command",
    "unknown_key": "the daemon does not trust this key: add the entry `improved keys new` "
                   "printed to its [trust.operators] (voters: [trust.quorum]), then `kill "
                   "-HUP` its pid (it re-reads its trust store) or restart it",
    "bad_signature": "the signature does not verify against the key the daemon trusts for "
                     "that principal: sign with that principal's own key (--key, --principal)",
    "principal_mismatch": "the key is trusted for another principal: sign as the principal "
                          "its [trust.operators] entry names",
    "expired": "the act's time is outside trust.act_max_age_s (or ahead of the daemon's "
               "clock): check this machine's clock and sign again",
    "replayed": "this very envelope was used already: sign a new act",
    "superseded": "newer content replaced this proposal: review the newer one "
                  "(`improved review`)",
    "wrong_proposal": "the act names another proposal: sign it for this one",
    "not_awaiting_review": "it is not waiting for an operator: `improved show {id}` says where "
                           "it is",
    "apply_in_flight": "its apply was already dispatched and the outcome decides: wait for it "
                       "(`improved show {id}`), then `improved rollback {id}` if it must be "
                       "undone",
    "unseen_body": "approve what will run: read it with `improved show {id}`, then "
                   "`improved approve {id}` signs its digest",
    "not_applied": "only an applied proposal can be rolled back, once: `improved show {id}`",
    "not_rollbackable": "the apply recorded no inverse: propose the change back as a new "
                        "proposal",
    "not_applied_at_l2": "a grant names, with --proposal, the L2 proposal of exactly this "
                         "definition that an operator approved and that was applied",
    "closed": "no quorum is open on it: `improved show {id}` says where it is",
    "proposer": "the proposer never votes on its own proposal: another voter must",
    "unread": "vote on what the chain holds: leave out --read, and `improved vote` takes the "
              "digests from the verified chain",
    "proposer_session": "the proposer's own session never counts: vote from another session",
    "same_key": "this key voted already; a vote counts once",
    "correlated_session": "this session voted already with another key: correlated votes "
                          "count once; vote from another session",
}

ACCEPTED: dict[str, str] = {
    "approve": "approved; the apply follows (`improved show {id}` shows its outcome)",
    "reject": "rejected; it entered the rejection ledger",
    "rollback": "the recorded inverse goes to its service (`improved show {id}` shows the "
                "outcome)",
    "grant": "granted; an L3 proposal of exactly this hash now applies without an operator",
    "revoke": "revoked; the next L3 apply of this hash waits for an operator",
    "vote": "counted: {reason}",
    "crisis_resolved": "resolved; applies resume",
}


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    line: str
    code: str | None = None

    @property
    def exit_code(self) -> int:
        return 0 if self.accepted else 1


def of_act(digest: str, trailers: Iterable[dict[str, Any]], what: str, subject: str) -> \
        Verdict | None:
    """The daemon's verdict on the signed act whose envelope digest is `digest`, among
    `trailers` (raw bodies, in chain order); None while it is not there. `what` names the act
    (`approve of <id>`), `subject` is how a hint names what it acts on (an id)."""
    for body in trailers:
        data = _data(body)
        if data is None or getattr(data, "act", None) != digest:
            continue
        if isinstance(data, Refused):
            reason = str(body.get("reason", ""))
            why = reason.partition("): ")[2] or reason
            fix = FIXES.get(data.code, "`improved show {id}` has the trailer").format(id=subject)
            return Verdict(False, f"refused: {what} ({data.code}): {why}; {fix}", data.code)
        verdict = verdict_of(data)
        template = ACCEPTED.get(str(verdict))
        if template is None:  # an act trailer of a kind this command does not know
            return Verdict(True, f"accepted: {what} ({verdict})")
        return Verdict(True, f"accepted: {what}: "
                       + template.format(reason=body.get("reason", ""), id=subject))
    return None


def no_verdict(what: str, timeout: float, check: str) -> str:
    """The line when nothing answered in time: the act is out, and where to look."""
    return (f"no verdict within {timeout:g} s: {what} was published, but the daemon has not "
            f"recorded it yet (is it running? on this server?); `{check}` shows whether it does")


TRIAGE_NEXT: dict[str, str] = {
    "accept": "its service applies it (`improved show {id}` shows the outcome)",
    "awaiting_operator": "it waits for an operator: `improved review`, then "
                         "`improved approve|reject {id}`",
    "no_grant": "no active grant covers this skill hash: an operator approves it "
                "(`improved approve {id}`) or grants the hash (`improved grant`)",
    "awaiting_quorum": "it waits for three quorum votes (`improved vote {id}`) or an operator",
    "quorum_dissent": "a voter dissented: an operator decides (`improved approve|reject {id}`)",
    "surfaced": "L1 is surfaced only, never applied: re-propose at L2 to act on it",
    "feedback_collapse": "every positive signal is the proposer's own: an independent signal "
                         "releases it",
    "circuit_open": "autonomous applies are held back by the circuit breaker "
                    "(`improved status`); it is triaged again when it closes",
    "autonomy_off": "autonomy is switched off (`improved status`); it is triaged again when "
                    "it is on",
    "forbidden_target": "change what the proposal touches",
    "class_mismatch": "re-propose at the right class (a class is never up- or downgraded)",
    "scope_mismatch": "re-propose with the scope the target's scheme implies",
    "expired": "re-propose with a later valid_to",
    "duplicate_rejected": "the same idea on the same evidence was rejected: re-propose with "
                          "new evidence",
    "invalid": "fix the proposal as the reason says and propose it again",
    "superseded": "newer content under the same dedup_key replaced it",
}


def of_triage(pid: str, status: str, trailers: Sequence[dict[str, Any]],
              target_ref: str) -> Verdict:
    """`improved propose`: the triage decision the registration led to, with its cause and what
    follows or what to fix. Accepted unless rejected or expired."""
    t = next((b for b in reversed(trailers)
              if isinstance(_data(b), Decided | Rejected | Inherited)), None)
    ok = status not in ("rejected", "expired")
    if t is None:
        return Verdict(ok, f"{pid} {status}: not triaged yet; `improved show {pid}` follows it")
    data, cause = _data(t), t.get("cause")
    verdict = str(t.get("verdict"))
    reason = str(t.get("reason") or "")
    hint = gradient.unlisted(gradient.scheme_of(target_ref))
    if cause == "class_mismatch" and hint is not None:
        if hint not in reason:  # a daemon from before it said so names only the class
            reason = f"{hint}; {reason}"
        fix = "" if "fix the scheme" in reason else \
            "fix the target's scheme, or propose at the class it needs"
    else:
        accepted = isinstance(data, Inherited) or (isinstance(data, Decided)
                                                   and data.verdict == "accept")
        key = "accept" if accepted else str(cause)
        fix = TRIAGE_NEXT.get(key, "`improved show {id}` has the trailers").format(id=pid)
    said = f"{verdict}/{cause}" if cause else verdict
    return Verdict(ok, f"{pid} {status}: {said} at {t.get('gate_class')}: "
                       f"{each_once(reason, fix)}", cause)


def each_once(*parts: str) -> str:
    """The parts' clauses (split at "; ") joined, each said once: the daemon's reason often
    ends with the fix this module would add, and a clause another one starts with gives way
    to the longer one, where the first stood."""
    clauses: list[str] = []
    for part in parts:
        for clause in (c.strip() for c in part.split("; ")):
            if not clause:
                continue
            for i, seen in enumerate(clauses):
                if clause.startswith(seen):
                    clauses[i] = clause
                    break
                if seen.startswith(clause):
                    break
            else:
                clauses.append(clause)
    return "; ".join(clauses)


def of_reversal(rid: str, trailers: Iterable[dict[str, Any]]) -> Verdict | None:
    """`improved revert`: the reversal inherits its original's approval, or is triaged like
    any proposal (then it does not run on its own)."""
    for body in trailers:
        match _data(body):
            case Inherited():
                return Verdict(True, f"accepted: reversal {rid} inherited the approval of "
                                     f"{body.get('actor')} and runs; `improved show {rid}` "
                                     "shows its outcome")
            case Decided() | Rejected() as data:
                cause = body.get("cause")
                return Verdict(False, f"refused: reversal {rid} did not inherit an approval: "
                                      f"{data.verdict}/{cause}: {body.get('reason')}", cause)
    return None


def of_apply(pid: str, trailers: Iterable[dict[str, Any]]) -> Verdict | None:
    """`improved retry`: the outcome of the apply it resumed — applied, failed (the service
    refused), or withdrawn because no service received it."""
    for body in trailers:
        data = _data(body)
        if isinstance(data, Applied | LkgRefused | RolledBack):
            if moves_to(data) is not None:  # applied, or rolled back
                return Verdict(True, f"accepted: {pid} {data.verdict} by its service")
            return Verdict(False, f"refused: the service refused {pid}: "
                                  f"{data.error or body.get('reason')}; fix the cause "
                                  "and propose again", "failed")
        if isinstance(data, Undelivered):
            return Verdict(False, f"refused: no service took {pid} "
                                  f"({data.error or body.get('reason')}): start the "
                                  "owning service; the daemon keeps retrying on its own, and "
                                  f"`improved retry {pid}` tries at once", "unreachable")
    return None


# -- what a verify checked, against what, and what it could not ------------------------------

# the exit codes of a verify: clean, something forged, altered or missing, could not run, and
# nothing wrong found but the writers not checked for lack of a trusted daemon key
CLEAN, BROKEN, UNRUNNABLE, UNVERIFIED = 0, 1, 2, 3
NO_KEY = ("no trusted daemon key: name it in [trust] daemons, give --data-dir of the daemon "
          "that wrote the log, or --checkpoint FILE")


def anchors_said(sources: Mapping[str, str]) -> str:
    """The trust anchors in a few words: `daemon key 1a2b…(from the data directory's
    checkpoint key /x/checkpoint.pem)`, each key with where it was found."""
    keys = [f"{kid[:16]}… ({where})" for kid, where in sorted(sources.items())]
    return ("daemon key " if len(keys) == 1 else "daemon keys ") + ", ".join(keys)


def chain_said(problem: str | None, sources: Mapping[str, str]) -> str:
    """One chain's verdict, in the words `improved show` and `improved audit verify` share:
    BROKEN with the first break; VERIFIED with what was checked and against which key; or,
    with no trusted daemon key, UNVERIFIED writers, naming what was not checked."""
    if problem is not None:
        return f"BROKEN: {problem}"
    if sources:
        return ("VERIFIED: hashes, links, daemon signatures and signed acts, against "
                + anchors_said(sources))
    return (f"UNVERIFIED writers ({NO_KEY}): hashes and links verified; who wrote the "
            "trailers and the signed acts they carry are not checked")


def log_said(chains: int, broken: bool, sources: Mapping[str, str],
             runtimes_unverified: int = 0) -> tuple[str, int]:
    """The last line of `improved audit verify` and its exit code (CLEAN, BROKEN,
    UNVERIFIED): what is broken is broken whatever the keys; a log in which nothing is wrong
    is VERIFIED only against a trusted daemon key, else UNVERIFIED, never broken; so are tool
    runtimes' chains with no key in [trust.runtimes] (`runtimes_unverified`)."""
    if broken:
        return ("BROKEN: the log is not what its writers wrote: something was forged, altered "
                "or removed (each break is named above)"), BROKEN
    if not sources:
        return (f"UNVERIFIED writers ({NO_KEY}): hashes and links of {chains} chains "
                "verified, nothing found removed or altered; who wrote the trailers and the "
                "signed acts they carry are not checked"), UNVERIFIED
    verified = (f"{chains} chains: hashes, links, daemon signatures and signed acts, against "
                f"{anchors_said(sources)}")
    if runtimes_unverified:
        return (f"UNVERIFIED writers of {runtimes_unverified} tool runtime chains (no key in "
                f"[trust.runtimes]); VERIFIED {verified}"), UNVERIFIED
    return f"VERIFIED {verified}", CLEAN


def is_sound(said: str) -> bool:
    """Whether a chain's verdict (`chain_said`) found nothing wrong, verified or not."""
    return said.startswith(("VERIFIED", "UNVERIFIED"))


def _data(body: dict[str, Any]) -> TrailerData | None:
    """What a raw trailer body says (`trailers.decode_body`), or None when it is no trailer
    this version can read."""
    try:
        return decode_body(body)
    except TrailerDataError:
        return None


def add_wait_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"seconds to wait for the daemon's verdict ({DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--no-wait", action="store_true",
                   help="publish and return at once, without waiting for the verdict")


async def watch(read: Callable[[int], Awaitable[list[tuple[int, dict[str, Any]]]]], start: int,
                judge: Callable[[list[dict[str, Any]]], Verdict | None],
                timeout: float) -> Verdict | None:
    """Read what is appended to one chain from stream sequence `start` on (`read(start)`:
    direct gets from there), until `judge` finds the verdict in what was read; None when
    `timeout` seconds pass first."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        new = await read(start)
        if new:
            start = new[-1][0] + 1
            seen += [body for _, body in new]
            verdict = judge(seen)
            if verdict is not None:
                return verdict
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))


async def after(url: str | Target, chain: str, send: Callable[[Deployment], Awaitable[object]],
                judge: Callable[[list[dict[str, Any]]], Verdict | None],
                timeout: float | None, from_start: bool = False) -> Verdict | None:
    """Note the head of `chain`, `send` (publish the act), then `watch` the chain from past
    that head (`from_start`: from its start) for `judge`'s verdict; `timeout` None: send
    only (`--no-wait`)."""
    from improved.cli.common import deployment

    async with deployment(url, bind=False) as store:
        head = 0 if from_start else (await store.chain_head(chain))[0]
        await send(store)
        if timeout is None:
            return None
        return await watch(lambda start: store.read_chain_at(chain, start), head + 1, judge,
                           timeout)


def conclude(verdict: Verdict | None, what: str, timeout: float, check: str) -> int:
    """Print the verdict's one line (stdout when accepted) and give the exit code; a refusal
    or no verdict in time is a Failure (one line on stderr, exit 1)."""
    if verdict is None:
        raise Failure(no_verdict(what, timeout, check))
    if not verdict.accepted:
        raise Failure(verdict.line)
    print(verdict.line)
    return 0
