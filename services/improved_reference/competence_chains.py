"""Each holder's competence in a skill, kept as an OMS supersession chain in KV
`skillcomp_<svc>` (layout and rules in `skills_store`'s docstring).

Apart from the definitions because it has its own bucket and its own concurrency rule: grains
are immutable under their content address, and only a holder's head moves, by compare-and-set,
so concurrent practice makes a chain, never a fork.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError
from nats.js.kv import KeyValue

from improved.protocol import canonical
from improved.protocol.model import to_json
from improved_reference.kv_service import ROUNDS, read_json
from improved_reference.skill_competence import (
    address_of,
    already_counted,
    competence_grain,
    next_proficiency,
    with_counted,
)
from improved_reference.skill_definitions import (
    CorruptRecord,
    NoCompetence,
    Refused,
    check_holder,
    definition_of,
    split_identity,
)
from improved_reference.skill_grains import grain_problem


async def held_grain(kv: KeyValue, prefix: str, address: str,
                     type_byte: int) -> dict[str, Any] | None:
    """The grain at `<prefix>.<address>` in `kv`, believed only when its content address,
    recomputed, is `address` (anyone may write the bucket); None otherwise."""
    try:
        entry = await kv.get(f"{prefix}.{address}")
    except KeyNotFoundError:
        return None
    try:
        grain = msgspec.json.decode(entry.value or b"", type=dict[str, Any])
    except msgspec.MsgspecError:
        return None
    return None if grain_problem(grain, address, type_byte) is not None else grain


class CompetenceChains:
    """The grains and heads of one store's competence bucket. `record` is the store's verified
    read of a definition: only a servable definition is practised or handed on."""

    def __init__(self, comp: KeyValue, record: Callable[[str], Awaitable[dict[str, Any]]],
                 service: str, log: Any):
        self.comp = comp
        self.record = record
        self.service = service
        self.log = log

    @staticmethod
    def _head_key(name: str, sha: str, holder_did: str) -> str:
        return f"head.{name}.{sha}.{canonical.sha256_hex(holder_did.encode())}"

    async def _head(self, key: str) -> tuple[dict[str, Any] | None, int]:
        return await read_json(self.comp, key)

    async def _load(self, address: str, sha: str) -> dict[str, Any] | None:
        """The grain at `address`, checked against its address and skill hash; None if absent."""
        try:
            entry = await self.comp.get(f"rec.{address}")
        except KeyNotFoundError:
            return None
        try:
            grain = msgspec.json.decode(entry.value or b"", type=dict[str, Any])
            intact = address_of(grain) == address and canonical.skill_hash(grain) == sha
        except (msgspec.MsgspecError, canonical.CanonicalError, AttributeError, TypeError):
            intact = False
        if not intact:
            raise CorruptRecord(f"competence grain {address} does not match its address or "
                                "its skill hash")
        return grain

    async def _put_grain(self, grain: dict[str, Any]) -> str:
        """Store an immutable Skill grain under its own address (twice is harmless)."""
        return await self.hold("rec", grain, canonical.SKILL)

    async def hold(self, prefix: str, grain: dict[str, Any], type_byte: int) -> str:
        """Keep `grain` at `<prefix>.<its address>` (immutable: twice is harmless); the
        address. A value someone else left there is replaced only when it is not this grain."""
        address = canonical.content_address(grain, type_byte)
        key = f"{prefix}.{address}"
        try:
            await self.comp.create(key, to_json(grain))
        except KeyWrongLastSequenceError:
            if await self.held(prefix, address, type_byte) is None:
                await self.comp.put(key, to_json(grain))
        return address

    async def held(self, prefix: str, address: str, type_byte: int) -> dict[str, Any] | None:
        """`held_grain` in this store's bucket."""
        return await held_grain(self.comp, prefix, address, type_byte)

    async def _advance(self, key: str, sha: str,
                       make: Callable[[dict[str, Any] | None, str | None],
                                      dict[str, Any] | None],
                       counted: tuple[str, int] | None = None) -> dict[str, Any] | None:
        """Write `make(head grain, head address)` and move the head to it, compare-and-set.
        With `counted` = (proposal id, chain position), the head records that outcome in the
        same write, and an outcome it already records is not counted again (None)."""
        for _ in range(ROUNDS):
            head, rev = await self._head(key)
            if counted is not None and already_counted(head, *counted):
                return None
            prev_address = head["address"] if head else None
            prev = await self._load(prev_address, sha) if prev_address else None
            grain = make(prev, prev_address)
            if grain is None:
                return None
            address = await self._put_grain(grain)
            value: dict[str, Any] = {"address": address, "practice_count": grain["practice_count"]}
            if counted is not None:
                value["counted"] = with_counted(head, *counted)
            elif head is not None and head.get("counted"):
                value["counted"] = head["counted"]
            body = to_json(value)
            try:
                if rev == 0:
                    await self.comp.create(key, body)
                else:
                    await self.comp.update(key, body, last=rev)
            except KeyWrongLastSequenceError:
                continue
            return grain
        raise RuntimeError(f"the competence head {key} kept changing ({ROUNDS} attempts)")

    async def practise(self, identity: str, holder_did: str, positive: bool, at: int,
                       counted: tuple[str, int] | None = None) -> dict[str, Any] | None:
        """Supersede the holder's head with one more practice; None when `counted` is an
        outcome the head already records. Whether the outcome counts at all is the caller's."""
        name, sha = split_identity(identity)
        record = await self.record(identity)
        definition = definition_of(record["definition"])

        def make(prev: dict[str, Any] | None, prev_address: str | None) -> dict[str, Any]:
            p = prev["proficiency"] if prev else 0.0
            return competence_grain(
                definition, holder_did=holder_did,
                proficiency=next_proficiency(p, positive),
                practice_count=(prev["practice_count"] if prev else 0) + 1,
                created_at=at, last_practiced_at=at,
                derived_from=[prev_address or record["address"]],
                origin_did=prev.get("origin_did") if prev else None)

        grain = await self._advance(self._head_key(name, sha, holder_did), sha, make, counted)
        if grain is not None:
            self.log.info("practised", service=self.service, skill=identity,
                          holder=holder_did, positive=positive,
                          practice_count=grain["practice_count"],
                          proficiency=grain["proficiency"])
        return grain

    async def current(self, identity: str, holder_did: str) -> dict[str, Any] | None:
        """The holder's current competence grain (the chain's head), or None."""
        name, sha = split_identity(identity)
        head, _ = await self._head(self._head_key(name, sha, holder_did))
        return await self._load(head["address"], sha) if head else None

    async def history(self, identity: str, holder_did: str,
                      limit: int | None = None) -> list[dict[str, Any]]:
        """The holder's chain, oldest first, head last (at most `limit` newest grains). It ends
        where `derived_from` leaves the holder: at the definition, or a transfer's source."""
        name, sha = split_identity(identity)
        head, _ = await self._head(self._head_key(name, sha, holder_did))
        chain: list[dict[str, Any]] = []
        address = head["address"] if head else None
        while address and (limit is None or len(chain) < limit):
            grain = await self._load(address, sha)
            if grain is None or grain.get("holder_did") != holder_did:
                break
            chain.append(grain)
            address = (grain.get("derived_from") or [None])[0]
        chain.reverse()
        return chain

    async def heads(self) -> list[tuple[str, dict[str, Any]]]:
        """Every holder's current grain, (its skill identity, the grain); a head whose grain
        does not verify is left out (logged)."""
        try:
            keys = await self.comp.keys()
        except NoKeysError:
            return []
        out = []
        for key in keys:
            parts = key.split(".")
            if len(parts) != 4 or parts[0] != "head":
                continue
            head, _ = await self._head(key)
            try:
                grain = await self._load(head["address"], parts[2]) if head else None
            except CorruptRecord as exc:
                self.log.warning("competence head left out", key=key, why=str(exc))
                continue
            if grain is not None:
                out.append((f"{parts[1]}:{parts[2]}", grain))
        return out

    async def transfer(self, identity: str, from_holder: str, to_holder: str,
                       at: int) -> dict[str, Any]:
        """Give `to_holder` the recipe, not the track record (OMS transfer): a first grain with
        the source's definition, derived_from the source grain, origin_did the first holder,
        proficiency and practice_count 0. Repeating the same transfer returns the same grain."""
        check_holder(from_holder)
        check_holder(to_holder)
        if from_holder == to_holder:
            raise Refused("a holder cannot transfer a skill to itself")
        name, sha = split_identity(identity)
        await self.record(identity)  # only a servable definition is handed on
        src_head, _ = await self._head(self._head_key(name, sha, from_holder))
        source = await self._load(src_head["address"], sha) if src_head else None
        if source is None or src_head is None:
            raise NoCompetence(f"{from_holder} holds no competence record for {identity}")
        grain = await self.acquire(identity, to_holder, src_head["address"],
                                   source.get("origin_did") or from_holder, at)
        self.log.info("transferred", service=self.service, skill=identity, to_holder=to_holder)
        return grain

    async def acquire(self, identity: str, holder: str, derived_from: str,
                      origin_did: str | None, at: int) -> dict[str, Any]:
        """`holder`'s first grain of a stored skill, derived from `derived_from` (a source
        grain, here or in another deployment), proficiency and practice_count 0. Repeating it
        returns the same grain; Refused when the holder already practises its own chain."""
        check_holder(holder)
        name, sha = split_identity(identity)
        record = await self.record(identity)
        grain = competence_grain(
            definition_of(record["definition"]), holder_did=holder, proficiency=0.0,
            practice_count=0, created_at=at, derived_from=[derived_from], origin_did=origin_did)
        address = await self._put_grain(grain)
        key = self._head_key(name, sha, holder)
        try:
            await self.comp.create(key, to_json({"address": address, "practice_count": 0}))
        except KeyWrongLastSequenceError:
            head, _ = await self._head(key)
            if not head or head["address"] != address:
                raise Refused(f"{holder} already holds {identity}; it practises its own "
                              "chain") from None
        return grain
