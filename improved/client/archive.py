"""Reading sealed epochs, as an auditor does: the I/O around core.epochs on the reading side.

The seal chain read and checked (`read_seals`, `last_seal`); an epoch exported to files
(`improved audit archive DIR`: every message of the epoch — one trailer, or a commit of
several — one JSON line each with its stream sequence, subject and headers, and the seal
beside it) checked exactly against its seal
(`epochs.EpochCheck`: `check_file`), and the whole log read from the exports and the stream
(`ArchiveRead`, `audit verify --archive`). Sealing, exporting and removing are the daemon's and
the operator's (`runtime.archive`), on these same reads.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from improved.client.audit_log import Entry
from improved.client.deployment import Deployment
from improved.core import audit, epochs
from improved.core.epochs import Seal
from improved.protocol import subjects as S

SEAL_SUBJECT = S.checkpoint_audit(epochs.SEAL_ID)


async def read_seals(store: Deployment, trust: audit.Authenticity | None, trusted: set[str]
                     ) -> tuple[list[tuple[Seal, dict[str, Any]]], str | None]:
    """Every seal on the stream with its trailer, oldest first, and why the seal chain does
    not hold (a broken link, a trailer no trusted daemon wrote, a seal that does not verify),
    if it does not."""
    chain = await store.read_chain_at(SEAL_SUBJECT)
    if not chain:
        return [], None
    brk = audit.verify_chain(epochs.SEAL_ID, [b for _, b in chain], trust,
                             [s for s, _ in chain])
    if brk is not None:
        return [], f"the seal chain: {brk}"
    seals = []
    for _, body in chain:
        try:
            seal = epochs.from_trailer(body)
        except (KeyError, ValueError) as exc:
            return [], f"a seal cannot be read: {exc}"
        problem = epochs.problem(seal, trusted)
        if problem:
            return [], problem
        seals.append((seal, body))
    return seals, None


async def last_seal(store: Deployment, trusted: set[str]) -> tuple[Seal | None, str | None]:
    """The last seal on the stream, in O(1), and why it does not count, if it does not."""
    _, body = await store.chain_head(SEAL_SUBJECT)
    if body is None:
        return None, None
    try:
        seal = epochs.from_trailer(body)
    except (KeyError, ValueError) as exc:
        return None, f"the last seal cannot be read: {exc}"
    return seal, epochs.problem(seal, trusted)


# -- the exported files ---------------------------------------------------------------------------


def epoch_file(directory: Path, epoch: int) -> Path:
    return directory / f"epoch-{epoch:06d}.jsonl"


def seal_file(directory: Path, epoch: int) -> Path:
    return directory / f"epoch-{epoch:06d}.seal.json"


def check_file(path: Path, seal: Seal, prev: Seal | None) -> tuple[set[str], int]:
    """(the services whose chains epoch file `path` holds, the trailers it holds) if it is
    exactly what `seal` signed (`epochs.EpochCheck`); ValueError naming what is not."""
    check = epochs.EpochCheck(seal, prev)
    services: set[str] = set()
    trailers = 0
    for number, entry, why in read_file(path):
        if entry is None:
            check.bad_line(number, why)
            continue
        seq, subject, body, _ = entry
        check.feed(seq, subject, body)
        trailers += len(audit.trailers_in(body))
        if epochs.is_proposal_chain(subject):
            services.add(S.token(subject, 2) or "")
    problem = check.problem()
    if problem:
        raise ValueError(f"epoch {seal.epoch}: {path} does not match its seal: {problem}")
    return services, trailers


def each_trailer(entry: Entry) -> Iterator[Entry]:
    """The entries of the trailers one exported or streamed message carries, as `follow`
    gives them: a commit's several (`audit.trailers_in`), each with the message's sequence."""
    seq, subject, body, headers = entry
    for trailer in audit.trailers_in(body) if body is not None else [None]:
        yield seq, subject, trailer if isinstance(trailer, dict) else None, headers


def read_file(path: Path) -> Iterator[tuple[int, Entry | None, str]]:
    """(line number, (stream sequence, subject, body, headers), "") for each line of an epoch
    file — one message of the stream, one trailer or a commit of several — one at a time;
    (line number, None, why) for a line that is no exported message. OSError when the file
    cannot be read."""
    with path.open(errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            try:
                entry = json.loads(line)
                body, headers = entry["body"], entry.get("headers") or {}
                if not isinstance(body, dict) or not isinstance(headers, dict):
                    raise TypeError("its body or headers are no object")
                item = (int(entry["seq"]), str(entry["subject"]), body, headers)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                yield number, None, f"{type(exc).__name__}: {exc}"[:200]
                continue
            yield number, item, ""


def seal_problem(path: Path, seal_body: dict[str, Any]) -> str | None:
    """What is wrong with the seal file `path` of an exported epoch, against the seal trailer
    on the stream: "missing", or why it is not that trailer; None when it is."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"its seal {path} cannot be read ({exc.strerror or exc})"
    try:
        kept = json.loads(text)
    except ValueError:
        return f"its seal {path} is not JSON"
    if kept != seal_body:
        return f"its seal {path} is not the seal on the stream"
    return None


@dataclass
class _Planned:
    seal: Seal
    prev: Seal | None
    data: Path | None  # its export, when the directory holds it; else the stream is read
    exported: bool  # the directory says it was exported (a file of it or of a later epoch)
    said: list[str]  # what is already wrong with its files


class ArchiveRead:
    """The log as `audit verify --archive DIR` reads it: each sealed epoch from its export in
    DIR, or from the stream when DIR holds none, every one checked exactly against its seal as
    it streams by (`epochs.EpochCheck`); then the rest of the stream. An epoch DIR has a file
    of, or a later epoch's, was exported (`improved audit archive` exports them in order), so
    both its files must be there. What does not match is named in `problems`, one line per
    epoch, as the read passes it. Memory is one epoch check at a time."""

    def __init__(self, directory: Path, seals: list[tuple[Seal, dict[str, Any]]]):
        self.directory = directory
        self.found = directory.is_dir()
        self.seals = [seal for seal, _ in seals]
        self.problems: list[str] = []
        self.from_export: list[int] = []
        self.from_stream: list[int] = []
        self._plan = self._survey(seals)

    def _survey(self, seals: list[tuple[Seal, dict[str, Any]]]) -> list[_Planned]:
        """Which file of each epoch the directory holds (two stats per epoch), and whether its
        seal file is the stream's seal."""
        plan: list[_Planned] = []
        later = False
        beyond = len(seals) + 1
        if epoch_file(self.directory, beyond).exists() or \
                seal_file(self.directory, beyond).exists():
            self.problems.append(f"epoch {beyond}: {self.directory} holds an export of it, but "
                                 "the stream holds no seal of it: seals were removed")
            later = True
        for index in range(len(seals) - 1, -1, -1):
            seal, body = seals[index]
            prev = seals[index - 1][0] if index else None
            data, sealed = epoch_file(self.directory, seal.epoch), seal_file(self.directory,
                                                                              seal.epoch)
            has_data = data.exists()
            kept = seal_problem(sealed, body)
            exported = later or has_data or kept != "missing"
            said = []
            if exported and kept == "missing":
                said.append(f"its seal {sealed} is missing")
            elif exported and kept:
                said.append(kept)
            if exported and not has_data:
                said.append(f"its export {data} is missing")
            plan.append(_Planned(seal, prev, data if has_data else None, exported, said))
            later = exported
        return plan[::-1]

    async def entries(self, store: Deployment, last_seq: int) -> AsyncIterator[Entry]:
        """Every trailer, as `Store.follow` gives the stream's: the sealed epochs, then the
        stream after the last seal up to `last_seq`."""
        for planned in self._plan:
            check = epochs.EpochCheck(planned.seal, planned.prev)
            said = list(planned.said)
            if planned.data is not None:
                self.from_export.append(planned.seal.epoch)
                try:
                    for number, entry, why in read_file(planned.data):
                        if entry is None:
                            check.bad_line(number, why)
                            continue
                        check.feed(entry[0], entry[1], entry[2])
                        for each in each_trailer(entry):
                            yield each
                    where: str | None = f"{planned.data}"
                except OSError as exc:
                    said.append(f"{planned.data} cannot be read ({exc.strerror or exc})")
                    where = None
            else:
                self.from_stream.append(planned.seal.epoch)
                async for entry in store.follow_messages(S.AUDIT_FILTER, check.first,
                                                         planned.seal.upto):
                    check.feed(entry[0], entry[1], entry[2])
                    for each in each_trailer(entry):
                        yield each
                where = "the stream, read instead," if planned.exported else \
                    f"not exported to {self.directory}; the stream"
            problem = check.problem() if where else None
            if problem:
                said.append(f"{where} does not match its seal: {problem}")
            if said:
                self.problems.append(f"epoch {planned.seal.epoch}: " + "; ".join(said))
        after = self.seals[-1].upto + 1 if self.seals else 1
        async for entry in store.follow(S.AUDIT_FILTER, after, last_seq):
            yield entry
