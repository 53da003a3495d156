"""Operator authority from the terminal: keys, signed reviews, grants, crisis resolutions,
quorum votes, and publishing an L4 apply's recorded reversal."""

from __future__ import annotations

import argparse
import asyncio
import base64
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

from improved.cli import ids, verdicts
from improved.cli.common import (
    add_connection_args,
    add_signer_args,
    config_of,
    full_id,
    load_signing_key,
    located,
    publish_on,
    signer_of,
    url_of,
)
from improved.cli.errors import USAGE, Failure
from improved.client import keys
from improved.client.connection import Target
from improved.client.deployment import Deployment
from improved.client.sdk import enqueue
from improved.core import authority, breaker, quorum, signing
from improved.core.identity import IDENTITY_RE
from improved.protocol import subjects as S
from improved.protocol.model import (
    Actor,
    CrisisAct,
    Envelope,
    GrantCommand,
    Review,
    Vote,
    to_json,
)

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from improved.core.record import ProposalRecord


def cmd_keys_show(args: argparse.Namespace) -> int:
    """The public half of a key file: what a trust store lists ([trust.daemons] and the rest
    take the base64 key) and the key id signatures name (a service's `--trust-daemon`)."""
    key = load_signing_key(Path(args.file))
    public = signing.raw_public(key.public_key())
    print(f"public key: {base64.b64encode(public).decode()}")
    print(f"key id: {signing.keyid_of(public)}")
    return 0


def cmd_keys_new(args: argparse.Namespace) -> int:
    """An operator key ([trust.operators]), a quorum voter key ([trust.quorum]) or a signer
    key ([trust.signers]: an agent, a check or a service whose signed signals count)."""
    if args.signer:
        who, table, filename = args.signer, "trust.signers", args.signer
        if not IDENTITY_RE.match(who) or who.startswith("operator:"):
            print("improved keys new: a signer is agent:<svc>:<name>, check:<name> or "
                  "service:<svc>", file=sys.stderr)
            return 2
    elif args.voter:
        who, table = args.voter, "trust.quorum"
        try:
            msgspec.convert(who, type=Actor)
        except msgspec.ValidationError:
            print("improved keys new: a voter is an actor id, e.g. agent-review-a",
                  file=sys.stderr)
            return 2
        filename = "voter:" + who
    else:
        who, table = args.principal, "trust.operators"
        if not who or not who.startswith("operator:") or len(who) <= len("operator:"):
            print("improved keys new: the principal is operator:NAME (or --voter NAME)",
                  file=sys.stderr)
            return 2
        filename = who
    try:
        path, public = keys.new_key(filename, Path(args.dir) if args.dir else None)
    except OSError as exc:
        return _key_not_written(exc, Path(args.dir) if args.dir else keys.key_dir())
    b64 = base64.b64encode(public).decode()
    print(f"private key: {path} (keep it; mode 0600)")
    print(f"keyid:       {signing.keyid_of(public)}")
    print("add to the daemon's config to trust it:\n")
    print(f'[{table}]\n"{who}" = "{b64}"')
    return 0


def _key_not_written(exc: OSError, where: Path) -> int:
    """`keys new` could not write: the key exists (exit 1, never overwritten), or its
    directory cannot be made or written (exit 2); one line either way."""
    if isinstance(exc, FileExistsError) and exc.filename is None:  # the key, not a directory
        print(f"improved keys new: {exc}", file=sys.stderr)
        return 1
    also = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(where) else ""
    why = "a file is in the way" if isinstance(exc, FileExistsError) else exc.strerror or exc
    print(f"improved keys new: cannot write a key under {where}: {why}{also}; give --dir (or "
          "$IMPROVED_KEYS) a directory this user may write", file=sys.stderr)
    return 2


def _signed(args: argparse.Namespace, url: Target, subject: str, env: Envelope, chain: str,
            what: str, about: str, check: str) -> int:
    """Publish a signed act on `subject` and, unless --no-wait, wait for the daemon's verdict
    on `chain` (the trailer carrying the act's digest) and say it in one line."""
    digest = signing.envelope_digest(env)
    timeout = None if args.no_wait else args.timeout
    verdict = asyncio.run(verdicts.after(
        url, chain, lambda store: publish_on(store, subject, env),
        lambda seen: verdicts.of_act(digest, seen, what, about), timeout))
    if timeout is None:
        print(f"{what}: published; `{check}` shows the daemon's verdict")
        return 0
    return verdicts.conclude(verdict, what, timeout, check)


def cmd_review_act(args: argparse.Namespace) -> int:
    """approve / reject / rollback: sign a Review and publish it on improve.triage.<svc>."""
    config = config_of(args)
    url = url_of(args, config)
    principal, key = signer_of(args)  # a missing key is said before anything is asked
    svc, record = located(url, args.id)
    act = review_act(record, args.verdict, principal, key, args.reason)
    if act.digest is not None:
        print(f"approving what will run (`improved show {act.pid}`: will_run), digest "
              f"{act.digest}")
    timeout = None if args.no_wait else args.timeout
    verdict = asyncio.run(send_review(url, svc, act, timeout))
    if timeout is None:
        print(f"{act.what}: published; `improved show {act.pid}` shows the daemon's verdict")
        return 0
    return verdicts.conclude(verdict, act.what, timeout, f"improved show {act.pid}")


@dataclass(frozen=True)
class ReviewAct:
    """A signed Review ready to publish: whose proposal, the envelope, what it is called in
    the verdict's line, and the will_run digest an approval names."""

    pid: str
    env: Envelope
    what: str
    digest: str | None


def review_act(record: ProposalRecord, verdict: Literal["approve", "reject", "rollback"],
               principal: str, key: Ed25519PrivateKey, reason: str) -> ReviewAct:
    """Sign `verdict` (approve, reject, rollback) on the proposal `record` (read from its
    verified chain, `common.located`): an approval names the digest of what will run."""
    pid = record.proposal_id  # in full, whatever prefix named it: it is signed
    digest = authority.will_run_digest(record.proposal) if verdict == "approve" else None
    review = Review(proposal_id=pid, verdict=verdict, principal=principal,
                    reason=reason, at=int(time.time() * 1000), body_digest=digest)
    env = signing.sign(signing.PAYLOAD_TYPES["review"], to_json(review), key)
    return ReviewAct(pid, env, f"{verdict} of {pid} signed by {principal}", digest)


async def send_review(url: Target, svc: str, act: ReviewAct, timeout: float | None
                      ) -> verdicts.Verdict | None:
    """Publish a signed Review on improve.triage.<svc> and wait `timeout` for the daemon's
    verdict on the proposal's chain (None: publish only, or nothing came in time)."""
    digest = signing.envelope_digest(act.env)
    return await verdicts.after(
        url, S.audit(svc, act.pid), lambda store: publish_on(store, S.inbound_review(svc), act.env),
        lambda seen: verdicts.of_act(digest, seen, act.what, act.pid), timeout)


def skill_problem(text: str) -> str | None:
    """Why `text` is not the NAME:SHA256 a grant binds, in words; None when it is. A prefix
    of the hash is refused: a grant signs the exact text it trusts."""
    name, colon, sha = text.partition(":")
    fix = "give the NAME:SHA256 `improved skill hash FILE` prints, whole"
    if not colon:
        return f"{text} is not NAME:SHA256; {fix}"
    if not S.SKILL_NAME_RE.match(name):
        return (f"{name!r} is not a skill name (lowercase letters, digits, _ and -, first a "
                f"letter); {fix}")
    if not re.fullmatch(r"[0-9a-f]+", sha):
        return f"{sha!r} is not a SHA-256 in lowercase hex; {fix}"
    if len(sha) < 64:
        return (f"{text} gives {len(sha)} of the hash's 64 hex digits: a grant binds the whole "
                f"hash, never a prefix; {fix}")
    if len(sha) > 64:
        return f"{text} has {len(sha)} hex digits, not SHA-256's 64; {fix}"
    return None


def cmd_grant_act(args: argparse.Namespace) -> int:
    problem = skill_problem(args.skill)
    if problem is not None:
        raise Failure(problem, USAGE)
    config = config_of(args)
    principal, key = signer_of(args)
    proposal = (asyncio.run(full_id(url_of(args, config), args.proposal))
                if args.proposal is not None else None)
    expires = int((time.time() + args.expires_in) * 1000) if args.expires_in else None
    try:
        cmd = GrantCommand(op=args.op, skill=args.skill, principal=principal, reason=args.reason,
                           at=int(time.time() * 1000), expires_at=expires,
                           proposal_id=proposal)
        msgspec.json.decode(to_json(cmd), type=GrantCommand)  # the daemon's own checks
    except msgspec.ValidationError as exc:
        field = str(exc).rpartition("`$.")[2].rstrip("`") or "a field"
        raise Failure(f"the {args.op} is not one the daemon takes: {field} is out of its "
                      "range or form", USAGE) from None
    env = signing.sign(signing.PAYLOAD_TYPES["grant"], to_json(cmd), key)
    sha = args.skill.partition(":")[2]
    return _signed(args, url_of(args, config), S.GRANTS, env, S.grant_audit(sha),
                   f"{args.op} of {args.skill} signed by {principal}", args.skill,
                   "improved audit verify")


def cmd_crisis_resolve(args: argparse.Namespace) -> int:
    config = config_of(args)
    principal, key = signer_of(args)
    act = CrisisAct(op="resolve", crisis=args.crisis, principal=principal, reason=args.reason,
                    at=int(time.time() * 1000))
    env = signing.sign(signing.PAYLOAD_TYPES["crisis"], to_json(act), key)
    # a refused resolution is only logged by the daemon: it shows here as no verdict in time
    return _signed(args, url_of(args, config), S.GRANTS, env,
                   S.autonomy_audit(breaker.AUTONOMY_ID),
                   f"resolution of {args.crisis} signed by {principal}", args.crisis,
                   "improved status")


def cmd_revert(args: argparse.Namespace) -> int:
    """Publish the reversal an L4 apply recorded before it ran (SPEC 09 §7.3)."""
    url = url_of(args, config_of(args))
    svc, record = located(url, args.id)
    pid = record.proposal_id
    if record.revert is None or record.revert_id is None:  # recorded together
        print(f"improved revert: {pid} has no recorded reversal (only an L4 apply that "
              "passed its last-known-good check has one)", file=sys.stderr)
        return 1
    if record.status != "applied":
        print(f"improved revert: {pid} is {record.status}, not applied", file=sys.stderr)
        return 1
    rid, revert = record.revert_id, record.revert

    async def send(store: Deployment) -> None:
        await enqueue(store.js, svc, to_json(revert), rid)

    what = (f"reversal {rid} of {pid} (under the original's approval by "
            f"{record.approved_by})")
    timeout = None if args.no_wait else args.timeout
    # a reversal's chain is new: read from its start, where its triage will be
    verdict = asyncio.run(verdicts.after(url, S.audit(svc, rid), send,
                                         lambda seen: verdicts.of_reversal(rid, seen), timeout,
                                         from_start=True))
    if timeout is None:
        print(f"{what} published; `improved show {rid}` follows it")
        return 0
    return verdicts.conclude(verdict, what, timeout, f"improved show {rid}")


def cmd_vote(args: argparse.Namespace) -> int:
    """Sign a quorum vote with a voter key and publish it on improve.quorum."""
    config = config_of(args)
    url = url_of(args, config)
    key = load_signing_key(Path(args.key))
    svc, record = located(url, args.id)
    pid = record.proposal_id
    read = args.read
    if read is None:  # what this proposal's verified chain holds, shown before it is signed
        read = quorum.expected_reads(record)
        print("read (the digests a vote names; `improved show` renders what they cover): "
              + ", ".join(read))
    try:
        vote = Vote(proposal_id=pid, vote=args.vote, voter=args.voter, session=args.session,
                    read=read, at=int(time.time() * 1000))
        msgspec.json.decode(to_json(vote), type=Vote)  # the daemon's own checks
    except msgspec.ValidationError as exc:
        print(f"improved vote: {exc}", file=sys.stderr)
        return 2
    env = signing.sign(signing.PAYLOAD_TYPES["vote"], to_json(vote), key)
    return _signed(args, url, S.QUORUM, env, S.audit(svc, pid),
                   f"{args.vote} on {pid} signed by {args.voter} (session {args.session})",
                   pid, f"improved show {pid}")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `authority` commands to the `improved` parser."""
    _register_keys_and_reviews(sub)
    _register_l4(sub)


def _register_keys_and_reviews(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """keys new; approve, reject, rollback; grant, revoke."""
    keys = sub.add_parser("keys", help="operator signing keys",
                          description="Operator signing keys (Ed25519).")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    knew = keys_sub.add_parser(
        "new", help="create an operator, voter or signer key and print its trust-store entry",
        description="Create an Ed25519 key for operator:NAME (or a quorum voter NAME) in the "
                    "key directory ($IMPROVED_KEYS, default ~/.config/improved/keys) and print "
                    "the [trust.operators] (or [trust.quorum]) entry the daemon's config needs "
                    "to trust it.")
    who = knew.add_mutually_exclusive_group(required=True)
    who.add_argument("--principal", metavar="operator:NAME", help="an operator's key")
    who.add_argument("--voter", metavar="NAME",
                     help="a quorum voter's key (its [trust.quorum] entry; see `improved vote`)")
    who.add_argument("--signer", metavar="IDENTITY",
                     help="a mesh identity whose signed signals count: agent:<svc>:<name>, "
                          "check:<name> or service:<svc> (its [trust.signers] entry; a "
                          "service's key also signs its answers to the daemon)")
    knew.add_argument("--dir", metavar="DIR", help="where to write the key")
    knew.set_defaults(func=cmd_keys_new)
    kshow = keys_sub.add_parser(
        "show", help="print a key file's public key and key id",
        description="Print the public key (base64, as [trust.operators], [trust.daemons] and "
                    "the other trust tables list it) and the key id (ed25519:<hex>) of an "
                    "Ed25519 PEM key file: an operator's key, or the daemon's checkpoint_key.")
    kshow.add_argument("file", metavar="FILE", help="the PEM private key file")
    kshow.set_defaults(func=cmd_keys_show)

    for verdict, what in (("approve", "approve a proposal waiting for an operator"),
                          ("reject", "reject a proposal (it enters the rejection ledger)"),
                          ("rollback", "undo an applied proposal with its recorded inverse")):
        act = sub.add_parser(
            verdict, help=f"sign and publish: {what}",
            description=f"Sign a Review ({verdict}: {what}) with your operator key (DSSE, "
                        f"Ed25519) and publish it on improve.triage.<svc>. The daemon verifies "
                        f"the signature against its trust store before anything moves.")
        add_connection_args(act)
        act.add_argument("id", metavar="ID", type=ids.id_arg,
                         help="the proposal id, or a unique prefix of it (4+ hex digits)")
        add_signer_args(act)
        verdicts.add_wait_args(act)
        act.set_defaults(func=cmd_review_act, verdict=verdict)

    for op in ("grant", "revoke"):
        act = sub.add_parser(
            op, help=f"sign and publish an L3 {op} for NAME:SHA256",
            description=f"Sign a GrantCommand ({op}) for exactly one skill content hash and "
                        f"publish it on improve.grants. A grant never covers another hash of "
                        f"the same name" + (", and holds only for a definition an operator "
                        "approved and that was applied at L2: name that proposal with "
                        "--proposal (SPEC 09 §3: L2 → L3 is where trust on first use is "
                        "granted)." if op == "grant" else "."))
        add_connection_args(act)
        act.add_argument("skill", metavar="NAME:SHA256")
        add_signer_args(act)
        verdicts.add_wait_args(act)
        if op == "grant":
            act.add_argument("--proposal", required=True, metavar="ID", type=ids.id_arg,
                             help="the L2 proposal whose approved, applied definition this "
                                  "grant trusts (its id or a unique prefix)")
            act.add_argument("--expires-in", type=float, metavar="SECONDS",
                             help="the grant lapses after this long")
        act.set_defaults(func=cmd_grant_act, op=op, expires_in=None, proposal=None)


def _register_l4(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """revert, vote (the quorum), crisis resolve."""
    revert = sub.add_parser(
        "revert", help="run the recorded reversal of an applied L4 proposal",
        description="An L4 apply records a reversal before it runs (every artefact back to "
                    "its last-known-good) and names it in the outcome's revert_proposal_id. "
                    "This publishes that reversal as a proposal; it inherits the original's "
                    "approval, so it runs without a second one (SPEC 09 §7).")
    add_connection_args(revert)
    revert.add_argument("id", metavar="ID", type=ids.id_arg,
                        help="the applied L4 proposal's id, or a unique prefix of it")
    verdicts.add_wait_args(revert)
    revert.set_defaults(func=cmd_revert)

    vote = sub.add_parser(
        "vote", help="sign and publish a quorum vote on an L4 proposal",
        description="Sign a QuorumVote with a voter key listed in [trust.quorum] and publish it "
                    "on improve.quorum (policy.quorum must be on). Three approvals from "
                    "distinct keys of non-correlated sessions approve; one dissent defers to an "
                    "operator. A vote names, by digest, what its voter read: the proposal, its "
                    "body (with its last-known-good list and reversal), its triage record and "
                    "the SPEC version; a digest that does not match the chain is refused "
                    "`unread`. Without --read they are taken from the proposal's verified chain "
                    "and printed.")
    add_connection_args(vote)
    vote.add_argument("id", metavar="ID", type=ids.id_arg,
                      help="the proposal id, or a unique prefix of it")
    vote.add_argument("vote", choices=("approve", "dissent"))
    vote.add_argument("--voter", required=True, help="the voter identity its key is bound to")
    vote.add_argument("--key", required=True, metavar="FILE", help="the voter's private key")
    vote.add_argument("--session", required=True,
                      help="the voter's session (model version or operator origin)")
    vote.add_argument("--read", action="append", metavar="WHAT",
                      help="what was read, repeated: proposal:ID, diff:<body digest>, "
                           "triage:<decision digest>, spec:09 (default: from the chain)")
    verdicts.add_wait_args(vote)
    vote.set_defaults(func=cmd_vote)

    crisis = sub.add_parser("crisis", help="resolve a crisis (a broken audit log)",
                            description="Crisis tools (constitution V.4).")
    crisis_sub = crisis.add_subparsers(dest="crisis_command", required=True, metavar="ACTION")
    cres = crisis_sub.add_parser(
        "resolve", help="sign the resolution of an open crisis",
        description="When the daemon finds the audit log broken (a chain that does not verify, "
                    "or trailers missing against a signed checkpoint) it refuses every apply "
                    "until an operator resolves the crisis with a signed act. Investigate first "
                    "(`improved audit verify`); the crisis id is in `improved status`.")
    add_connection_args(cres)
    cres.add_argument("crisis", metavar="CRISIS_ID")
    add_signer_args(cres)
    verdicts.add_wait_args(cres)
    cres.set_defaults(func=cmd_crisis_resolve)
