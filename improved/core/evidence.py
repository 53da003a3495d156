"""Who wrote a trailer, and the signed act an authority trailer rests on.

A hash proves a trailer was not altered, not who wrote it: anyone who may publish on the audit
subjects can append a correctly hashed one. Two signatures close that. The daemon that writes a
trailer signs its hash (`sig`), so without a daemon key nobody adds a trailer that verifies. A
trailer that carries an operator's or a voter's authority — an approval, an operator's
rejection or rollback request, a grant or a revoke, a quorum vote, a crisis resolution, a tool
call a per-call grant or a session upgrade allowed —
carries the DSSE envelope of the act itself, checked against the keys that were trusted when it
was written, so the chain alone proves who authorised what, for as long as the chain exists.
So do a signed signal's trailer (its emitter) and a signed proposal's registration (its
proposer: the `proposer:` ref is the signer, the payload the chain's proposal).
Those keys are on the trust chain (`improve.audit._trust.<TRUST_ID>`), where a daemon records
the operator and voter keys whenever it starts (or reloads, on SIGHUP) with a different trust
store. A quorum decision is backed by the verified approving votes before it on its chain. Pure.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from improved.core import identity, propose, signing, tools
from improved.core.audit import REASON_LIMIT, Draft, draft_of
from improved.core.quorum import SIZE as QUORUM_SIZE
from improved.core.signing import PAYLOAD_TYPES, ActRefused, TrustStore
from improved.core.tools import SessionUpgrade, ToolGrant
from improved.core.trailers import (
    AutonomyState,
    D,
    GrantAct,
    QuorumReached,
    Registration,
    SignalCounted,
    ToolCall,
    TrailerData,
    TrailerDataError,
    TrustInForce,
    Voted,
    body_as,
    decode,
    kind_of,
)
from improved.protocol import canonical
from improved.protocol.model import (
    CrisisAct,
    GrantCommand,
    Proposal,
    Review,
    Signal,
    Trailer,
    Vote,
)
from improved.protocol.wire import WireError

TRUST_ID: Final = hashlib.sha256(b"improved trust").hexdigest()  # the one `_trust` chain
_DOMAIN: Final = b"improved trailer v1\n"  # what a daemon signs: this, then the hash's bytes


# -- the writing daemon's signature -------------------------------------------------------------


def sign(trailer: Trailer, key: Ed25519PrivateKey) -> Trailer:
    """The trailer with `sig`: the daemon's public key and its signature over the hash."""
    sig = base64.b64encode(key.sign(_DOMAIN + bytes.fromhex(trailer.hash))).decode()
    return msgspec.structs.replace(trailer, sig=f"{_public_of(key)}.{sig}")


@functools.lru_cache(maxsize=8)
def _public_of(key: Ed25519PrivateKey) -> str:
    """The base64 public key of a signing key (a daemon signs every trailer with one key)."""
    return base64.b64encode(signing.raw_public(key.public_key())).decode()




@functools.lru_cache(maxsize=64)
def _public(b64: str) -> tuple[str, Ed25519PublicKey]:
    raw = base64.b64decode(b64, validate=True)
    return signing.keyid_of(raw), Ed25519PublicKey.from_public_bytes(raw)


def writer_problem(body: dict[str, Any], daemons: frozenset[str] | None,
                   writer: str = "daemon") -> str | None:
    """Why the trailer was not written by a trusted key (`daemons`, the key ids of a
    `writer`: a daemon, or the runtime whose `_tools` chain it is), or None. `daemons` None:
    no key is trusted (no trust anchor), so only what shows without one is checked: that the
    trailer is signed, and that the signature is the named key's over its hash."""
    sig = body.get("sig")
    if not isinstance(sig, str) or not sig:
        return f"not signed by a {writer}: a trailer anyone on the bus could have written"
    public, _, signature = sig.partition(".")
    try:
        keyid, key = _public(public)
    except (ValueError, binascii.Error):
        return f"the {writer} signature names no valid key"
    if daemons is not None and keyid not in daemons:
        return f"signed by {keyid[:24]}…, which is not a trusted {writer} key"
    try:
        key.verify(base64.b64decode(signature, validate=True),
                   _DOMAIN + bytes.fromhex(str(body.get("hash"))))
    except (ValueError, binascii.Error, InvalidSignature):
        return f"the {writer} signature does not match the trailer"
    return None


def signed_by(body: dict[str, Any]) -> str | None:
    """The key id whose valid signature the trailer carries, trusted or not; None when it
    carries none that verifies."""
    if writer_problem(body, None) is not None:
        return None
    return _public(str(body["sig"]).partition(".")[0])[0]


# -- the trust history --------------------------------------------------------------------------


@dataclass(frozen=True)
class DaemonWriters:
    """Trusts who wrote a chain, not what it authorises: every trailer must be signed by one of
    `daemons` (key ids). For a service that counts what the daemon recorded — the daemon
    checked any signed act before it appended the trailer — and holds no operator keys."""

    daemons: frozenset[str]

    def start(self) -> object:
        return None

    def problem(self, body: dict[str, Any], chain_id: str, stream_seq: int,
                state: object, covered: bool = False) -> str | None:
        if covered and not body.get("sig"):
            return None  # the commit's last trailer carries the signature
        return writer_problem(body, self.daemons)


@dataclass(frozen=True)
class KeySet:
    """The operator and voter keys trusted from one point of the log on."""

    operators: TrustStore = field(default_factory=TrustStore)
    voters: TrustStore = field(default_factory=TrustStore)
    signers: TrustStore = field(default_factory=TrustStore)  # agents, checks, services

    @classmethod
    def from_config(cls, operators: dict[str, str], voters: dict[str, str],
                    signers: dict[str, str] | None = None) -> KeySet:
        return cls(TrustStore.from_config(operators), TrustStore.from_config(voters),
                   TrustStore.from_config(signers or {}))

    def emitters(self) -> TrustStore:
        """Whose signed signals name a verified identity: signers and operators."""
        return TrustStore({**self.operators.keys, **self.signers.keys})


@dataclass(frozen=True)
class History:
    """The trust chain read back: (stream sequence of a trust trailer, the keys from then on).
    Before the first snapshot (acts older than trust recording) the first one counts; without
    any, `fallback` (the reader's own trust store)."""

    snapshots: tuple[tuple[int, KeySet], ...] = ()
    fallback: KeySet = field(default_factory=KeySet)

    def at(self, stream_seq: int) -> KeySet:
        """The keys trusted for a trailer at `stream_seq` (0: not known, the newest)."""
        if not self.snapshots:
            return self.fallback
        if stream_seq <= 0:
            return self.snapshots[-1][1]
        chosen = self.snapshots[0][1]
        for seq, keys in self.snapshots:
            if seq >= stream_seq:
                break
            chosen = keys
        return chosen


Keys = tuple[dict[str, str], dict[str, str], dict[str, str]]  # operators, voters, signers


def recorded(body: dict[str, Any] | None) -> Keys | None:
    """(operators, voters, signers) a trust trailer records, `principal → base64 key`."""
    if not body:
        return None
    keys = body_as(TrustInForce, body)
    return keys.operators, keys.voters, keys.signers


def ever(history: History) -> KeySet:
    """Every key the history ever trusted, in each role (and the fallback's): for acts on a
    chain outside the daemon's log, whose stream sequences are not the trust chain's, so
    "trusted at that trailer" cannot be told; such a chain's writer checked the act when it
    was made."""
    sets = [history.fallback, *(keys for _, keys in history.snapshots)]

    def union(role: str) -> TrustStore:
        return TrustStore({kid: k for ks in sets for kid, k in getattr(ks, role).keys.items()})

    return KeySet(union("operators"), union("voters"), union("signers"))


def history_of(chain: list[tuple[int, dict[str, Any]]], fallback: KeySet) -> History:
    """The history a verified trust chain records."""
    snapshots = []
    for seq, body in chain:
        keys = recorded(body)
        if keys is not None:
            snapshots.append((seq, KeySet.from_config(*keys)))
    return History(tuple(snapshots), fallback)


def trust_draft(keys: Keys, last: dict[str, Any] | None, actor: str) -> Draft | None:
    """The trust trailer recording `keys` (operators, voters, signers), or None when the
    chain's last one already does. Refs: `operators:`, `voters:`, `signers:` (the whole
    store), `added:`/`removed:` (what changed)."""
    operators, voters, signers = keys
    before = recorded(last) or ({}, {}, {})
    if before == keys:
        return None
    changes = key_changes(before, keys)
    reason = (f"trust store: {len(operators)} operator, {len(voters)} voter and {len(signers)} "
              f"signer keys; added "
              f"{', '.join(changes['added']) or 'none'}; removed "
              f"{', '.join(changes['removed']) or 'none'}")[:REASON_LIMIT]
    return draft_of(TrustInForce(operators=operators, voters=voters, signers=signers,
                                 added=tuple(changes["added"]), removed=tuple(changes["removed"])),
                    "learn-back", actor, "rec:system", reason)


def key_changes(before: Keys, after: Keys) -> dict[str, list[str]]:
    """What differs between two trust stores (operators, voters, signers): `added` and
    `removed`, each `<role> <principal> <keyid>`; a key replaced is one of each."""
    changes: dict[str, list[str]] = {"added": [], "removed": []}
    for role, now, then in (("operator", after[0], before[0]), ("voter", after[1], before[1]),
                            ("signer", after[2], before[2])):
        for principal, key in sorted(now.items()):
            if then.get(principal) != key:
                changes["added"].append(f"{role} {principal} {_keyid(key)}")
        for principal, key in sorted(then.items()):
            if now.get(principal) != key:
                changes["removed"].append(f"{role} {principal} {_keyid(key)}")
    return changes


def common_keys(a: Keys, b: Keys) -> Keys:
    """The entries (principal and key alike) both trust stores hold."""
    both = tuple({p: k for p, k in x.items() if y.get(p) == k} for x, y in zip(a, b, strict=True))
    return both[0], both[1], both[2]


def _keyid(b64: str) -> str:
    try:
        return signing.keyid_of(base64.b64decode(b64, validate=True))
    except (ValueError, binascii.Error):
        return "invalid-key"


# -- the signed act of an authority trailer -----------------------------------------------------


@dataclass
class ChainActs:
    """What one pass over a chain has seen so far: the keys of its verified approving votes."""

    approvals: set[str] = field(default_factory=set)
    # a trailer of this chain recorded its session proof (tools.PROOF_REFS): from then on,
    # every upgraded call bound to a session key must record its own
    proofs: bool = False


# the verdicts a signed act backs, and which act; an operator's rejection or rollback request
# only when its trailer says a person acted (a triage's rejection is the daemon's own)
_ACT_OF: Final[Mapping[str | None, str]] = {
    "approve": "review", "grant": "grant", "revoke": "grant", "vote": "vote",
    "crisis_resolved": "crisis"}
_HUMAN_ACT_OF: Final[Mapping[str | None, str]] = {"reject": "review", "rollback": "review"}
# signed when they carry an envelope: a signal (its emitter is proven) and a tool call a
# per-call grant or a session upgrade allowed (which, by the envelope's payload type)
_ENVELOPED_ACT_OF: Final[Mapping[str | None, str]] = {"signal": "signal",
                                                       "tool_call": "tool_grant"}


def act_kind(t: Trailer, data: TrailerData | None = None) -> str | None:
    """Which signed act the trailer's authority rests on (a PAYLOAD_TYPES key), or None.
    `data`: the trailer's, when it is read already (a registration's `proposer:` is asked)."""
    kind = _ACT_OF.get(t.verdict) or (
        _HUMAN_ACT_OF.get(t.verdict) if t.observer_type == "human" else None)
    if kind is not None:
        return kind
    enveloped = _ENVELOPED_ACT_OF.get(t.verdict) if t.envelope is not None else None
    if enveloped is not None and t.envelope is not None:
        return _TOOL_ACTS.get(t.envelope.payloadType, enveloped) if enveloped != "signal" \
            else enveloped
    if kind_of(t) is Registration:  # a signed proposal: its envelope, or a proposer named
        if t.envelope is not None:
            return "proposal"
        try:
            data = data or decode(t)
        except TrailerDataError:
            return None  # nothing is rebuilt from it either
        return "proposal" if isinstance(data, Registration) and data.proposer else None
    return None


_PAYLOADS: Final[dict[str, type]] = {"review": Review, "grant": GrantCommand, "vote": Vote,
                                     "crisis": CrisisAct, "signal": Signal,
                                     "proposal": Proposal, "tool_grant": ToolGrant,
                                     "tool_upgrade": SessionUpgrade}
_TOOL_ACTS: Final = {PAYLOAD_TYPES[k]: k for k in ("tool_grant", "tool_upgrade")}
_STORES: Final = {"vote": lambda k: k.voters, "signal": lambda k: k.emitters(),
                  "proposal": lambda k: k.signers}


def act_problem(t: Trailer, chain_id: str, keys: KeySet, acts: ChainActs,
                check: bool = True) -> str | None:
    """Why the authority `t` claims is not backed by a valid signed act, or None. `check`
    False (a trailer a trusted checkpoint vouches for) only notes what the pass needs."""
    if t.verdict == "quorum":  # backed by the votes before it, on any stage it claims
        try:
            counted = set(_read(t, QuorumReached).keyid)
        except TrailerDataError as exc:
            return f"the quorum decision does not read: {exc}"
        if check and (len(counted) < QUORUM_SIZE or not counted <= acts.approvals):
            return ("the quorum decision is not backed by "
                    f"{QUORUM_SIZE} verified approving votes before it")
        return None
    kind = act_kind(t)
    if kind is None:
        return None
    try:
        data = decode(t)
    except TrailerDataError as exc:
        return f"the {t.verdict or 'registration'} does not read: {exc}"
    if not check:
        if isinstance(data, Voted) and data.vote == "approve":
            acts.approvals.add(data.keyid)
        acts.proofs = acts.proofs or (isinstance(data, ToolCall) and tools.proof_recorded(data))
        return None
    if t.envelope is None:
        return f"the {t.verdict} carries no signed act"
    try:
        store = _STORES.get(kind, lambda k: k.operators)(keys)
        verified = store.verify(t.envelope, PAYLOAD_TYPES[kind])
        body: Any = msgspec.json.decode(verified.payload, type=_PAYLOADS[kind])
    except ActRefused as exc:
        return f"the signed act of the {t.verdict} does not verify ({exc.code}): {exc.reason}"
    except msgspec.MsgspecError as exc:
        return f"the signed act of the {t.verdict} is not a valid act: {exc}"
    named = _named(kind, body, data, chain_id, verified.digest)
    if named[0] != named[1]:
        return "the signed act is not the one the trailer names"
    problem = _mismatch(kind, body, t, data, chain_id, verified.principal)
    if problem is None and isinstance(data, Voted) and data.vote == "approve":
        acts.approvals.add(verified.keyid)
    if problem is None and kind == "tool_upgrade" and body.session_key is not None \
            and isinstance(data, ToolCall):
        problem = _proof_problem(body, tools.act_id(verified), data, acts)
    return problem


def _read(t: Trailer, cls: type[D]) -> D:
    data = decode(t)
    if not isinstance(data, cls):
        raise TrailerDataError(f"not a {cls.__name__}")
    return data


def _named(kind: str, body: Any, data: TrailerData, chain_id: str,
           digest: str) -> tuple[str | None, str]:
    """(what the trailer names, what the act is): a signal by its digest, a proposal by its
    id (the chain's: the content's address, whoever signed it), any other act by its own."""
    if isinstance(data, SignalCounted):
        return data.signal, canonical.digest(msgspec.to_builtins(body))
    if kind == "proposal":
        try:
            return chain_id, propose.identify(body)[0]
        except WireError as exc:
            return chain_id, f"no proposal id ({exc.message})"
    return getattr(data, "act", None), digest


def _proof_problem(body: SessionUpgrade, upgrade: str, call: ToolCall,
                   acts: ChainActs) -> str | None:
    """The session proof an upgraded call's trailer records, re-checked against the upgrade's
    session key (`tools.recorded_proof_problem`). A trailer recording none was written before
    proofs were recorded, unless an earlier trailer of its chain recorded one."""
    if tools.proof_recorded(call):
        acts.proofs = True
        return tools.recorded_proof_problem(body, upgrade, call)
    if acts.proofs:
        return ("the session proof is not recorded (no proof_at, proof_nonce, proof_sig), "
                "though earlier trailers of this chain record theirs")
    return None


def _mismatch(kind: str, body: Any, t: Trailer, data: TrailerData, chain_id: str,
              principal: str) -> str | None:
    """Where the signed act says something other than the trailer built on it."""
    if kind == "review":
        claims = [("proposal", body.proposal_id, chain_id), ("verdict", body.verdict, t.verdict),
                  ("principal", body.principal, t.actor)]
    elif isinstance(data, GrantAct):
        claims = [("op", body.op, t.verdict), ("principal", body.principal, t.actor),
                  ("skill", body.skill, data.skill),
                  ("skill hash", body.skill.partition(":")[2], chain_id),
                  ("L2 proposal", body.proposal_id, data.l2)]
    elif isinstance(data, Voted):
        claims = [("proposal", body.proposal_id, chain_id), ("voter", body.voter, t.actor),
                  ("vote", body.vote, data.vote)]
    elif isinstance(data, AutonomyState):
        claims = [("crisis", body.crisis, data.resolved),
                  ("principal", body.principal, t.actor)]
    elif isinstance(data, ToolCall):
        claims = [("principal", body.principal, t.actor),
                  ("runtime's chain", tools.chain_id(data.runtime), chain_id)]
        if kind == "tool_grant":
            claims += [("tool", body.tool, data.tool), ("args", body.args_digest, data.args)]
            if body.runtime is not None:
                claims.append(("runtime", body.runtime, data.runtime))
        else:
            claims += [("runtime", body.runtime, data.runtime),
                       ("session", body.session, data.session)]
            if body.session_key is not None:  # an upgrade bound to a key names who proved
                claims.append(("session key", signing.keyid_of(
                    base64.b64decode(body.session_key)), data.session_key))
    elif isinstance(data, Registration):  # the signer is the proposer the registration names
        problem = identity.proposer_problem(principal, body.service)
        if problem is not None:
            return f"the signed proposal's signer may not propose: {problem}"
        return (None if data.proposer == principal
                else f"the signed proposal's signer is {principal!r}, the trailer says the "
                     f"proposer is {data.proposer!r}")
    elif isinstance(data, SignalCounted):  # the signer is the emitter the trailer names
        return (None if (body.actor, principal) == (t.actor, data.emitter)
                else f"the signed signal is {body.actor!r} by {principal!r}, the trailer says "
                     f"{t.actor!r} verified as {data.emitter!r}")
    else:
        return f"a {type(data).__name__} trailer carries no signed act"
    claims.append(("signer", principal, t.actor))
    for what, signed, written in claims:
        if signed != written:
            return f"the signed act says {what} {signed!r}, the trailer {written!r}"
    return None


@dataclass(frozen=True)
class ChainTrust:
    """What a reader trusts beyond hashes: the daemon keys (out of band: configuration, a
    daemon's own key, a kept checkpoint), the trust history, and the stream sequence up to
    which a checkpoint from a trusted key vouches for every trailer (not checked again)."""

    daemons: frozenset[str]
    history: History = field(default_factory=History)
    covered_to: int = 0
    # hashes of trailers this very process appended (and so signed, after checking any act
    # they carry): their signatures need no second check until the next checkpoint covers them
    written: AbstractSet[str] = frozenset()
    writer: str = "daemon"  # whose keys `daemons` are: "runtime" for a `_tools` chain
    # chain id → the key id of the runtime whose `_tools` chain it is ([trust.runtimes]): for
    # a verifier of the daemon's log, where such chains were written before they moved to
    # their own stream; that key then counts for that one chain besides the daemons'. A
    # daemon never sets it: no runtime key is one of its writers.
    earlier_runtimes: Mapping[str, str] = field(default_factory=dict)
    # False: no daemon key is trusted at all (a verifier given no trust anchor). Then who
    # wrote a trailer cannot be checked, nor the signed acts on keys only such a trailer
    # recorded: a writer's signature is checked against the key it names (a trailer unsigned,
    # or whose signature does not match, is still a break), and the rest is left unverified,
    # for the caller to say so, never to call it broken.
    anchored: bool = True

    def start(self) -> ChainActs:
        return ChainActs()

    def problem(self, body: dict[str, Any], chain_id: str, stream_seq: int,
                state: object, covered: bool = False) -> str | None:
        if not isinstance(state, ChainActs):
            raise TypeError("ChainTrust.problem: state comes from ChainTrust.start")
        check = not 0 < stream_seq <= self.covered_to and body.get("hash") not in self.written
        if check and not (covered and not body.get("sig")):  # a commit's last one is signed
            runtime = self.earlier_runtimes.get(chain_id)
            writers = self.daemons if runtime is None else self.daemons | {runtime}
            problem = writer_problem(body, writers if self.anchored else None, self.writer)
            if problem is not None:
                return problem
        try:
            t = msgspec.convert(body, type=Trailer)
        except msgspec.ValidationError as exc:
            return f"not a valid trailer: {exc}"
        return act_problem(t, chain_id, self.history.at(stream_seq), state,
                           check and self.anchored)
