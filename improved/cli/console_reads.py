"""What the console's pages show, read as the commands read it: every proposal from the
retained records (filtered and paged), the mesh's state as `improved status` reads it with the
keys `improved audit verify` trusts and the last checkpoint, and the log verified since that
checkpoint as `improved audit verify --since` does. The filtering, paging and the verdict's
word are pure functions at the top; the reads below them open one short connection each."""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, get_args

from improved.cli.common import deployment
from improved.cli.errors import USAGE, Failure
from improved.client.config import Config
from improved.client.connection import Target
from improved.protocol import subjects as S
from improved.protocol.model import ChangeClass, ProposalState, Status

PER_PAGE = 50
MAX_PER_PAGE = 200
STATUSES: tuple[str, ...] = get_args(Status)
CLASSES: tuple[str, ...] = get_args(ChangeClass)


@dataclass(frozen=True)
class Filters:
    """What the front page lists: proposals of this status, service and class (empty: any),
    the page (1: the newest) and how many a page."""

    status: str = ""
    service: str = ""
    change_class: str = ""
    page: int = 1
    per_page: int = PER_PAGE

    def query(self, **changed: Any) -> str:
        """The query string of these filters with `changed`, defaults left out."""
        moved = replace(self, **changed)
        pairs = {"status": moved.status, "service": moved.service,
                 "class": moved.change_class,
                 "page": moved.page if moved.page != 1 else "",
                 "n": moved.per_page if moved.per_page != PER_PAGE else ""}
        return urllib.parse.urlencode({k: v for k, v in pairs.items() if v != ""})


def filters_of(query: str) -> Filters:
    """The front page's filters from its query string; a value that is none of the known
    ones is a Failure (a 400 page of one line), never an empty list that looks like none."""
    given = {k: v[-1].strip() for k, v in urllib.parse.parse_qs(query).items()}
    status, service, cls = (given.get("status", ""), given.get("service", ""),
                            given.get("class", ""))
    if status and status not in STATUSES:
        raise Failure(f"no status {status!r}: one of {', '.join(STATUSES)}", USAGE)
    if service and not S.SERVICE_RE.match(service):
        raise Failure(f"no service can be named {service!r} (a-z, 0-9, _ and -, starting "
                      "with a letter)", USAGE)
    if cls and cls not in CLASSES:
        raise Failure(f"no class {cls!r}: one of {', '.join(CLASSES)}", USAGE)
    return Filters(status, service, cls, _number(given, "page", 1, 10**6),
                   _number(given, "n", PER_PAGE, MAX_PER_PAGE))


def _number(given: dict[str, str], name: str, default: int, most: int) -> int:
    text = given.get(name, "")
    if not text:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise Failure(f"{name} must be a whole number from 1 to {most}, not {text[:20]!r}",
                      USAGE)
    return int(text)


@dataclass(frozen=True)
class Listed:
    """One page of the proposals the filters match, newest first, and how many match."""

    rows: list[ProposalState]
    filters: Filters
    matching: int

    @property
    def newer(self) -> bool:
        return self.filters.page > 1

    @property
    def older(self) -> bool:
        return self.filters.page * self.filters.per_page < self.matching


def listed(states: Sequence[ProposalState], filters: Filters) -> Listed:
    """The page of `states` that `filters` asks for: those matching, the most recently moved
    first (then by id, so a page is the same on reload)."""
    matching = sorted((s for s in states
                       if (not filters.status or s.status == filters.status)
                       and (not filters.service or s.service == filters.service)
                       and (not filters.change_class or s.change_class == filters.change_class)),
                      key=lambda s: (s.updated_at, s.proposal_id), reverse=True)
    start = (filters.page - 1) * filters.per_page
    return Listed(matching[start:start + filters.per_page], filters, len(matching))


def verdict_of(code: int, anchored: bool) -> str:
    """The verify's exit code in the words `audit verify` says: VERIFIED, BROKEN (something forged, altered
    or missing), UNVERIFIED (nothing wrong found, but with no trusted daemon key the writers
    could not be checked: exit 3, or 0 from a verifier that trusted no key) or, when it could
    not run, NOT RUN."""
    if code == 1:
        return "BROKEN"
    if code == 3 or (code == 0 and not anchored):
        return "UNVERIFIED"
    return "VERIFIED" if code == 0 else "NOT RUN"


def hidden(line: str, paths: Sequence[tuple[str, str]]) -> str:
    """`line` with each of `paths` (text, what to say instead) replaced, the longest first:
    a page never shows where the console's files are on its host."""
    for text, instead in sorted(paths, key=lambda p: len(p[0]), reverse=True):
        if len(text) > 1:  # never "/" alone
            line = line.replace(text, instead)
    return line


def private_paths(config: Config) -> list[tuple[str, str]]:
    """The host's paths a verifier's line may name, and what a page says instead."""
    found: list[tuple[str, str]] = []
    for path, name in ((config.checkpoint_key, "the checkpoint key file"),
                       (config.data_dir, "the data directory"), (Path.home(), "~")):
        if path is not None:
            found += [(str(path), name), (str(Path(path).resolve()), name)]
    return found


def anchored(config: Config) -> bool:
    """Whether a verifier run with `config` trusts a daemon key: `[trust] daemons`, the
    checkpoint key, or the checkpoint file kept in the data directory (`audit verify`)."""
    from improved.cli.audit import trusted_daemons
    from improved.client import anchor

    return bool(trusted_daemons(config)) or anchor.path_in(config.data_dir).exists()


# -- the reads ---------------------------------------------------------------------------------


async def proposals(url: Target, filters: Filters) -> Listed:
    """The front page's proposals (`RecordReads.read_states`): O(retained states) — the open
    proposals and those closed within `records_ttl_days`, of the filtered service alone
    when one is given — whatever the length of the closed history before them."""
    async with deployment(url, bind=False) as store:
        states = await store.read_states(filters.service or None)
    return listed(states, filters)


@dataclass
class Mesh:
    """The mesh panel: `improved status`'s view, the daemon keys this console trusts, the keys
    in force (the trust chain's, else this configuration's) and the last checkpoint."""

    status: dict[str, Any]
    daemons: list[str]
    keys: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # role → (who, id)
    keys_from: str = ""
    checkpoint: dict[str, Any] | None = None  # count, at, last_seq, keyid, trusted (why not)


async def mesh(url: Target, config: Config) -> Mesh:
    """What the mesh runs under, read as `improved status` and `improved audit verify` read
    it: O(1) reads and the trust chain (one trailer per change of keys)."""
    from improved.cli.audit import chain_trust, trusted_daemons
    from improved.cli.queries import status_view
    from improved.client import indexing
    from improved.client.checkpointing import CP_SUBJECT
    from improved.core import checkpoint, evidence

    status = await status_view(url, config)
    daemons = trusted_daemons(config)
    async with deployment(url, bind=False) as store:
        trust = chain_trust((await store.read_audit(evidence.TRUST_ID))[0], daemons, config)
        _, body = await store.chain_head(CP_SUBJECT)
        counted, why_not = await indexing.last_counted(store, daemons)
    keys = trust.history.at(0)
    found = Mesh(status, sorted(daemons), {
        role: sorted((k.principal, k.keyid) for k in held.keys.values())
        for role, held in (("operators", keys.operators), ("voters", keys.voters),
                           ("signers", keys.signers))},
        "the trust chain" if trust.history.snapshots else "this console's configuration")
    if body is not None:
        try:
            cp = checkpoint.from_trailer(body)
        except (KeyError, ValueError):
            found.checkpoint = {"unreadable": why_not or "the last checkpoint cannot be read"}
        else:
            found.checkpoint = {
                "count": cp.count, "at": cp.at, "last_seq": cp.last_seq, "keyid": cp.keyid,
                "trusted": ("" if counted is not None and daemons else
                            "no daemon key here to check who signed it" if not daemons
                            else why_not)}
    return found


@dataclass(frozen=True)
class Verified:
    """A verify's verdict word, its exit code and the lines it said (paths hidden)."""

    verdict: str
    code: int
    lines: list[str]


async def since_checkpoint(url: Target, config: Config) -> Verified:
    """`improved audit verify --since`: O(what was appended since the last trusted
    checkpoint), and O(1) checks that the stream still holds what that checkpoint covered."""
    from improved.cli.audit import verify_since

    lines: list[str] = []
    code = await verify_since(url, config, lines.append, lines.append)
    paths = private_paths(config)
    return Verified(verdict_of(code, anchored(config)), code,
                    [hidden(line, paths) for line in lines])
