"""The skills store's requests over NATS: the read under a grant and the competence requests
(`<svc>.skills.get|practice|competence|transfer`, replies in `skills_store`'s docstring), and
the daemon's learn-back records as wake-ups to count practice.

Apart from the store because it is a translation, not storage: bytes in, one reply out, every
failure an error reply (nothing escapes a subscription callback), the store's own methods doing
the work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.msg import Msg

from improved.protocol import subjects as S
from improved.protocol import wire
from improved.protocol.model import ErrorBody, ErrorReply, to_json
from improved_reference.skill_competence import NotPractice, address_of
from improved_reference.skill_definitions import (
    IDENTITY_RE,
    GrantMismatch,
    NoCompetence,
    NoGrant,
    NotStored,
    Refused,
    now_ms,
)
from improved_reference.skill_grains import discovery_problem

if TYPE_CHECKING:
    from improved_reference.skills_store import SkillsStore


def _error(code: str, message: str, field: str | None = None) -> ErrorReply:
    return ErrorReply(error=ErrorBody(code=code, message=message[:500], field=field))


def _request(data: bytes, required: tuple[str, ...],
             optional: tuple[str, ...] = ()) -> dict[str, Any] | ErrorReply:
    """A request's JSON object with exactly `required` (strings) and any of `optional`."""
    try:
        body = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError) as exc:
        return _error(wire.INVALID_VALUE, f"not a JSON object: {exc}")
    shape = "{" + ", ".join([f'"{k}"' for k in required] + [f'"{k}"?' for k in optional]) + "}"
    if not isinstance(body, dict) or not set(required) <= set(body) <= {*required, *optional}:
        return _error(wire.INVALID_VALUE, f"the request is {shape}")
    for key in required:
        if not isinstance(body[key], str) or not body[key]:
            return _error(wire.INVALID_VALUE, f"{key} must be a non-empty string", key)
    return body



class SkillRequests:
    """Answers `store`'s requests and counts practice when a learn-back record wakes it."""

    def __init__(self, store: SkillsStore):
        self.store = store
        self.log = store.log
        self._tasks: set[asyncio.Task[None]] = set()
        self._waking: dict[str, bool] = {}  # proposal id → woken again while being counted

    async def subscribe(self) -> None:
        """Serve the requests, then listen for learn-back records (the store's subscriptions,
        so its `stop` ends them)."""
        store = self.store
        for subject, answer in ((S.skills_get(store.service), self.answer_get),
                                (S.skills_practice(store.service), self.answer_practice),
                                (S.skills_competence(store.service), self.answer_competence),
                                (S.skills_transfer(store.service), self.answer_transfer),
                                (S.skills_tool(store.service), self.answer_tool),
                                (S.skills_export(store.service), self.answer_export),
                                (S.skills_import(store.service), self.answer_import),
                                (S.skills_discover(store.service), self.answer_discover)):
            store._subs.append(await store.nc.subscribe(subject, queue=store.service,
                                                        cb=self._responder(subject, answer)))
        # the daemon's learn-back records say when a chain has new outcomes (only where to
        # look: the chain is read and verified before anything is counted)
        store._subs.append(await store.nc.subscribe(S.learn_back(store.service, "*"),
                                                    queue=store.service,
                                                    cb=self._on_learn_back))

    async def stop(self) -> None:
        """Cancel the practice counts still running."""
        tasks, self._tasks = self._tasks, set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the read under a grant, over NATS -----------------------------------------------------

    async def answer_get(self, data: bytes) -> dict[str, Any] | ErrorReply:
        """One `<svc>.skills.get` request's bytes → its reply (no exceptions escape)."""
        body = _request(data, ("skill",))
        if isinstance(body, ErrorReply):
            return body
        identity = body["skill"]
        match = IDENTITY_RE.match(identity)
        if match is None:
            return _error(wire.INVALID_VALUE, f"{identity!r} is not a skill identity "
                          "<name>:<sha256>", "skill")
        try:
            definition = await self.store.get_granted(match.group(1), match.group(2))
        except NoGrant as exc:
            return _error("no_grant", str(exc), "skill")
        except NotStored as exc:
            return _error(wire.NOT_FOUND, str(exc), "skill")
        except GrantMismatch as exc:
            return _error("grant_mismatch", str(exc), "skill")
        except Exception as exc:  # the store briefly unreachable: "not now", never a definition
            return self._unavailable("skills.get", exc)
        return {"skill": identity, "definition": definition}

    def _responder(self, subject: str, answer: Callable[[bytes], Awaitable[Any]]
                   ) -> Callable[[Msg], Awaitable[None]]:
        """A subscription callback: every request gets `answer`'s reply, nothing escapes."""

        async def respond(msg: Msg) -> None:
            reply = await answer(msg.data)
            if not msg.reply:
                return
            try:
                await msg.respond(to_json(reply))
            except Exception as exc:
                self.log.warning("could not answer", subject=subject, error=str(exc))

        return respond

    # -- competence over NATS ------------------------------------------------------------------

    async def answer_practice(self, data: bytes) -> dict[str, Any] | ErrorReply:
        """`<svc>.skills.practice` `{"proposal_id"}`: count the chain's new outcomes."""
        body = _request(data, ("proposal_id",))
        if isinstance(body, ErrorReply):
            return body
        try:
            practice, written = await self.store.practise_proposal(body["proposal_id"])
            head = await self.store.competence(practice.identity, practice.holder)
        except NotPractice as exc:
            return _error("not_practice", str(exc), "proposal_id")
        except Exception as exc:  # the store briefly unreachable: "not now"
            return self._unavailable("skills.practice", exc)
        return {"proposal_id": practice.proposal_id, "skill": practice.identity,
                "holder": practice.holder, "outcomes": len(practice.outcomes),
                "counted_now": len(written), "competence": head}

    async def answer_competence(self, data: bytes) -> dict[str, Any] | ErrorReply:
        """`<svc>.skills.competence` `{"skill", "holder", "history"?}`: the head grain and, when
        asked, the newest `history` grains of the holder's chain (oldest first)."""
        body = _request(data, ("skill", "holder"), ("history",))
        if isinstance(body, ErrorReply):
            return body
        limit = body.get("history", 0)
        if not isinstance(limit, int) or isinstance(limit, bool) or not 0 <= limit <= 256:
            return _error(wire.INVALID_VALUE, "history is an integer from 0 to 256", "history")
        try:
            head = await self.store.competence(body["skill"], body["holder"])
            history = await self.store.competence_history(body["skill"], body["holder"], limit) \
                if limit else []
        except GrantMismatch as exc:
            return _error(wire.INVALID_VALUE, str(exc), "skill")
        except Exception as exc:
            return self._unavailable("skills.competence", exc)
        return {"skill": body["skill"], "holder": body["holder"], "competence": head,
                "history": history}

    async def answer_transfer(self, data: bytes) -> dict[str, Any] | ErrorReply:
        """`<svc>.skills.transfer` `{"skill", "from", "to"}`: the recipe, not the track record."""
        body = _request(data, ("skill", "from", "to"))
        if isinstance(body, ErrorReply):
            return body
        try:
            grain = await self.store.transfer(body["skill"], body["from"], body["to"], now_ms())
        except NoCompetence as exc:
            return _error(wire.NOT_FOUND, str(exc), "from")
        except Refused as exc:
            return _error("refused", str(exc))
        except GrantMismatch as exc:
            return _error(wire.NOT_FOUND if isinstance(exc, NotStored) else wire.INVALID_VALUE,
                          str(exc), "skill")
        except Exception as exc:
            return self._unavailable("skills.transfer", exc)
        return {"skill": body["skill"], "holder": body["to"], "address": address_of(grain),
                "grain": grain}

    async def answer_tool(self, data: bytes) -> dict[str, Any] | ErrorReply:
        """`<svc>.skills.tool` `{"grain"}`: keep a Tool definition grain; its address."""
        body = _request(data, (), ("grain",))
        if isinstance(body, ErrorReply):
            return body
        try:
            address = await self.store.put_tool(body.get("grain"))
        except Refused as exc:
            return _error(wire.INVALID_VALUE, str(exc), "grain")
        except Exception as exc:
            return self._unavailable("skills.tool", exc)
        return {"address": address}

    async def answer_export(self, data: bytes) -> dict[str, Any] | ErrorReply:
        """`<svc>.skills.export` `{"skill", "holder"?}`: the skill's transfer bundle."""
        body = _request(data, ("skill",), ("holder",))
        if isinstance(body, ErrorReply):
            return body
        try:
            return await self.store.export(body["skill"], body.get("holder"))
        except NoCompetence as exc:
            return _error(wire.NOT_FOUND, str(exc), "holder")
        except NotStored as exc:
            return _error(wire.NOT_FOUND, str(exc), "skill")
        except (GrantMismatch, Refused) as exc:
            return _error("refused", str(exc), "skill")
        except Exception as exc:
            return self._unavailable("skills.export", exc)

    async def answer_import(self, data: bytes) -> dict[str, Any] | ErrorReply:
        """`<svc>.skills.import` `{"bundle", "holder"?}`: re-verify a bundle and keep it."""
        body = _request(data, (), ("bundle", "holder"))
        if isinstance(body, ErrorReply):
            return body
        holder = body.get("holder")
        if holder is not None and (not isinstance(holder, str) or not holder):
            return _error(wire.INVALID_VALUE, "holder must be a non-empty string", "holder")
        try:
            return await self.store.import_bundle(body.get("bundle"), holder)
        except Refused as exc:
            return _error("refused", str(exc), "bundle")
        except Exception as exc:
            return self._unavailable("skills.import", exc)

    async def answer_discover(self, data: bytes) -> dict[str, Any] | ErrorReply:
        """`<svc>.skills.discover` `{"name"?, "namespace"?, "holder"?, "min_proficiency"?,
        "history"?}`: the current heads that answer it, best first (`SkillsStore.discover`)."""
        body = _request(data, (), ("name", "namespace", "holder", "min_proficiency",
                                   "history"))
        if isinstance(body, ErrorReply):
            return body
        problem = discovery_problem(body)
        if problem is not None:
            return _error(wire.INVALID_VALUE, problem[1], problem[0])
        try:
            return {"skills": await self.store.discover(body)}
        except Exception as exc:
            return self._unavailable("skills.discover", exc)

    def _unavailable(self, what: str, exc: Exception) -> ErrorReply:
        self.log.warning(f"{what} failed", service=self.store.service, error=repr(exc))
        return _error("unavailable", f"failed for now: {type(exc).__name__}: {exc}")

    async def _on_learn_back(self, msg: Msg) -> None:
        pid = S.token(msg.subject, 3)
        if pid is None or not S.ID_RE.match(pid):
            return
        if pid in self._waking:
            self._waking[pid] = True  # count again once the running pass ends
            return
        self._waking[pid] = False
        task = asyncio.get_running_loop().create_task(self._wake(pid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wake(self, pid: str) -> None:
        try:
            while True:
                try:
                    await self.store.practise_proposal(pid)
                except NotPractice as exc:
                    self.log.debug("no practice to count", proposal_id=pid, why=str(exc))
                except Exception as exc:  # asked again by the next record, or by a request
                    self.log.warning("counting practice failed", proposal_id=pid,
                                     error=repr(exc))
                if not self._waking.get(pid):
                    return
                self._waking[pid] = False
        finally:
            self._waking.pop(pid, None)
