"""The read-only requests an artefact store answers before an apply: `<svc>.improve.lkg`, the
pre-apply check that every artefact has a healthy last-known-good, and `<svc>.improve.classify`,
a pending `schema:` proposal's class (schema_gate).

Apart from the store because neither changes anything: each reads the manifest and the blobs,
and answers in one signed reply, a bad request in one line and a failure as "unavailable".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.msg import Msg

from improved.client.sdk import answer_bytes
from improved.protocol import subjects as S
from improved.protocol.model import ClassifyRequest, to_json
from improved_reference import schema_gate
from improved_reference.artefact_changes import parse_lkg
from improved_reference.kv_service import Refused

if TYPE_CHECKING:
    from improved_reference.artefact_store import ArtefactStore

RC_UNKNOWN = 127  # no such smoke test, or no last-known-good
RC_CORRUPT = 126  # the LKG blob is missing or does not hash to its digest


def _invalid(message: str) -> dict[str, Any]:
    return {"error": {"code": "invalid_value", "message": message[:500]}}


class LkgChecks:
    """Answers `store`'s LKG checks and schema classifications."""

    def __init__(self, store: ArtefactStore):
        self.store = store

    async def subscribe(self) -> None:
        """Serve both requests (the store's subscriptions, so its `stop` ends them)."""
        store = self.store
        store._subs.append(await store.nc.subscribe(S.lkg_request(store.service),
                                                    queue=store.service, cb=self._on_lkg))
        store._subs.append(await store.nc.subscribe(S.classify_request(store.service),
                                                    queue=store.service, cb=self._on_classify))

    async def check_lkg(self, request: Any) -> dict[str, Any]:
        """The reply to a `<svc>.improve.lkg` request (read-only)."""
        if not isinstance(request, dict) or not S.ID_RE.match(str(request.get("proposal_id"))):
            return _invalid("expected {\"proposal_id\": <64 hex>, \"lkg\": [...]}")
        try:
            entries = parse_lkg(request.get("lkg"))
        except Refused as exc:
            return _invalid(str(exc))
        manifest = await self.store.manifest()
        artefacts, errors = [], []
        for name, entry in entries.items():
            lkg_digest = manifest.get(name)
            if lkg_digest is None:
                rc = RC_UNKNOWN
                errors.append(f"no last-known-good for {name}")
            else:
                data = await self.store.blob(lkg_digest)
                if data is None:
                    rc = RC_CORRUPT
                    errors.append(f"{name}: LKG blob missing or corrupt")
                else:
                    rc = self.store.smoke(entry["smoke_test"], data)
                    if rc != 0:
                        errors.append(f"{name}: smoke test {entry['smoke_test']} failed on the "
                                      f"LKG (rc {rc})")
            artefacts.append({"artefact": name, "lkg_digest": lkg_digest,
                              "smoke_test": entry["smoke_test"], "rc": rc})
        reply: dict[str, Any] = {"ok": not errors, "artefacts": artefacts}
        if errors:
            reply["error"] = "; ".join(errors)
        return reply

    async def _on_lkg(self, msg: Msg) -> None:
        async def check(data: bytes) -> Any:
            try:
                request = msgspec.json.decode(data)
            except msgspec.DecodeError as exc:
                raise Refused(f"not JSON: {exc}") from None
            return await self.check_lkg(request)

        await self._answer(msg, "lkg check", check)

    async def _on_classify(self, msg: Msg) -> None:
        """`<svc>.improve.classify`: `{"proposal"}` → `{"class", "reason"}` (schema_gate), or
        an error reply in one line. Read only."""
        async def classify(data: bytes) -> Any:
            try:
                request = msgspec.json.decode(data, type=ClassifyRequest)
            except msgspec.MsgspecError as exc:
                raise Refused(f'expected {{"proposal": <a schema: proposal>}}: {exc}') from None
            return await schema_gate.classify(self.store, request.proposal)

        await self._answer(msg, "classify", classify)

    async def _answer(self, msg: Msg, what: str, work: Callable[[bytes], Awaitable[Any]]
                      ) -> None:
        """Answer a read-only request with `work`'s reply: a bad request (Refused) in one
        line; a store briefly unreachable says so and the subscription keeps serving."""
        reply: Any
        try:
            reply = await work(msg.data)
        except Refused as exc:
            reply = _invalid(str(exc))
        except Exception as exc:
            self.store.log.warning(f"{what} failed", service=self.store.service, error=repr(exc))
            reply = {"error": {"code": "unavailable", "message": f"{what} failed for "
                               f"now: {type(exc).__name__}: {exc}"[:500]}}
        if msg.reply:
            try:
                await msg.respond(answer_bytes(msg, to_json(reply), self.store.key))
            except Exception as exc:
                self.store.log.warning(f"could not answer a {what} request", error=str(exc))
