"""`improved audit verify|rebuild`: re-derive every chain, and rebuild records from them."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections.abc import Callable, Coroutine
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from improved.cli import ids
from improved.cli.common import (
    add_connection_args,
    config_of,
    deployment,
    full_id,
    url_of,
)
from improved.cli.verdicts import BROKEN, CLEAN, UNVERIFIED, log_said
from improved.client import credentials
from improved.client.config import Config
from improved.client.connection import Target
from improved.core import audit, checkpoint, evidence, retained
from improved.core.checkpoint import Anchor
from improved.core.record import ProposalRecord, status_at
from improved.protocol import subjects as S
from improved.protocol.model import ProposalState, Trailer, to_json

if TYPE_CHECKING:
    from improved.client.checkpointing import Since
    from improved.client.deployment import Deployment
    from improved.client.tool_chains import ToolChains, Witnesses
    from improved.core.epochs import Seal


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _read_kept(anchor_path: Path | None) -> Anchor | str | None:
    """The checkpoint file at `anchor_path`, read before the stream (a daemon may sign a
    newer one while the log is read): the anchor, or what is wrong with it."""
    from improved.client import anchor

    if anchor_path is None:
        return None
    try:
        return anchor.read(anchor_path) or f"no checkpoint file at {anchor_path}"
    except ValueError as exc:
        return f"the checkpoint file cannot be read: {exc}"


async def settled_anchors(store: Deployment, config: Config, kept: Anchor | str | None,
                   anchor_path: Path | None, explicit: bool, note: Callable[[str], None]
                   ) -> tuple[dict[str, str], Anchor | str | None]:
    """The daemon keys to verify against, each with where it was found, and the checkpoint
    file to verify against. The data directory's checkpoint key and kept checkpoint (unless
    the file was named with --checkpoint) are left out, with a note, when they were kept for
    another deployment: `checkpoint.kept_elsewhere` says when, and why a re-created stream
    cannot pass for that."""
    from improved.client import anchor

    sources = configured_anchors(config)
    own = own_anchor(config)
    local = ({own[0]} if own else set()) | (
        {kept.keyid} if isinstance(kept, Anchor) and not explicit else set())
    if local and (await store.audit_view()).created is not None:
        signers = await anchor.log_signers(store)
        if checkpoint.kept_elsewhere(local, set(sources), signers):
            note(f"note: the data directory {config.data_dir} holds the checkpoint key or "
                 f"kept checkpoint of another deployment (daemon key "
                 f"{', '.join(k[:16] + '…' for k in sorted(local))}; this log's daemon chains "
                 f"are signed by {', '.join(k[:16] + '…' for k in sorted(signers))}): not "
                 "checked against them")
            own = None
            kept = None if not explicit else kept
    if own is not None:
        sources.setdefault(*own)
    if isinstance(kept, Anchor):
        sources.setdefault(kept.keyid, f"the checkpoint file {anchor_path}")
    return sources, kept


async def log_trusted(store: Deployment, config: Config) -> set[str]:
    """The daemon keys a read of this log trusts (`settled_anchors`, without a checkpoint
    file): a data directory kept for another deployment lends it none."""
    sources, _ = await settled_anchors(store, config, None, None, False, _to_stderr)
    return set(sources)


async def _verify(url: str | Target, pid: str | None, anchor_path: Path | None,
                  explicit: bool, config: Config) -> int:
    """One proposal's chain (`pid`), or the whole log (`_verify_log`)."""
    kept = _read_kept(anchor_path)
    if pid is None:
        return await _verify_log(url, kept, anchor_path, explicit, config)
    async with deployment(url, bind=False) as store:
        sources, _ = await settled_anchors(store, config, kept, anchor_path, explicit, _to_stderr)
        log_, view = await store.read_audit(pid)
        trust_log = (await store.read_audit(evidence.TRUST_ID))[0]
        chains: dict[tuple[str | None, str | None], list[tuple[int, dict[str, Any]]]] = {}
        for seq, subject, body in log_:
            chains.setdefault((S.token(subject, 2), S.token(subject, 3)), []).append((seq, body))
        trust = chain_trust(trust_log, set(sources), config)
        if not chains:
            return await _verify_tool_chain(store, config, trust, pid)
        broken = _verify_chains(chains, trust, len(log_))
        if view.created is None:
            print(f"BROKEN the audit stream {S.STREAM_AUDIT} does not exist")
        line, code = log_said(len(chains), bool(broken or view.created is None), sources)
        print(line)
        return code


async def _verify_log(url: str | Target, kept: Anchor | str | None, anchor_path: Path | None,
                      explicit: bool, config: Config, archive_dir: Path | None = None,
                      say: Callable[[str], None] = print,
                      note: Callable[[str], None] = _to_stderr) -> int:
    """The whole log, read once from its first trailer and verified as it streams by
    (`checkpointing.verify_since` from nothing, reading on past a broken chain): every chain,
    every checkpoint on the stream by its signature, key and root, and the checkpoint kept in
    the data directory. Memory stays flat however long the log. With `archive_dir`, each
    sealed epoch is read from its export there (from the stream when it was not exported) and
    checked exactly against its seal (`archive.ArchiveRead`); without it, what the stream
    still holds is verified and the tree goes on from the seal. The last line is the verdict
    (`verdicts.log_said`), and so is the exit code."""
    from improved.client import archive, checkpointing, tool_chains

    async with deployment(url, bind=False) as store:
        sources, kept = await settled_anchors(store, config, kept, anchor_path, explicit, note)
        trusted = set(sources)
        view = await store.audit_view()
        if view.created is None:
            say(f"BROKEN the audit stream {S.STREAM_AUDIT} does not exist")
            for problem in [kept] if isinstance(kept, str) else \
                    [checkpoint.prefix_problem(kept, view, None, _KEPT)] if kept else []:
                say(f"BROKEN {problem}")
            return 1
        subject = S.trust_audit(evidence.TRUST_ID)
        trust = chain_trust([(seq, subject, body) for seq, body
                             in await store.read_chain_at(subject)], trusted, config)
        read, problems, claims = await _expected(store, view, kept, trust, trusted,
                                                 seal_roots=archive_dir is None)
        seals = [seal for seal, _ in read]
        last = seals[-1] if seals else None
        exports = archive.ArchiveRead(archive_dir, read) if archive_dir is not None else None
        if exports is not None and not exports.found:
            note(f"note: {archive_dir} is not a directory: no epoch is read from an export")
        started = time.perf_counter()
        witnesses = tool_chains.Witnesses(store.nc)
        since = await checkpointing.verify_since(
            store, checkpointing.empty_base(view), view, trust, trusted, claims,
            every_chain=True, report=lambda brk: say(f"BROKEN {brk}"),
            archived=last if exports is None else None,
            source=exports.entries(store, view.last_seq) if exports is not None else None,
            on_checkpoint=witnesses.fold, sealed=seals if exports is not None else ())
        problems += (exports.problems if exports is not None else []) + since.problems
        for problem in problems:
            say(f"BROKEN {problem}")
        _print_counts(since, time.perf_counter() - started, say, bool(trusted))
        if exports is not None:
            for epochs_, where in ((exports.from_export, f"the export in {archive_dir}"),
                                   (exports.from_stream, "the stream (not exported yet)")):
                if epochs_:
                    say(f"epoch{'s' if len(epochs_) > 1 else ''} {_listed(epochs_)} read from "
                        f"{where}, each checked exactly against its seal")
        elif last is not None and view.messages is not None and view.messages < view.last_seq:
            say(f"sealed epochs up to stream sequence {last.upto} are archived: what the "
                "stream still holds of them is verified; pass --archive DIR to verify them "
                "whole")
        if not problems:
            _, body = await store.chain_head(checkpointing.CP_SUBJECT)
            if body is not None:
                cp = checkpoint.from_trailer(body)
                whose = ("a trusted daemon key" if cp.keyid in trusted else
                         "a key not checked: no trusted daemon key")
                say(f"checkpoint of {cp.count} trailers (signed by {cp.keyid[:20]}…, {whose}) "
                    "holds: nothing it covered was removed, altered or reordered")
            if isinstance(kept, Anchor):
                say(f"checkpoint file {anchor_path} ({kept.count} trailers up to stream "
                    f"sequence {kept.last_seq}) holds: the stream is the one it was signed "
                    "over")
        tools = await _verify_tools(store, config, trust, say, note, witnesses)
        line, code = log_said(since.chains, bool(problems or since.broken or tools.broken),
                              sources, tools.unverified)
        say(line)
        return code


async def _verify_tools(store: Deployment, config: Config, trust: evidence.ChainTrust,
                        say: Callable[[str], None], note: Callable[[str], None],
                        witnesses: Witnesses, *, since_ms: int | None = None) -> ToolChains:
    """The tool runtimes' chains, outside the daemon's log, each against its runtime's key in
    `[trust.runtimes]` (with `since_ms`, only the trailers stored from then on) and against
    the heads the daemon's checkpoints witnessed (`witnesses`, as the read of the log met
    them): a line for each broken or unverified chain, then the counts; what it found."""
    from improved.client.tool_chains import verify_tool_chains

    found = await verify_tool_chains(
        store.nc, config.trust.runtime_store(), trust.history, since_ms=since_ms,
        witnessed={c: w for c, w in witnesses.seen.items() if c not in witnesses.named})
    found.lines[:0] = witnesses.lines
    if not found.exists and found.ok:
        note(f"note: no stream {S.STREAM_TOOLS_AUDIT}: no tool runtime has recorded a call "
             "here (`improved provision` makes it)")
        return found
    for line in found.lines:
        say(line)
    if found.chains or not found.ok:
        say(found.summary() + (" since the checkpoint" if since_ms is not None else ""))
    if not found.broken and any(line.startswith("BROKEN") for line in found.lines):
        found.broken = 1  # a witnessed head no longer held
    return found


async def _verify_tool_chain(store: Deployment, config: Config, trust: evidence.ChainTrust,
                             cid: str) -> int:
    """`audit verify <chain id>` of a tool runtime's chain (on IMPROVE_TOOLS_AUDIT), as the
    whole-log verify checks it; exit 1 when it is broken or unverified, or there is none."""
    from improved.client import checkpointing, tool_chains
    from improved.client.tool_chains import verify_tool_chains

    witnesses = tool_chains.Witnesses(store.nc)  # the last checkpoint's alone
    _, last = await store.chain_head(checkpointing.CP_SUBJECT)
    if last is not None and evidence.writer_problem(last, trust.daemons) is None:
        await witnesses.fold(last)
    found = await verify_tool_chains(store.nc, config.trust.runtime_store(), trust.history,
                                     chain=cid, witnessed=witnesses.seen)
    if not found.chains and found.ok:
        print(f"improved audit verify: no chain for {cid} (neither a proposal's nor a tool "
              "runtime's)", file=sys.stderr)
        return 1
    for line in found.lines:
        print(line)
    print(found.summary())
    return BROKEN if any(line.startswith("BROKEN") for line in found.lines) else \
        UNVERIFIED if found.unverified else CLEAN


_KEPT = "the last checkpoint kept in the data directory"


async def _expected(store: Deployment, view: checkpoint.StreamView, kept: Anchor | str | None,
                    trust: evidence.ChainTrust, trusted: set[str], seal_roots: bool = True
                    ) -> tuple[list[tuple[Seal, dict[str, Any]]], list[str],
                               list[tuple[int, str, str]]]:
    """What the log must hold: the seals on the stream with their trailers, what is already
    wrong (an unreadable checkpoint file, a seal chain that does not hold, a stream the file
    does not find in O(1)), and the roots to check as the read reaches their counts (each
    seal's, unless `seal_roots` is off because an archive read checks them, and the file's)."""
    from improved.client import archive

    problems = [kept] if isinstance(kept, str) else []
    read, unsealed = await archive.read_seals(store, trust, trusted)
    problems += [unsealed] if unsealed else []
    seals = [seal for seal, _ in read]
    claims = [(seal.count, seal.root, f"the seal of epoch {seal.epoch}") for seal in seals
              if seal_roots]
    if isinstance(kept, Anchor):
        at = await store.trailer_at(kept.last_seq) if kept.count else None
        found = checkpoint.prefix_problem(kept, view, at[1].get("hash") if at and at[1]
                                          else None, _KEPT,
                                          seals[-1].removable if seals else 0)
        problems += [found] if found else []
        if kept.count and not found:
            claims.append((kept.count, kept.root, _KEPT))
    return read, problems, claims


def _listed(numbers: list[int]) -> str:
    """1, 2, 3, 5 as "1..3, 5"."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in spans)


_HELD = {True: "verified", False: "hold (hashes and links)"}


def _print_counts(since: Since, seconds: float, say: Callable[[str], None] = print,
                  anchored: bool = True) -> None:
    """The counts, then the rates; `anchored` False: no writer was checked, so what held is
    only the hashes and links (the verdict line says so)."""
    ok = since.chains - since.broken
    say(f"{ok}/{since.chains} chains {_HELD[anchored]}, {since.read} trailers"
        + (f", {since.broken} broken" if since.broken else ""))
    reading = max(seconds - since.verify_s, 0.0)
    say(f"read: {_rate(since.read, reading)}; hashes and links: "
        f"{_rate(since.read, since.verify_s - since.writers_s)}; daemon signatures and "
        f"signed acts: {_rate(since.read, since.writers_s)}; in all "
        f"{_rate(since.read, seconds)}")


async def _verify_since(url: str | Target, anchor_path: Path | None, explicit: bool,
                        config: Config, say: Callable[[str], None] = print,
                        note: Callable[[str], None] = _to_stderr) -> int:
    """Verify only what the log gained since the last trusted checkpoint, as the daemon's
    checkpoint does (`client.checkpointing`): in O(1) that the stream still holds what that
    checkpoint covered, then every trailer after it in its chain. Without a checkpoint to
    continue from, the whole log is read once, one trailer at a time."""
    from improved.client import anchor, archive, checkpointing, tool_chains

    kept = None
    if anchor_path is not None:
        try:
            kept = anchor.read(anchor_path)
        except ValueError as exc:
            say(f"BROKEN the checkpoint file cannot be read: {exc}")
            return 1
    async with deployment(url, bind=False) as store:
        sources, settled = await settled_anchors(store, config, kept, anchor_path, explicit,
                                                 note)
        kept = settled if isinstance(settled, Anchor) else None
        trusted = set(sources)
        view = await store.audit_view()
        if view.created is None:
            say(f"BROKEN the audit stream {S.STREAM_AUDIT} does not exist")
            return 1
        subject = S.trust_audit(evidence.TRUST_ID)
        trust = chain_trust([(seq, subject, body) for seq, body
                             in await store.read_chain_at(subject)], trusted, config)
        started = time.perf_counter()
        seal, unsealed = await archive.last_seal(store, trusted)
        base, claims, problems = await checkpointing.choose_base(
            store, kept, view, trust, trusted, seal.removable if seal else 0)
        problems += [unsealed] if unsealed else []
        since = None
        witnesses = tool_chains.Witnesses(store.nc)
        if not problems:
            since = await checkpointing.verify_since(
                store, base, view, dataclasses.replace(trust, covered_to=base.last_seq),
                trusted, claims, archived=seal, on_checkpoint=witnesses.fold)
            problems = since.problems
        for problem in problems:
            say(f"BROKEN {problem}")
        if not problems and since is not None:
            seconds = time.perf_counter() - started
            say(f"{since.read} trailers after the checkpoint of {base.count} trailers "
                f"(stream sequence {base.last_seq}) verified in {seconds:.2f} s; the stream "
                "still holds what that checkpoint covered (the same stream, no sequence "
                "lost, the same last trailer). A full `improved audit verify` re-derives "
                "the covered part too.")
        tools = await _verify_tools(store, config, trust, say, note, witnesses,
                                    since_ms=base.at if base.count else None)
        line, code = log_said(since.chains if since is not None else 0,
                              bool(problems or since is None or tools.broken), sources,
                              tools.unverified)
        say(line)
        return code


def chain_trust(log_: list[tuple[int, str, dict[str, Any]]], daemons: set[str],
                config: Config) -> evidence.ChainTrust:
    """Whom the verifier trusts: the daemon keys it was given, and the operator, voter and
    signer keys the trust chain recorded (verified against those daemon keys), else the
    configuration's.
    A `_tools` chain written into the daemon's log before the runtimes' chains moved to their
    own stream verifies under its runtime's key in `[trust.runtimes]` too, so that key need
    not stay among the daemons'."""
    from improved.core.tools import runtime_writers

    fallback = evidence.KeySet(config.trust.store(), config.trust.voters(),
                               config.trust.signer_store())
    earlier = {cid: kid for cid, (_, kid) in runtime_writers(config.trust.runtime_store()).items()}
    trust = evidence.ChainTrust(frozenset(daemons), evidence.History(fallback=fallback),
                                earlier_runtimes=earlier, anchored=bool(daemons))
    subject = S.trust_audit(evidence.TRUST_ID)
    chain = [(seq, body) for seq, subj, body in log_ if subj == subject]
    if chain and audit.verify_chain(evidence.TRUST_ID, [b for _, b in chain], trust,
                                    [seq for seq, _ in chain]) is None:
        trust = dataclasses.replace(trust, history=evidence.history_of(chain, fallback))
    return trust


def _verify_chains(chains: dict[tuple[str | None, str | None], list[tuple[int, dict[str, Any]]]],
                   trust: evidence.ChainTrust, trailers: int) -> int:
    """Both passes over every chain, timed apart: hashes, links and the lifecycle (no status
    change OMS forbids), then who wrote each
    trailer and the signed act under each authority trailer. Prints the breaks and the rates;
    returns how many chains are broken."""
    broken = 0
    started = time.perf_counter()
    linked = {}
    for key, entries in sorted(chains.items(), key=lambda kv: str(kv[0])):
        linked[key] = audit.verify_chain(key[1] or "", [body for _, body in entries],
                                         service=None if key[0] in S.MESH_CHAINS else key[0])
    links_s = time.perf_counter() - started
    started = time.perf_counter()
    for key, entries in sorted(chains.items(), key=lambda kv: str(kv[0])):
        brk = linked[key] or audit.verify_writers(key[1] or "", [b for _, b in entries], trust,
                                                  [seq for seq, _ in entries])
        problem = str(brk) if brk is not None else _index_refs_problem(key, entries)
        if problem is not None:
            broken += 1
            print(f"BROKEN {problem}")
    sigs_s = time.perf_counter() - started
    print(f"{len(chains) - broken}/{len(chains)} chains {_HELD[trust.anchored]}, "
          f"{trailers} trailers"
          + (f", {broken} broken" if broken else ""))
    print(f"hashes and links: {_rate(trailers, links_s)}; daemon signatures and signed acts: "
          f"{_rate(trailers, sigs_s)}")
    return broken


def _index_refs_problem(key: tuple[str | None, str | None],
                        entries: list[tuple[int, dict[str, Any]]]) -> str | None:
    """Whether a proposal's chain says rightly which indexes each trailer moved it in or out
    of (`index:` refs, what the checkpoints count): its replay, trailer by trailer, decides."""
    from improved.client.chain_writer import decode_trailer
    from improved.core import indexes
    from improved.core.policy import Policy
    from improved.core.propose import rebuild_record
    from improved.core.record import replay

    if key[0] in S.MESH_CHAINS:
        return None
    try:
        trailers = [decode_trailer(body) for _, body in entries]
        records = [rebuild_record(trailers[:1], [entries[0][0]], Policy())]
        for trailer, (seq, _) in zip(trailers[1:], entries[1:], strict=True):
            records.append(replay(records[-1], [trailer], [seq]))
    except (ValueError, KeyError, msgspec.MsgspecError):
        return None  # not replayable: `audit rebuild` names it
    problem = indexes.refs_problem(records, [t.refs for t in trailers])
    return f"{key[1]} {problem}" if problem is not None else None


def _rate(n: int, seconds: float) -> str:
    return f"{n} trailers in {seconds:.2f} s ({n / seconds:,.0f}/s)" if seconds > 0 else \
        f"{n} trailers"


def trusted_daemons(config: Config) -> set[str]:
    """Daemon keys this verifier trusts: `[trust] daemons`, and the checkpoint key of the
    daemon whose data directory (or `checkpoint_key`) the configuration names, if present."""
    own = own_anchor(config)
    return set(configured_anchors(config)) | ({own[0]} if own else set())


def configured_anchors(config: Config) -> dict[str, str]:
    """The daemon keys `[trust] daemons` names, each with where it was found."""
    from improved.core.signing import TrustStore

    return {kid: f'[trust] daemons "{key.principal}"'
            for kid, key in TrustStore.from_config(config.trust.daemons).keys.items()}


def own_anchor(config: Config) -> tuple[str, str] | None:
    """(key id, where) of the checkpoint key of the daemon whose data directory (or
    `checkpoint_key`) the configuration names, when there is one to read."""
    from improved.client.keys import load_key
    from improved.core import signing

    own = config.checkpoint_key or config.data_dir / "checkpoint.pem"
    if own.exists():
        with suppress(OSError, ValueError):
            kid = signing.keyid_of(signing.raw_public(load_key(own).public_key()))
            return kid, f"the checkpoint key {own}"
    return None


def cmd_audit_verify(args: argparse.Namespace) -> int:
    from improved.client import anchor

    config = config_of(args)
    explicit = bool(args.checkpoint)
    path: Path | None = (Path(args.checkpoint) if args.checkpoint
                         else anchor.path_in(config.data_dir))
    if not args.checkpoint and path is not None and not path.exists():
        path = None
    if args.since:
        if args.id:
            print("improved audit verify: --since verifies the whole log's new part; "
                  "leave out the ID", file=sys.stderr)
            return 2
        return asyncio.run(_verify_since(url_of(args, config), path, explicit, config))
    if args.archive and args.id:
        print("improved audit verify: --archive verifies the whole log; leave out the ID",
              file=sys.stderr)
        return 2
    if args.archive:
        return asyncio.run(_verify_archived(url_of(args, config), path, explicit, config,
                                            Path(args.archive)))
    pid = asyncio.run(full_id(url_of(args, config), args.id)) if args.id else None
    return asyncio.run(_verify(url_of(args, config), pid, path, explicit, config))


async def _verify_archived(url: str | Target, anchor_path: Path | None, explicit: bool,
                           config: Config, archive_dir: Path | None,
                           say: Callable[[str], None] = print,
                           note: Callable[[str], None] = _to_stderr) -> int:
    return await _verify_log(url, _read_kept(anchor_path), anchor_path, explicit, config,
                             archive_dir, say, note)


def verify_log(url: str | Target, config: Config, say: Callable[[str], None],
               note: Callable[[str], None]) -> Coroutine[Any, Any, int]:
    """`improved audit verify` of the whole log, as the command runs it without arguments
    (against the daemon's checkpoint file in the configured data directory when there is
    one), its lines said with `say` and `note`; its exit code."""
    from improved.client import anchor

    path: Path | None = anchor.path_in(config.data_dir)
    if path is not None and not path.exists():
        path = None
    return _verify_archived(url, path, False, config, None, say, note)


def verify_since(url: str | Target, config: Config, say: Callable[[str], None],
                 note: Callable[[str], None]) -> Coroutine[Any, Any, int]:
    """`improved audit verify --since`, as the command runs it (from the later of the
    daemon's checkpoint file in the configured data directory and the last trusted
    checkpoint on the stream), its lines said with `say` and `note`; its exit code."""
    from improved.client import anchor

    path: Path | None = anchor.path_in(config.data_dir)
    if path is not None and not path.exists():
        path = None
    return _verify_since(url, path, False, config, say, note)


async def _archive(url: str | Target, config: Config, directory: Path, remove: bool) -> int:
    """Export every sealed epoch to `directory` (checked against its seal), and with `remove`
    purge the exported proposal chains from the stream."""
    from nats.js.errors import APIError

    from improved.client.archive import epoch_file, read_seals
    from improved.client.archiving import export as export_epoch
    from improved.client.archiving import remove as remove_epoch

    trusted = trusted_daemons(config)
    async with deployment(url, bind=False) as store:
        subject = S.trust_audit(evidence.TRUST_ID)
        trust = chain_trust([(seq, subject, body) for seq, body
                             in await store.read_chain_at(subject)], trusted, config)
        seals, problem = await read_seals(store, trust, trusted)
        if problem:
            print(f"improved audit archive: {problem}; nothing exported", file=sys.stderr)
            return 1
        if not seals:
            print("no sealed epoch yet: the daemon seals one after a checkpoint once the log "
                  "since the last seal holds [audit] epoch_trailers or is epoch_hours old")
            return 0
        prev = None
        for seal, body in seals:
            try:
                done = await export_epoch(store, directory, seal, prev, body)
            except ValueError as exc:
                print(f"improved audit archive: {exc}", file=sys.stderr)
                return 1
            except OSError as exc:
                print(f"improved audit archive: cannot write to {directory}: "
                      f"{exc.strerror or exc}", file=sys.stderr)
                return 1
            where = epoch_file(directory, seal.epoch)
            print(f"epoch {seal.epoch}: {done.trailers} trailers up to stream sequence "
                  f"{seal.upto} {'exported to' if done.written else 'already in'} {where}, "
                  "checked against its seal")
            if remove:
                try:
                    removed = await remove_epoch(store, seal, done.services)
                except APIError as exc:
                    print(f"improved audit archive: the stream refused the purge ({exc.description}"
                          "): an audit stream created before epochs could be archived denies "
                          "purges for good; its epochs stay exported and in the stream",
                          file=sys.stderr)
                    return 1
                print(f"epoch {seal.epoch}: {removed} trailers of its proposal chains removed "
                      "from the stream")
            prev = seal
        return 0


def cmd_audit_archive(args: argparse.Namespace) -> int:
    config = config_of(args)
    return asyncio.run(_archive(url_of(args, config), config, Path(args.directory),
                                args.remove))


async def _rebuild(url: str | Target, config: Config, write: bool) -> int:
    """Every proposal's record rebuilt from its chain alone and compared with the ProposalState
    its retained records hold; with `write`, the retained records of those that differ or are
    missing published again as the chain says them (`core.retained`)."""
    from improved.core.propose import rebuild_record

    now = int(time.time() * 1000)
    ttl_s = int(config.records_ttl_days * 86400)
    async with deployment(url, bind=False) as store:
        chains = await store.sequenced_chains()
        decoder = msgspec.json.Decoder(Trailer)
        counts = {"equal": 0, "differ": 0, "missing": 0, "broken": 0, "foreign": 0}
        for (svc, pid), entries in sorted(chains.items()):
            if svc in S.MESH_CHAINS:
                continue
            bodies = [body for _, body in entries]
            if audit.verify_chain(pid, bodies, service=svc) is not None:
                counts["broken"] += 1
                print(f"BROKEN {pid}: not rebuilt (run `improved audit verify {pid}`)")
                continue
            trailers = [decoder.decode(msgspec.json.encode(b)) for b in bodies]
            try:
                rebuilt = rebuild_record(trailers, [seq for seq, _ in entries], config.policy)
            except (ValueError, KeyError, msgspec.MsgspecError) as exc:
                # it verifies, but no registration of this daemon's starts it
                counts["foreign"] += 1
                print(f"NOT REBUILDABLE {pid}: {exc}")
                continue
            verdict = await _compared(store, rebuilt, now)
            counts[verdict] += 1
            if write and verdict != "equal":
                await _republished(store, rebuilt, now, ttl_s)
        equal, differ, missing = counts["equal"], counts["differ"], counts["missing"]
        print(f"{equal + differ + missing} proposals rebuilt from their chains alone: "
              f"{equal} equal to the retained records, {differ} differ, {missing} not published"
              + (f", {counts['broken']} chains broken" if counts["broken"] else "")
              + (f", {counts['foreign']} chains not rebuildable" if counts["foreign"] else "")
              + ("; retained records republished" if write and (differ or missing) else ""))
        return 1 if counts["broken"] or counts["foreign"] or (differ and not write) else 0


async def _compared(store: Deployment, record: ProposalRecord, now: int) -> str:
    """How the ProposalState retained for `record`'s proposal compares with those the record
    may show (`retained.states`): equal, missing (none), or differ (said in one line)."""
    data = await store.last(S.proposal_state(record.service, record.proposal_id))
    if not data:
        return "missing"
    try:
        state = msgspec.json.decode(data, type=ProposalState)
    except msgspec.MsgspecError:
        print(f"DIFFERS {record.proposal_id}: the retained state is no ProposalState")
        return "differ"
    if state in retained.states(record, now):
        return "equal"
    print(f"DIFFERS {record.proposal_id}: the retained records say {state.status}/{state.stage}"
          f", the chain says {status_at(record, now)}/{record.stage}")
    return "differ"


async def _republished(store: Deployment, record: ProposalRecord, now: int, ttl_s: int) -> None:
    """Publish the retained records `record` shows, as the daemon does (`core.retained`)."""
    ttl = retained.ttl_of(record, ttl_s)
    for subject, shown in retained.shown(record, now):
        await store.js.publish(subject, to_json(shown), stream=S.STREAM_RECORDS, msg_ttl=ttl)


def cmd_audit_rebuild(args: argparse.Namespace) -> int:
    config = config_of(args)
    return asyncio.run(_rebuild(url_of(args, config), config, args.write))


async def _export_oms(url: str | Target, directory: Path) -> int:
    """Every chain that verifies written to `directory` as OMS grains (`client.oms_export`)."""
    from improved.client import oms_export

    async with deployment(url, bind=False) as store:
        try:
            done = await oms_export.export(store, directory)
        except OSError as exc:
            print(f"improved audit export: cannot write to {directory}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 2
    for line in done.left_out:
        print(line)
    print(f"{done.chains} chains exported to {directory} as {done.grains} OMS grains "
          f"(<content address>{oms_export.SUFFIX}, listed in {oms_export.MANIFEST})"
          + (f"; {len(done.left_out)} chains left out" if done.left_out else ""))
    return 1 if done.left_out else 0


def cmd_audit_export(args: argparse.Namespace) -> int:
    config = config_of(args)
    return asyncio.run(_export_oms(url_of(args, config), Path(args.oms)))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `audit` commands to the `improved` parser."""
    aud = sub.add_parser("audit", help="verify the audit chains",
                         description="Audit chain tools.")
    aud_sub = aud.add_subparsers(dest="audit_command", required=True, metavar="ACTION")
    verify = aud_sub.add_parser(
        "verify", help="re-derive every hash and link; name the first break",
        description="Read every audit chain (or one proposal's) from the broker, re-derive "
                    "each trailer's hash and its link to the previous one, and print the first "
                    "break of each broken chain. The whole log is checked against the last "
                    "checkpoint on the stream (signed by a trusted daemon key: [trust] "
                    "daemons, or the checkpoint key in the configured data directory) and "
                    "against the checkpoint file a daemon keeps in its data directory: a "
                    "missing, re-created, shorter, rewritten or unreadable stream is named. "
                    "The last line says what was checked against which daemon key. Exits 0 "
                    "VERIFIED, 1 BROKEN (something forged, altered or missing), 2 when it "
                    "cannot run as given, 3 UNVERIFIED writers: nothing wrong was found, but "
                    "with no trusted daemon key who wrote the trailers was not checked.")
    add_connection_args(verify)
    verify.add_argument("id", metavar="ID", nargs="?", type=ids.chain_arg,
                        help="only this proposal's chain (its id, or a unique prefix of it), "
                             "or one tool runtime's (its chain id, or runtime:NAME)")
    verify.add_argument("--checkpoint", metavar="FILE",
                        help="the last checkpoint a daemon kept outside the stream, to verify "
                             "against (default: <data_dir>/last-checkpoint.json when present)")
    verify.add_argument("--since", action="store_true",
                        help="verify only what was appended since the last trusted checkpoint "
                             "(the file's or the stream's), checking in O(1) that the stream "
                             "still holds what it covered, and the tool runtimes' trailers "
                             "stored since; without it, everything is re-derived from the "
                             "first trailer")
    verify.add_argument("--archive", metavar="DIR",
                        help="read the sealed epochs exported to DIR (`improved audit "
                             "archive`), check each exactly against its seal, and verify "
                             "them with the rest of the log")
    verify.set_defaults(func=cmd_audit_verify)
    arch = aud_sub.add_parser(
        "archive", help="export sealed epochs to files; with --remove, drop them from the stream",
        description="Export every epoch the daemon sealed ([audit] epoch_trailers / "
                    "epoch_hours) to DIR: epoch-NNNNNN.jsonl, one trailer per line with its "
                    "stream sequence, subject and headers, and epoch-NNNNNN.seal.json, the "
                    "signed seal. Each export is checked exactly against its seal (every trailer "
                    "once and in order, its hash, the Merkle root) before it is kept; an epoch "
                    "already in DIR is checked, not written again. With "
                    "--remove (as improved-archivist) the exported epochs' proposal chains are "
                    "then purged from the audit stream; the mesh chains stay. Keep DIR: "
                    "`improved audit verify --archive DIR` verifies the log across epochs.")
    add_connection_args(arch)
    arch.add_argument("directory", metavar="DIR", help="where the epochs are exported")
    arch.add_argument("--remove", action="store_true",
                      help="purge the exported proposal chains from the audit stream")
    # reads the audit stream and, with --remove, purges it: the archivist may
    arch.set_defaults(func=cmd_audit_archive, as_user=credentials.ARCHIVIST)
    rebuild = aud_sub.add_parser(
        "rebuild", help="rebuild every proposal's state from the chains alone",
        description="Replay every proposal's audit chain (its first trailer carries the "
                    "proposal) into a record and compare it with what its retained records "
                    "say (its ProposalState on the records stream). Status is derived from "
                    "the chain only, so the two must be equal; differences are listed. With "
                    "--write the retained records of the proposals that differ or were not "
                    "published are published again as the chains say them. Exits 1 on a "
                    "broken chain, or on a difference without --write.")
    add_connection_args(rebuild)
    rebuild.add_argument("--write", action="store_true",
                         help="republish the retained records that differ (or are missing)")
    # --write publishes retained records, which only the daemon's user may
    rebuild.set_defaults(func=cmd_audit_rebuild, as_user=credentials.DAEMON)
    _register_export(aud_sub)


def _register_export(aud_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `improved audit export --oms DIR`."""
    export = aud_sub.add_parser(
        "export", help="write the audit chains as OMS grains an OMS tool can read",
        description="Write every audit chain whose hashes and links re-derive to DIR as OMS "
                    "grains: a proposal's Recommendation grain, then one audit Observation "
                    "grain per trailer (observer_id, observer_type, the reason as object, "
                    "derived_from the recommendation and the grain before; the trailer's other "
                    "fields in context), each <content address>.mg in the OMS canonical "
                    "encoding, and chains.json naming each chain's grains in order "
                    "(docs/protocol.md, Audit trailers as OMS Observation grains). A broken "
                    "chain is named and left out (exit 1); who wrote the trailers is `audit "
                    "verify`'s to check.")
    add_connection_args(export)
    export.add_argument("--oms", metavar="DIR", required=True,
                        help="the directory the grains are written to (made if missing)")
    export.set_defaults(func=cmd_audit_export)
