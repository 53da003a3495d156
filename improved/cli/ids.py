"""A proposal named on the command line: its full id, or — as git takes a commit — a unique
prefix of at least MIN_PREFIX hex digits (the demo prints 12).

A full id costs no lookup here. A prefix is matched against the subjects of the audit stream,
one chain per proposal, in one paged stream-info request: the server lists the chain subjects
and the match is made here, so its cost follows the number of proposals the stream holds (an
exported, removed epoch's proposals are no longer found, as with a full id)."""

from __future__ import annotations

import argparse
import json
import re

from nats.aio.client import Client

from improved.cli.errors import Failure
from improved.client.deployment import Deployment
from improved.protocol import subjects as S

MIN_PREFIX = 4
SHOWN = 3  # candidates an ambiguous prefix names
_ID_OR_PREFIX = re.compile(rf"^[0-9a-f]{{{MIN_PREFIX},64}}\Z")


def id_arg(text: str) -> str:
    """argparse `type=`: a proposal id or a prefix of one, lower-cased; anything else is a
    usage error (exit 2) before any connection is made."""
    lowered = text.strip().lower()
    if not _ID_OR_PREFIX.match(lowered):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a proposal id: give its 64 hex digits or a unique prefix of at "
            f"least {MIN_PREFIX}")
    return lowered


def chain_arg(text: str) -> str:
    """argparse `type=` of `audit verify`: `runtime:NAME`, the id of that tool runtime's
    chain; else a proposal id or prefix (or a chain's full id) as `id_arg` takes it."""
    if text.startswith("runtime:"):
        from improved.core.tools import chain_id

        name = text.removeprefix("runtime:")
        if not S.SERVICE_RE.match(name):
            raise argparse.ArgumentTypeError(
                f"{name!r} is not a runtime name (it must match {S.SERVICE_RE.pattern})")
        return chain_id(name)
    return id_arg(text)


def is_full(text: str) -> bool:
    return S.ID_RE.match(text) is not None


async def resolve(store: Deployment, text: str) -> tuple[str, str]:
    """(service, full id) of the proposal `text` names; Failure (exit 1) when no proposal
    matches or the prefix is ambiguous, naming a few candidates."""
    if is_full(text):
        svc = await store.service_of(text)
        if svc is None:
            raise Failure(f"no proposal {text} (no audit chain holds it)")
        return svc, text
    found = await with_prefix(store.nc, text)
    if not found:
        raise Failure(f"no proposal id starts with {text}; `improved review` lists what waits")
    if len(found) > 1:
        named = ", ".join(f"{pid[:16]} ({svc})" for svc, pid in found[:SHOWN])
        more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
        raise Failure(f"{text} is ambiguous: {named}{more}; give more digits")
    return found[0]


async def full_id(store: Deployment, text: str) -> str:
    """The full id `text` names, for a command that needs only the id: a full one as given."""
    return text if is_full(text) else (await resolve(store, text))[1]


async def with_prefix(nc: Client, prefix: str, page_timeout: float = 10.0) -> list[tuple[str, str]]:
    """Every (service, id) whose proposal chain's id starts with `prefix`, sorted. The server
    gives at most 100,000 subjects a reply, so the listing is paged by offset."""
    found: list[tuple[str, str]] = []
    offset = 0
    while True:
        request = {"subjects_filter": S.AUDIT_FILTER, "offset": offset}
        reply = await nc.request(f"$JS.API.STREAM.INFO.{S.STREAM_AUDIT}",
                                 json.dumps(request).encode(), timeout=page_timeout)
        info = json.loads(reply.data)
        if "error" in info:
            if info["error"].get("err_code") == 10059:  # stream not found: nothing recorded
                return []
            raise Failure(f"cannot list the audit chains: {info['error'].get('description')}")
        subjects = (info.get("state") or {}).get("subjects") or {}
        for subject in subjects:
            svc, pid = S.token(subject, 2), S.token(subject, 3)
            if svc and pid and svc not in S.MESH_CHAINS and pid.startswith(prefix):
                found.append((svc, pid))
        offset += len(subjects)
        if not subjects or offset >= info.get("total", 0):
            return sorted(found)
