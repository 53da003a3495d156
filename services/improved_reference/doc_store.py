"""The reference doc store: applies `proposal_edit` unified diffs to the documents it keeps in
NATS KV, with the OMS obligations for `doc:` targets (rule 9).

- **An allowlist**: the target's path, in the daemon's canonical form (`guards.canonical_path`:
  percent-decoded, NFKC, `..` collapsed, case-folded), must match one of the globs
  (`--allow GLOB`, repeatable; default `docs/**` and `*.md`, the daemon's
  `policy.doc_allowlist` default). A path that climbs above the root (`../x`) has no place
  here and is refused.
- **The base**: `base_digest` must equal the current head, `sha256:<hex of the UTF-8 text>`
  (a document never written is the empty text, `sha256:e3b0c442…`, so a diff from /dev/null
  creates it). Otherwise the edit is refused: the document moved since the proposal was made.
- **One document**: the diff holds one file's patch, and both its paths (but /dev/null,
  with git's `a/` `b/` prefixes dropped) are the target's, in canonical form.
- **A replayable inverse**: `{"edit": {"format": "unified", "base_digest": <the new head>,
  "diff": <the reverse diff>}}`. The daemon's rollback sends it back as `proposal_data`, which
  this store applies with the same checks; so does any later edit that moved the document
  first make the rollback refused, never applied over it.

Storage (`<svc>` with `-` made `_`): KV `docs_<svc>` (history 64), key `doc.<sha256 hex of the
canonical path>` → `{"path", "text", "digest"}`; KV `docapplies_<svc>`, the apply ledger
(exactly once per proposal id, the protocol of `kv_service`).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client

from improved.core import guards
from improved.core.policy import DEFAULT_DOC_ALLOWLIST
from improved.protocol.model import ApplyOrder, ApplyResult, Proposal, to_json
from improved_reference import diffs, kv_service
from improved_reference.kv_service import KVService, Refused

DEFAULT_ALLOW = DEFAULT_DOC_ALLOWLIST  # the daemon's policy.doc_allowlist default
FORMATS = ("unified", "unified-diff", "diff")
MAX_TEXT = 256 * 1024  # bytes of one document: it travels in one KV message


@dataclass(frozen=True)
class Change:
    key: str
    path: str  # canonical
    base_digest: str
    patch: diffs.Patch


def bucket_names(service: str) -> tuple[str, str]:
    """(documents bucket, ledger bucket): `docs_<svc>` and `docapplies_<svc>`."""
    token = service.replace("-", "_")
    return f"docs_{token}", f"docapplies_{token}"


def digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def doc_key(path: str) -> str:
    return "doc." + hashlib.sha256(path.encode("utf-8")).hexdigest()


def allowed_path(raw: str, allow: tuple[str, ...]) -> str:
    """The canonical path of an allowed document, or Refused saying why not. Pure."""
    try:
        path = guards.canonical_path(raw)
    except guards.EscapingPath:
        raise Refused(f"doc path {raw!r} climbs above the document root") from None
    except guards.UncanonicalPath as exc:
        raise Refused(f"doc path has no canonical form: {exc}") from None
    if not path or path.startswith(("/", "~")):
        raise Refused(f"doc path {raw!r} must be relative to the document root")
    if not guards.on_allowlist(path, allow):
        raise Refused(f"doc:{path} is not on this store's allowlist ({', '.join(allow)}); "
                      "only listed documents may be edited")
    return path


def parse_change(proposal: Proposal, allow: tuple[str, ...]) -> Change:
    """The edit a proposal asks of this store, or Refused naming what is wrong. Pure."""
    if proposal.proposal_cal is not None:
        raise Refused("this store applies proposal_edit (and its own inverse), not proposal_cal")
    scheme, _, rest = proposal.target_ref.partition(":")
    if scheme != "doc":
        raise Refused(f"unsupported target scheme {scheme + ':'!r}; this store applies doc: "
                      "targets")
    path = allowed_path(rest, allow)
    if proposal.proposal_edit is not None:
        edit: Any = {"format": proposal.proposal_edit.format,
                     "base_digest": proposal.proposal_edit.base_digest,
                     "diff": proposal.proposal_edit.diff}
    else:
        data = proposal.proposal_data
        if not isinstance(data, dict) or set(data) != {"edit"} or not isinstance(
                data["edit"], dict) or set(data["edit"]) != {"format", "base_digest", "diff"}:
            raise Refused('expected proposal_edit, or proposal_data {"edit": {"format", '
                          '"base_digest", "diff"}} (an inverse this store handed out)')
        edit = data["edit"]
    if edit["format"] not in FORMATS or not isinstance(edit["diff"], str) \
            or not isinstance(edit["base_digest"], str):
        raise Refused(f"format {edit['format']!r} is not a unified diff ({', '.join(FORMATS)})")
    try:
        patches = diffs.parse(edit["diff"])
    except diffs.DiffError as exc:
        raise Refused(f"the diff does not parse: {exc}") from None
    if len(patches) != 1:
        raise Refused(f"the diff holds {len(patches)} patches; one edit, one document")
    for named in (patches[0].old_path, patches[0].new_path):
        if named == "/dev/null":
            continue
        named = named[2:] if named[:2] in ("a/", "b/") else named
        try:
            same = guards.canonical_path(named) == path
        except (guards.EscapingPath, guards.UncanonicalPath):
            same = False
        if not same:
            raise Refused(f"the diff edits {named!r}, not the target doc:{path}: one edit, one "
                          "document")
    return Change(doc_key(path), path, edit["base_digest"], patches[0])


def text_of(current: Any, path: str) -> str:
    """The text of a stored document ("" for none), or Refused when the KV entry is not one
    this store wrote (anyone on the bus may write KV): never edited on a guess. Pure."""
    if current is None:
        return ""
    if not isinstance(current, dict) or not isinstance(current.get("text"), str):
        raise Refused(f"doc:{path} holds a value this store did not write; nothing was applied")
    return str(current["text"])


def edited(change: Change, current: Any) -> str:
    """The document's new text, or Refused when the base moved or the diff does not fit. Pure."""
    text = text_of(current, change.path)
    head = digest(text)
    if change.base_digest != head:
        raise Refused(f"the document moved: base_digest {change.base_digest} is not the "
                      f"current head {head} of doc:{change.path}; re-propose against it")
    try:
        new = diffs.apply(text, change.patch)
    except diffs.DiffError as exc:
        raise Refused(f"the diff does not apply to doc:{change.path}: {exc}") from None
    if len(new.encode("utf-8")) > MAX_TEXT:
        raise Refused(f"doc:{change.path} would be over {MAX_TEXT} bytes")
    return new


class DocStore(KVService[Change]):
    """Documents in KV `docs_<svc>`, the apply ledger in `docapplies_<svc>`."""

    KIND = "doc store"
    VALUES = "documents"

    def __init__(self, nc: Client, service: str, verify_acceptance: bool = False,
                 allow: tuple[str, ...] = DEFAULT_ALLOW):
        self.docs_bucket, ledger_bucket = bucket_names(service)
        super().__init__(nc, service, self.docs_bucket, ledger_bucket, verify_acceptance)
        self.allow = allow

    def capabilities(self) -> dict[str, Any]:
        return {
            **self.surface(),
            "schemes": ["doc:"],
            "proposal_edit": {"format": list(FORMATS), "base_digest": "sha256:<hex of the "
                              "document's UTF-8 text>"},
            "proposal_data": ['{"edit": {"format", "base_digest", "diff"}}'],
            "allowlist": list(self.allow),
            "buckets": {"documents": self.docs_bucket, "ledger": self.ledger_bucket},
        }

    # -- documents -----------------------------------------------------------------------------

    async def document(self, path: str) -> str | None:
        """The document's current text, or None when it holds none."""
        current, _ = await self._current(doc_key(guards.canonical_path(path)))
        return current["text"] if isinstance(current, dict) and current.get("text") else None

    async def put(self, path: str, text: str) -> str:
        """Store `text` as the document (outside the loop: seeding); its digest."""
        canonical = allowed_path(path, self.allow)
        body = to_json({"path": canonical, "text": text, "digest": digest(text)})
        await self._store(doc_key(canonical), lambda _: body)
        return digest(text)

    # -- applying (the protocol is kv_service's) -----------------------------------------------

    def _change(self, order: ApplyOrder) -> Change:
        return parse_change(order.proposal, self.allow)

    def _new_entry(self, change: Change, current: Any, cur_rev: int) -> dict[str, Any]:
        text = edited(change, current)
        return {"key": change.key, "path": change.path, "base": change.base_digest,
                "text": text, "reverse": diffs.render(diffs.reverse(change.patch)),
                "prior_rev": cur_rev, "revision": None}

    def _rebase(self, entry: dict[str, Any], current: Any, cur_rev: int) -> dict[str, Any]:
        """An unfinished edit is written only on the base it was checked against."""
        if digest(text_of(current, entry["path"])) != entry["base"]:
            raise Refused(f"the document moved: doc:{entry['path']} is no longer at "
                          f"{entry['base']}; re-propose against the current head")
        return {**entry, "prior_rev": cur_rev}

    async def _write(self, pid: str, entry: dict[str, Any], current: Any, cur_rev: int) -> int:
        body = {"path": entry["path"], "text": entry["text"], "digest": digest(entry["text"])}
        return await self._publish(entry["key"], to_json(body), cur_rev, pid)

    def _result(self, entry: dict[str, Any]) -> ApplyResult:
        head = digest(entry["text"])
        return ApplyResult(ok=True, applied_id=f"doc:{entry['path']}@{head}",
                           inverse={"edit": {"format": "unified", "base_digest": head,
                                             "diff": entry["reverse"]}},
                           rollbackable=True)


def main(argv: list[str] | None = None) -> int:
    module = "improved_reference.doc_store"
    description = ("Reference mesh service: applies doc: proposal_edit unified diffs ordered "
                   "by improved to documents in NATS KV, only on the allowlist and only on the "
                   "base they were made against, exactly once per proposal, with the reverse "
                   "diff as the inverse.")
    p = kv_service.parser(module, description)
    p.add_argument("--allow", action="append", default=[], metavar="GLOB",
                   help="documents that may be edited (repeat; default: "
                        + " and ".join(DEFAULT_ALLOW) + ", as the daemon's "
                        "policy.doc_allowlist)")
    p.add_argument("--seed", action="append", default=[], metavar="PATH=FILE",
                   help="before serving, store FILE's UTF-8 text as document PATH unless it "
                        "holds one already; repeat")

    def setup(args: argparse.Namespace) -> kv_service.Setup | None:
        try:
            seeds = kv_service.seed_texts("--seed", args.seed, "PATH=FILE")
        except ValueError as exc:
            p.error(str(exc))
        allow = tuple(args.allow) or DEFAULT_ALLOW

        async def configure(store: KVService[Any]) -> list[str]:
            assert isinstance(store, DocStore)
            store.allow = allow
            lines = [f"allowlist {', '.join(allow)}"]
            for path, (file, text) in seeds.items():
                if await store.document(path) is None:
                    lines.append(f"doc:{path} seeded from {file} at {await store.put(path, text)}")
                else:
                    lines.append(f"doc:{path} holds a document already; --seed left it")
            return lines
        return configure

    return kv_service.main(DocStore, argv, module, description, p, setup)


if __name__ == "__main__":
    sys.exit(main())
