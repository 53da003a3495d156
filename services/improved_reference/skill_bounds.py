"""What a tool runtime reads of a skills store to bind a skill's calls to its `allowed_tools`.

A call on `<runtime>.tools.call` may say on behalf of which skill it is made (`"skill":
"<name>:<sha256>"`); the runtime then lets it call only the tools that skill's definition
allows (`improved.core.tools.Runtime.bound` decides). The definition is read from the skills
store's definitions bucket and believed only when it re-hashes to the identity asked for; a Tool
grain it names by address, from the store's grains bucket, only when its content address
recomputes (`skill_grains`): a bucket anyone may write can refuse a call, never widen a bound.
"""

from __future__ import annotations

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from improved.protocol import canonical
from improved_reference.competence_chains import held_grain
from improved_reference.kv_service import read_json
from improved_reference.skill_definitions import (
    GrantMismatch,
    bucket_names,
    split_identity,
    verify,
)
from improved_reference.skill_grains import bound_of, tool_addresses


class SkillBounds:
    """The `allowed_tools` bound of each skill the skills store `service` holds."""

    def __init__(self, js: JetStreamContext, service: str):
        self.js = js
        self.service = service
        self._buckets: tuple[KeyValue, KeyValue] | None = None

    async def _open(self) -> tuple[KeyValue, KeyValue] | str:
        if self._buckets is None:
            defs, comp, _ = bucket_names(self.service)
            try:
                self._buckets = (await self.js.key_value(defs), await self.js.key_value(comp))
            except BucketNotFoundError:
                return f"the skills store {self.service!r} holds no skills (no buckets)"
        return self._buckets

    async def allowed(self, identity: str) -> frozenset[str] | str:
        """The tool names `identity`'s calls may use, or why none can be bound (one line)."""
        try:
            name, sha = split_identity(identity)
        except GrantMismatch as exc:
            return str(exc)
        buckets = await self._open()
        if isinstance(buckets, str):
            return buckets
        defs, comp = buckets
        try:
            record, _ = await read_json(defs, f"{name}.{sha}")
        except (msgspec.MsgspecError, UnicodeDecodeError):
            record = {}  # not a record: fails `verify`
        problem = verify(record if isinstance(record, dict) else None, name, sha)
        if problem is not None:
            return f"skill {identity}: {problem}"
        definition = record["definition"]
        tools = {address: await held_grain(comp, "tool", address, canonical.TOOL)
                 for _, address in tool_addresses(definition)}
        return bound_of(definition, tools)
