"""`improved`: the daemon and the operator's terminal.

    improved run [--nats URL] [--config FILE] [--data-dir DIR] [--port N]
    improved propose FILE|-
    improved show ID
    improved audit verify [ID]
    improved keys new --principal operator:NAME
    improved review
    improved approve|reject ID --reason …
    improved grant|revoke NAME:SHA256 --reason …
    improved revert ID
    improved vote ID approve|dissent --session S --read …
    improved conformance SERVICE
    improved tools list|grant RUNTIME …
    improved skill hash FILE
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import msgspec
import structlog
from nats.js.errors import BucketNotFoundError, NotFoundError

from improved.core import audit, authority, signing
from improved.core.policy import Policy
from improved.protocol import canonical
from improved.protocol import subjects as S
from improved.protocol.model import Actor, CrisisAct, GrantCommand, Review, Trailer, Vote, to_json
from improved.runtime import bus, keys
from improved.runtime.config import Config, ConfigError, load
from improved.runtime.store import Store, StoreError

DEFAULT_URL = "nats://127.0.0.1:4222"


def configure_logging(level: str, json_logs: bool | None = None) -> None:
    """JSON lines, or a console renderer when attached to a terminal."""
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    renderer = (structlog.processors.JSONRenderer() if json_logs
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def _config(args: argparse.Namespace) -> Config:
    return load(getattr(args, "config", None))


def _url(args: argparse.Namespace, config: Config) -> str:
    return args.nats or config.nats_url or DEFAULT_URL


def out(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


# -- run -----------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from msgspec.structs import replace

    from improved.runtime.daemon import run_until_stopped, stop_on_signals

    config = _config(args)
    if args.data_dir:
        config = replace(config, data_dir=Path(args.data_dir))
    if args.port:
        config = replace(config, port=args.port)
    if args.metrics_port is not None:
        config = replace(config, metrics_port=args.metrics_port)
    url = args.nats or config.nats_url
    server = None
    if url is None:
        server = bus.EmbeddedServer(config.data_dir, config.port, config.sync)
        url = server.start()
        print(f"improved: embedded nats-server (JetStream, sync={config.sync}) listening on "
              f"{url}; store {config.data_dir.resolve() / 'jetstream'}", file=sys.stderr,
              flush=True)

    async def main() -> int:
        stop = stop_on_signals()
        nc = await bus.connect(url, "improved")
        return await run_until_stopped(
            nc, config, stop=stop,
            on_ready=lambda d: print(f"improved: ready as {d.actor} on {url}",
                                     file=sys.stderr, flush=True))

    try:
        return asyncio.run(main())
    finally:
        if server is not None:
            server.stop()


# -- client commands ------------------------------------------------------------------------------


@asynccontextmanager
async def deployment(url: str, bind: bool = True) -> AsyncIterator[Store]:
    """A one-shot connection to a running deployment, its buckets bound (nothing created)."""
    nc = await bus.connect(url, "improved-cli", persistent=False)
    try:
        store = Store(nc)
        if bind:
            await store.bind()
        yield store
    finally:
        await bus.close(nc)


async def _request(url: str, subject: str, body: bytes, timeout: float) -> dict[str, Any]:
    async with deployment(url, bind=False) as store:
        reply = await store.nc.request(subject, body, timeout=timeout)
        return msgspec.json.decode(reply.data)


def cmd_propose(args: argparse.Namespace) -> int:
    config = _config(args)
    data = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    try:
        svc = msgspec.json.decode(data).get("service")
    except (msgspec.DecodeError, AttributeError):
        print("improved propose: the file is not a JSON object", file=sys.stderr)
        return 2
    if not isinstance(svc, str) or not S.SERVICE_RE.match(svc):
        print("improved propose: the proposal needs a valid `service`", file=sys.stderr)
        return 2
    reply = asyncio.run(_request(_url(args, config), S.propose_request(svc), data, args.timeout))
    out(reply)
    return 1 if "error" in reply else 0


async def _find(store: Store, pid: str) -> tuple[str, str] | None:
    """(service, id) of a proposal, from its audit chain's subject: one stream-info request
    instead of listing every key of the state bucket."""
    if not S.ID_RE.match(pid):
        return None
    svc = await store.service_of(pid)
    return (svc, pid) if svc is not None else None


async def _show(url: str, pid: str) -> int:
    async with deployment(url) as store:
        found = await _find(store, pid)
        if found is None:
            print(f"improved show: no proposal {pid}", file=sys.stderr)
            return 1
        svc, pid = found
        view: dict[str, Any] = {}
        for name, subject in (("state", S.proposal_state(svc, pid)),
                              ("decision", S.triage_decision(svc, pid)),
                              ("outcome", S.apply_outcome(svc, pid)),
                              ("learn_back", S.learn_back(svc, pid)),
                              ("quorum", S.quorum_record(pid))):
            data = await store.last(subject)
            view[name] = msgspec.json.decode(data) if data else None
        chain = [body for _, body in await store.read_chain(svc, pid)]
        view["trailers"] = chain
        brk = audit.verify_chain(pid, chain)
        view["chain"] = "verified" if brk is None else f"BROKEN: {brk}"
        out(view)
        return 0


def cmd_show(args: argparse.Namespace) -> int:
    return asyncio.run(_show(_url(args, _config(args)), args.id))


async def _verify(url: str, pid: str | None) -> int:
    from improved.core import checkpoint

    async with deployment(url, bind=False) as store:
        log_ = await store.audit_log(pid)
        chains: dict[tuple[str, str], list[dict]] = {}
        for _, subject, body in log_:
            chains.setdefault((S.token(subject, 2), S.token(subject, 3)), []).append(body)
        broken = 0
        for (_, cpid), bodies in sorted(chains.items()):
            brk = audit.verify_chain(cpid, bodies)
            if brk is not None:
                broken += 1
                print(f"BROKEN {brk}")
        if pid is not None and not chains:
            print(f"improved audit verify: no chain for {pid}", file=sys.stderr)
            return 1
        print(f"{len(chains) - broken}/{len(chains)} chains verified, {len(log_)} trailers"
              + (f", {broken} broken" if broken else ""))
        if pid is None:  # whole chains can only go missing against a checkpoint
            cp_subject = S.checkpoint_audit(checkpoint.CHECKPOINT_ID)
            cps = [body for _, subject, body in log_ if subject == cp_subject]
            if cps:
                cp = checkpoint.from_trailer(cps[-1])
                hashes = [b.get("hash", "") for _, subject, b in log_ if subject != cp_subject]
                problem = checkpoint.check(hashes, cp)
                if problem is not None:
                    broken += 1
                    print(f"BROKEN {problem}")
                else:
                    print(f"checkpoint of {cp.count} trailers (signed by {cp.keyid[:20]}…) "
                          "holds: nothing it covered was removed, altered or reordered")
        return 1 if broken else 0


def cmd_audit_verify(args: argparse.Namespace) -> int:
    return asyncio.run(_verify(_url(args, _config(args)), args.id))


async def _rebuild(url: str, config: Config, write: bool) -> int:
    from improved.core.propose import rebuild_record

    async with deployment(url) as store:
        chains = await store.all_chains()
        decoder = msgspec.json.Decoder(Trailer)
        equal = differ = uncached = broken = foreign = 0
        for (svc, pid), bodies in sorted(chains.items()):
            if svc in S.MESH_CHAINS:
                continue
            if audit.verify_chain(pid, bodies) is not None:
                broken += 1
                print(f"BROKEN {pid}: not rebuilt (run `improved audit verify {pid}`)")
                continue
            trailers = [decoder.decode(msgspec.json.encode(b)) for b in bodies]
            cached, rev = await store.load(svc, pid)
            seqs = [cached.chain.stream_seq if cached else 0] * len(trailers)
            try:
                rebuilt = rebuild_record(trailers, seqs, config.policy)
            except (ValueError, KeyError, msgspec.MsgspecError) as exc:
                foreign += 1  # it verifies, but no registration of this daemon's starts it
                print(f"NOT REBUILDABLE {pid}: {exc}")
                continue
            if cached is None:
                uncached += 1
            elif same_state(rebuilt, cached):
                equal += 1
                continue
            else:
                differ += 1
                print(f"DIFFERS {pid}: cache says {cached.status}/{cached.stage}, "
                      f"the chain says {rebuilt.status}/{rebuilt.stage}")
            if write:
                real = [seq for seq, _ in await store.read_chain(svc, pid)]
                await store.save(rebuild_record(trailers, real, config.policy), rev)
        print(f"{equal + differ + uncached} proposals rebuilt from their chains alone: "
              f"{equal} equal to the cached state, {differ} differ, {uncached} not cached"
              + (f", {broken} chains broken" if broken else "")
              + (f", {foreign} chains not rebuildable" if foreign else "")
              + ("; cache rewritten" if write and (differ or uncached) else ""))
        return 1 if broken or foreign or (differ and not write) else 0


def same_state(a, b) -> bool:
    """Equal in everything the chain decides (the chain head's stream sequence aside)."""
    return a.replace(chain=b.chain, updated_at=b.updated_at) == b


def cmd_audit_rebuild(args: argparse.Namespace) -> int:
    config = _config(args)
    return asyncio.run(_rebuild(_url(args, config), config, args.write))


async def _status(url: str) -> dict[str, Any]:
    from improved.core import breaker

    async with deployment(url, bind=False) as store:
        _, body = await store.chain_head(S.autonomy_audit(breaker.AUTONOMY_ID))
        state = breaker.from_trailer(body)
        now = int(time.time() * 1000)
        records = await store.js.stream_info(S.STREAM_RECORDS)
        chains = await store.js.stream_info(S.STREAM_AUDIT)
        return {
            "autonomy": state.switch,
            "breaker": ("open until " + _when(state.paused_until)
                        if state.blocks(now) == "circuit_open" else "closed"),
            "autonomous_rollbacks_in_window": len(state.rollbacks),
            "holds_autonomous_applies": state.blocks(now),
            "crisis": state.crisis or None,  # while set, no apply at all (resolve it, signed)
            "trailers": chains.state.messages,
            "retained_records": records.state.messages,
        }


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


def cmd_status(args: argparse.Namespace) -> int:
    out(asyncio.run(_status(_url(args, _config(args)))))
    return 0


def reference_command(name: str):
    """`demo` and `bench` live with the reference services they run (improved_reference);
    they are found through the `improved.commands` entry points, so nothing in `improved`
    imports them."""
    for ep in entry_points(group="improved.commands"):
        if ep.name == name:
            return ep.load()
    raise SystemExit(f"improved {name}: the reference package is not installed "
                     "(pip install improved)")


def cmd_demo(args: argparse.Namespace) -> int:
    argv = ["--pace", str(args.pace)] + (["--data-dir", args.data_dir] if args.data_dir else [])
    return reference_command("demo")(argv)


# -- operator authority ------------------------------------------------------------------------


def cmd_keys_new(args: argparse.Namespace) -> int:
    """An operator key ([trust.operators]) or a quorum voter key ([trust.quorum])."""
    if args.voter:
        who, table = args.voter, "trust.quorum"
        try:
            msgspec.convert(who, type=Actor)
        except msgspec.ValidationError:
            print("improved keys new: a voter is an actor id, e.g. agent-review-a",
                  file=sys.stderr)
            return 2
        filename = "voter:" + who
    else:
        who, table = args.principal, "trust.operators"
        if not who or not who.startswith("operator:") or len(who) <= len("operator:"):
            print("improved keys new: the principal is operator:NAME (or --voter NAME)",
                  file=sys.stderr)
            return 2
        filename = who
    try:
        path, public = keys.new_key(filename, Path(args.dir) if args.dir else None)
    except FileExistsError as exc:
        print(f"improved keys new: {exc}", file=sys.stderr)
        return 1
    b64 = base64.b64encode(public).decode()
    print(f"private key: {path} (keep it; mode 0600)")
    print(f"keyid:       {signing.keyid_of(public)}")
    print("add to the daemon's config to trust it:\n")
    print(f'[{table}]\n"{who}" = "{b64}"')
    return 0


def _signer(args: argparse.Namespace) -> tuple[str, Any]:
    """(principal, private key) from --key, or from --principal's file in the key directory."""
    if args.key:
        key = keys.load_key(Path(args.key))
        principal = args.principal or Path(args.key).stem.replace("_", ":", 1)
        return principal, key
    principal = args.principal or os.environ.get("IMPROVED_PRINCIPAL")
    if not principal:
        found = sorted(keys.key_dir().glob("operator_*.pem"))
        if len(found) != 1:
            raise SystemExit("improved: say who signs: --principal operator:NAME or --key FILE")
        principal = found[0].stem.replace("_", ":", 1)
    return principal, keys.load_key(keys.key_path(principal))


async def _publish_act(url: str, subject: str, env) -> None:
    async with deployment(url, bind=False) as store:
        await store.js.publish(subject, to_json(env), stream=S.STREAM_INBOUND)


async def _locate(url: str, pid: str) -> tuple[str, Any] | None:
    async with deployment(url) as store:
        found = await _find(store, pid)
        if found is None:
            return None
        record, _ = await store.load(*found)
        return found[0], record


def cmd_review_act(args: argparse.Namespace) -> int:
    """approve / reject: sign a Review and publish it on improve.triage.<svc>."""
    config = _config(args)
    url = _url(args, config)
    found = asyncio.run(_locate(url, args.id))
    if found is None:
        print(f"improved {args.verdict}: no proposal {args.id}", file=sys.stderr)
        return 1
    svc, _ = found
    principal, key = _signer(args)
    review = Review(proposal_id=args.id, verdict=args.verdict, principal=principal,
                    reason=args.reason, at=int(time.time() * 1000))
    env = signing.sign(signing.PAYLOAD_TYPES["review"], to_json(review), key)
    asyncio.run(_publish_act(url, S.inbound_review(svc), env))
    print(f"{args.verdict} of {args.id} signed by {principal} and published; "
          f"`improved show {args.id}` follows it")
    return 0


def cmd_grant_act(args: argparse.Namespace) -> int:
    config = _config(args)
    principal, key = _signer(args)
    expires = int((time.time() + args.expires_in) * 1000) if args.expires_in else None
    try:
        cmd = GrantCommand(op=args.op, skill=args.skill, principal=principal, reason=args.reason,
                           at=int(time.time() * 1000), expires_at=expires)
        msgspec.json.decode(to_json(cmd), type=GrantCommand)  # the daemon's own checks
    except msgspec.ValidationError as exc:
        print(f"improved {args.op}: {exc}; the skill is NAME:SHA256 "
              "(see `improved skill hash FILE`)", file=sys.stderr)
        return 2
    env = signing.sign(signing.PAYLOAD_TYPES["grant"], to_json(cmd), key)
    asyncio.run(_publish_act(_url(args, config), S.GRANTS, env))
    print(f"{args.op} of {args.skill} signed by {principal} and published")
    return 0


def cmd_crisis_resolve(args: argparse.Namespace) -> int:
    config = _config(args)
    principal, key = _signer(args)
    act = CrisisAct(op="resolve", crisis=args.crisis, principal=principal, reason=args.reason,
                    at=int(time.time() * 1000))
    env = signing.sign(signing.PAYLOAD_TYPES["crisis"], to_json(act), key)
    asyncio.run(_publish_act(_url(args, config), S.GRANTS, env))
    print(f"resolution of {args.crisis} signed by {principal} and published; "
          "`improved status` shows whether the daemon accepted it")
    return 0


def cmd_revert(args: argparse.Namespace) -> int:
    """Publish the reversal an L4 apply recorded before it ran (SPEC 09 §7.3)."""
    url = _url(args, _config(args))
    found = asyncio.run(_locate(url, args.id))
    if found is None:
        print(f"improved revert: no proposal {args.id}", file=sys.stderr)
        return 1
    svc, record = found
    if record.revert is None:
        print(f"improved revert: {args.id} has no recorded reversal (only an L4 apply that "
              "passed its last-known-good check has one)", file=sys.stderr)
        return 1
    if record.status != "applied":
        print(f"improved revert: {args.id} is {record.status}, not applied", file=sys.stderr)
        return 1

    async def publish() -> None:
        async with deployment(url, bind=False) as store:
            await store.js.publish(S.inbound_proposal(svc), to_json(record.revert),
                                   headers={"Nats-Msg-Id": record.revert_id},
                                   stream=S.STREAM_INBOUND)

    asyncio.run(publish())
    print(f"reversal {record.revert_id} of {args.id} published; it runs under the original's "
          f"approval by {record.approved_by}. `improved show {record.revert_id}` follows it")
    return 0


def cmd_vote(args: argparse.Namespace) -> int:
    """Sign a quorum vote with a voter key and publish it on improve.quorum."""
    config = _config(args)
    key = keys.load_key(Path(args.key))
    try:
        vote = Vote(proposal_id=args.id, vote=args.vote, voter=args.voter, session=args.session,
                    read=args.read, at=int(time.time() * 1000))
        msgspec.json.decode(to_json(vote), type=Vote)  # the daemon's own checks
    except msgspec.ValidationError as exc:
        print(f"improved vote: {exc}", file=sys.stderr)
        return 2
    env = signing.sign(signing.PAYLOAD_TYPES["vote"], to_json(vote), key)
    asyncio.run(_publish_act(_url(args, config), S.QUORUM, env))
    print(f"{args.vote} on {args.id} signed by {args.voter} (session {args.session}) and "
          f"published; `improved show {args.id}` shows whether it counted")
    return 0


def cmd_conformance(args: argparse.Namespace) -> int:
    from improved.runtime import conformance

    async def probe():
        nc = await bus.connect(_url(args, _config(args)), "improved-conformance")
        try:
            return await conformance.probe(nc, args.service, timeout=args.timeout)
        finally:
            await bus.close(nc)

    report = asyncio.run(probe())
    print(conformance.render(report))
    return 0 if report.level is not None else 1


def cmd_tools_list(args: argparse.Namespace) -> int:
    reply = asyncio.run(_request(_url(args, _config(args)), S.tools_list(args.runtime), b"{}",
                                 args.timeout))
    out(reply)
    return 1 if "error" in reply else 0


def cmd_tools_grant(args: argparse.Namespace) -> int:
    """Sign a per-call grant for one gated tool of a runtime; print the envelope for the agent
    (or, with --call, make the call with it and print the result)."""
    from improved.core import tools

    url = _url(args, _config(args))
    try:
        call_args = json.loads(args.args)
    except json.JSONDecodeError as exc:
        print(f"improved tools grant: --args is not JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(call_args, dict):
        print("improved tools grant: --args is a JSON object", file=sys.stderr)
        return 2
    catalog = asyncio.run(_request(url, S.tools_list(args.runtime), b"{}", args.timeout))
    entry = next((t for t in catalog.get("tools", []) if t.get("name") == args.tool), None)
    if entry is None:
        print(f"improved tools grant: runtime {args.runtime} lists no tool {args.tool!r}",
              file=sys.stderr)
        return 1
    principal, key = _signer(args)
    env = tools.sign_grant(key, principal, entry["grant_token"], args.tool, call_args,
                           args.reason, int(time.time() * 1000), int(args.ttl * 1000),
                           nonce=secrets.token_hex(16), runtime=args.runtime)
    if not args.call:
        out(msgspec.to_builtins(env))
        return 0
    body = to_json({"tool": args.tool, "args": call_args, "grant": env})
    reply = asyncio.run(_request(url, S.tools_call(args.runtime), body, args.timeout))
    out(reply)
    return 0 if reply.get("ok") else 1


def cmd_skill_hash(args: argparse.Namespace) -> int:
    data = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    try:
        doc = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        print(f"improved skill hash: not JSON: {exc}", file=sys.stderr)
        return 2
    if isinstance(doc, dict) and isinstance(doc.get("proposal_data"), dict):
        doc = doc["proposal_data"].get("skill", doc)  # a whole proposal: hash its skill
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        print("improved skill hash: expected a skill definition with a name", file=sys.stderr)
        return 2
    print(canonical.skill_identity(doc))
    return 0


async def _review_queue(url: str, policy: Policy | None = None) -> list[dict[str, Any]]:
    """What `improved review` lists: every proposal waiting for an operator or a quorum
    (`authority.is_waiting`) and every surfaced L1 proposal, oldest first."""
    queue, _ = await _review(url, policy or Policy())
    return queue


async def _review(url: str, policy: Policy) -> tuple[list[dict[str, Any]], str]:
    """The review queue, and where it was read: `cache` or `chains`."""
    async with deployment(url, bind=False) as store:
        records, source = await _current_records(store, policy)
        queue = []
        for record in records:
            d, p = record.decision, record.proposal
            surfaced = (record.status == "pending" and record.superseded_by is None
                        and d is not None and d.verdict == "accept" and record.gate_class == "L1")
            if not (surfaced or authority.is_waiting(record)):
                continue
            queue.append({
                "proposal_id": record.proposal_id, "service": record.service,
                "summary": record.summary_text,
                "votes": [f"{b.vote} by {b.voter} ({b.session})" for b in record.ballots],
                "constitution_edit": p.amends,
                "class": p.change_class, "gate": record.gate_class, "target": p.target_ref,
                "cause": "surfaced" if surfaced else d.cause, "rationale": d.rationale,
                "scope": p.scope,
                "origin": p.origin.actor, "analyzer": p.analyzer.id, "skill": record.skill,
                "signals": {"counted": len(record.signals), "positive": record.positives,
                            "independent_positive": record.independent_positives},
                "evidence": {"derived_from": len(p.derived_from or ()),
                             "evidence_query": p.evidence_query,
                             "metric": msgspec.to_builtins(p.metric_snapshot)
                             if p.metric_snapshot else None},
                "target_files": p.target_files or [], "valid_to": p.valid_to,
                "waiting_since": d.at,
            })
        return sorted(queue, key=lambda q: q["waiting_since"]), source


async def _current_records(store: Store, policy: Policy) -> tuple[list, str]:
    """Every proposal's current record: from the state cache when a complete refill marked it
    whole (`Store.filled`), else rebuilt from the audit chains — after a broker restart the
    cache starts empty, and the first records to land in it are not all there is."""
    try:
        await store.bind()
        whole = await store.filled()
    except (BucketNotFoundError, NotFoundError):
        whole = False
    if whole:
        return await store.cached_records(), "cache"
    from improved.core.propose import rebuild_record

    decoder = msgspec.json.Decoder(audit.Trailer)
    records = []
    for (svc, _), entries in (await store.sequenced_chains()).items():
        if svc in S.MESH_CHAINS:
            continue
        try:
            trailers = [decoder.decode(msgspec.json.encode(body)) for _, body in entries]
            records.append(rebuild_record(trailers, [seq for seq, _ in entries], policy))
        except (ValueError, KeyError, msgspec.MsgspecError):
            continue  # not replayable: `improved audit verify` names it
    return records, "chains"


def cmd_review(args: argparse.Namespace) -> int:
    config = _config(args)
    queue, source = asyncio.run(_review(_url(args, config), config.policy))
    if source == "chains":
        print("improved review: the daemon's state cache is being refilled (a broker restart "
              "empties it); this list was read from the audit chains", file=sys.stderr)
    if args.json:
        out(queue)
        return 0
    if not queue:
        print("nothing waits for an operator")
        return 0
    for q in queue:
        s = q["signals"]
        print(f"{q['proposal_id']}  {q['service']}  {q['class']} gated {q['gate']} "
              f"({q['cause']})")
        print(f"  {q['summary']}")
        print(f"  target {q['target']}  scope {q['scope']}"
              + (f"  skill {q['skill']}" if q["skill"] else ""))
        print(f"  from {q['origin']} via {q['analyzer']}")
        print(f"  signals: {s['counted']} counted, {s['positive']} positive, "
              f"{s['independent_positive']} independent positive")
        ev = q["evidence"]
        if ev["derived_from"] or ev["evidence_query"] or ev["metric"]:
            print(f"  evidence: {ev['derived_from']} grains"
                  + (f", query {ev['evidence_query']}" if ev["evidence_query"] else "")
                  + (f", metric {ev['metric']}" if ev["metric"] else ""))
        if q["target_files"]:
            print(f"  files: {', '.join(q['target_files'])}")
        if q["votes"]:
            print(f"  quorum votes: {'; '.join(q['votes'])}")
        if q["constitution_edit"]:
            print(f"  constitution edit amending {q['constitution_edit']}: approving it marks "
                  "it ready; you commit the diff by hand")
        print(f"  why waiting: {q['rationale']}")
        if q["cause"] == "surfaced":
            print(f"  surfaced only (L1 is never applied): improved reject {q['proposal_id']} "
                  "--reason '…' teaches its analyzer; re-propose at L2 to act on it\n")
        else:
            print(f"  decide: improved approve {q['proposal_id']} --reason '…'   "
                  f"| improved reject {q['proposal_id']} --reason '…'\n")
    return 0


# -- parser -----------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="improved",
        description="The self-improve daemon of a service mesh: proposals pass observe → propose "
                    "→ triage → apply → learn-back over NATS JetStream, gated by their L0–L4 "
                    "class, with every transition in a hash-chained audit trail.",
    )
    top.add_argument("--log-level", default="info",
                     help="debug, info, warning or error (default: info)")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--nats", metavar="URL",
                       help=f"NATS server URL (default: config nats_url, else {DEFAULT_URL})")
        p.add_argument("--config", metavar="FILE",
                       help="TOML configuration file (default: $IMPROVED_CONFIG)")

    run = sub.add_parser(
        "run", help="run the daemon",
        description="Run the daemon until SIGTERM/SIGINT, then drain and exit 0. Without --nats "
                    "(and no nats_url in the config) it starts an embedded nats-server with "
                    "JetStream under --data-dir and prints where it listens. Streams, the "
                    "consumer and the state bucket are created if missing, so starting twice "
                    "against the same server is safe.")
    common(run)
    run.add_argument("--data-dir", metavar="DIR",
                     help="where the embedded server keeps JetStream (default: .improved)")
    run.add_argument("--port", type=int, metavar="N",
                     help="embedded server port (default: 4222)")
    run.add_argument("--metrics-port", type=int, metavar="N",
                     help="serve Prometheus /metrics, /healthz and /readyz on this port "
                          "(default: config metrics_port, else off)")
    run.set_defaults(func=cmd_run)

    prop = sub.add_parser(
        "propose", help="submit a proposal (JSON) and print its id and status",
        description="Send a Proposal (DESIGN §3.2) to <service>.improve.propose and print the "
                    "reply: {proposal_id, status}, or the error naming the bad field. Exits 1 "
                    "on an error reply.")
    common(prop)
    prop.add_argument("file", metavar="FILE|-", help="the proposal JSON, or - for stdin")
    prop.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (10)")
    prop.set_defaults(func=cmd_propose)

    show = sub.add_parser(
        "show", help="show a proposal: state, decision, outcome, trailers",
        description="Print a proposal's retained records (state, triage decision, apply "
                    "outcome, learn-back) and its audit trailers, and whether the chain "
                    "verifies.")
    common(show)
    show.add_argument("id", metavar="ID", help="the 64-hex proposal id")
    show.set_defaults(func=cmd_show)

    aud = sub.add_parser("audit", help="verify the audit chains",
                         description="Audit chain tools.")
    aud_sub = aud.add_subparsers(dest="audit_command", required=True, metavar="ACTION")
    verify = aud_sub.add_parser(
        "verify", help="re-derive every hash and link; name the first break",
        description="Read every audit chain (or one proposal's) from the broker, re-derive "
                    "each trailer's hash and its link to the previous one, and print the first "
                    "break of each broken chain. Exits 1 if any chain is broken.")
    common(verify)
    verify.add_argument("id", metavar="ID", nargs="?", help="only this proposal's chain")
    verify.set_defaults(func=cmd_audit_verify)
    rebuild = aud_sub.add_parser(
        "rebuild", help="rebuild every proposal's state from the chains alone",
        description="Replay every proposal's audit chain (its first trailer carries the "
                    "proposal) into a record and compare it with the cached state. Status is "
                    "derived from the chain only, so the two must be equal; differences are "
                    "listed. With --write the cache is replaced by what the chains say. Exits 1 "
                    "on a broken chain, or on a difference without --write.")
    common(rebuild)
    rebuild.add_argument("--write", action="store_true",
                         help="replace cached records that differ (or are missing)")
    rebuild.set_defaults(func=cmd_audit_rebuild)

    def signer(p: argparse.ArgumentParser) -> None:
        p.add_argument("--reason", required=True, help="why (recorded in the audit trail)")
        p.add_argument("--principal", metavar="operator:NAME",
                       help="who signs (default: $IMPROVED_PRINCIPAL, or the only key in "
                            "the key directory)")
        p.add_argument("--key", metavar="FILE", help="the private key file to sign with")

    keys = sub.add_parser("keys", help="operator signing keys",
                          description="Operator signing keys (Ed25519).")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    knew = keys_sub.add_parser(
        "new", help="create an operator key and print its trust-store entry",
        description="Create an Ed25519 key for operator:NAME (or a quorum voter NAME) in the "
                    "key directory ($IMPROVED_KEYS, default ~/.config/improved/keys) and print "
                    "the [trust.operators] (or [trust.quorum]) entry the daemon's config needs "
                    "to trust it.")
    who = knew.add_mutually_exclusive_group(required=True)
    who.add_argument("--principal", metavar="operator:NAME", help="an operator's key")
    who.add_argument("--voter", metavar="NAME",
                     help="a quorum voter's key (its [trust.quorum] entry; see `improved vote`)")
    knew.add_argument("--dir", metavar="DIR", help="where to write the key")
    knew.set_defaults(func=cmd_keys_new)

    status = sub.add_parser(
        "status", help="autonomy switch, circuit breaker and store size",
        description="Print the autonomy switch and the circuit breaker as the autonomy chain "
                    "records them (constitution IV.5/IV.6: autonomous applies pause after "
                    "repeated rollbacks), and how many trailers and retained records there are.")
    common(status)
    status.set_defaults(func=cmd_status)

    review = sub.add_parser(
        "review", help="the queue of proposals waiting for an operator",
        description="List every proposal waiting for an operator (L2/L4 awaiting_operator, L3 "
                    "without a grant) with its rendered summary, class, target, cause, "
                    "evidence and independent-signal counts, oldest first.")
    common(review)
    review.add_argument("--json", action="store_true", help="print the queue as JSON")
    review.set_defaults(func=cmd_review)

    for verdict, what in (("approve", "approve a proposal waiting for an operator"),
                          ("reject", "reject a proposal (it enters the rejection ledger)"),
                          ("rollback", "undo an applied proposal with its recorded inverse")):
        act = sub.add_parser(
            verdict, help=f"sign and publish: {what}",
            description=f"Sign a Review ({verdict}: {what}) with your operator key (DSSE, "
                        f"Ed25519) and publish it on improve.triage.<svc>. The daemon verifies "
                        f"the signature against its trust store before anything moves.")
        common(act)
        act.add_argument("id", metavar="ID", help="the proposal id")
        signer(act)
        act.set_defaults(func=cmd_review_act, verdict=verdict)

    for op in ("grant", "revoke"):
        act = sub.add_parser(
            op, help=f"sign and publish an L3 {op} for NAME:SHA256",
            description=f"Sign a GrantCommand ({op}) for exactly one skill content hash and "
                        f"publish it on improve.grants. A grant never covers another hash of "
                        f"the same name.")
        common(act)
        act.add_argument("skill", metavar="NAME:SHA256")
        signer(act)
        if op == "grant":
            act.add_argument("--expires-in", type=float, metavar="SECONDS",
                             help="the grant lapses after this long")
        act.set_defaults(func=cmd_grant_act, op=op, expires_in=None)

    revert = sub.add_parser(
        "revert", help="run the recorded reversal of an applied L4 proposal",
        description="An L4 apply records a reversal before it runs (every artefact back to "
                    "its last-known-good) and names it in the outcome's revert_proposal_id. "
                    "This publishes that reversal as a proposal; it inherits the original's "
                    "approval, so it runs without a second one (SPEC 09 §7).")
    common(revert)
    revert.add_argument("id", metavar="ID", help="the applied L4 proposal's id")
    revert.set_defaults(func=cmd_revert)

    vote = sub.add_parser(
        "vote", help="sign and publish a quorum vote on an L4 proposal",
        description="Sign a QuorumVote with a voter key listed in [trust.quorum] and publish it "
                    "on improve.quorum (policy.quorum must be on). Three approvals from "
                    "distinct keys of non-correlated sessions approve; one dissent defers to an "
                    "operator. A vote says what its voter read: the proposal, its diff, its "
                    "triage record and the spec chapter.")
    common(vote)
    vote.add_argument("id", metavar="ID", help="the proposal id")
    vote.add_argument("vote", choices=("approve", "dissent"))
    vote.add_argument("--voter", required=True, help="the voter identity its key is bound to")
    vote.add_argument("--key", required=True, metavar="FILE", help="the voter's private key")
    vote.add_argument("--session", required=True,
                      help="the voter's session (model version or operator origin)")
    vote.add_argument("--read", action="append", required=True, metavar="WHAT",
                      help="what was read, repeated: proposal:ID, diff:…, triage:…, spec:…")
    vote.set_defaults(func=cmd_vote)

    conf = sub.add_parser(
        "conformance", help="which SPEC 09 conformance level a live service meets",
        description="Probe a live service over NATS (spec.get, its apply subject, and for "
                    "higher levels its skills read and last-known-good check) with orders a "
                    "conformant service refuses, and report the level it meets (L0–L4) and "
                    "why not the next. Changes nothing. Exit 1 when not even L0.")
    common(conf)
    conf.add_argument("service", metavar="SERVICE")
    conf.add_argument("--timeout", type=float, default=2.0, help="per request (2 s)")
    conf.set_defaults(func=cmd_conformance)

    tls = sub.add_parser(
        "tools", help="an agent runtime's tool surface (SPEC 09 §3.1)",
        description="List a runtime's tool catalog, or sign a per-call grant that mounts one "
                    "gated tool for exactly one call.")
    tls_sub = tls.add_subparsers(dest="tools_command", required=True, metavar="ACTION")
    tlist = tls_sub.add_parser(
        "list", help="the catalog: every tool, its class, whether it is mounted",
        description="Ask <runtime>.tools.list: every tool with its class (L0/L2/L4); a tool "
                    "above the runtime's ceiling shows gated_authority, mountable false and "
                    "its grant_token.")
    common(tlist)
    tlist.add_argument("runtime", metavar="RUNTIME")
    tlist.add_argument("--timeout", type=float, default=5.0, help="seconds (5)")
    tlist.set_defaults(func=cmd_tools_list)
    tgrant = tls_sub.add_parser(
        "grant", help="sign a grant for one call of a gated tool",
        description="Look the tool's grant_token up in the runtime's catalog and sign a "
                    "per-call grant (DSSE, your operator key) bound to that token, the "
                    "runtime and the digest of exactly these arguments; it runs once. Prints "
                    "the envelope for the agent to present, or makes the call with --call.")
    common(tgrant)
    tgrant.add_argument("runtime", metavar="RUNTIME")
    tgrant.add_argument("tool", metavar="TOOL")
    tgrant.add_argument("--args", default="{}", help="the call's arguments, a JSON object")
    tgrant.add_argument("--ttl", type=float, default=300.0, help="seconds the grant lives (300)")
    tgrant.add_argument("--call", action="store_true", help="make the call now with the grant")
    tgrant.add_argument("--timeout", type=float, default=5.0, help="seconds (5)")
    signer(tgrant)
    tgrant.set_defaults(func=cmd_tools_grant)

    bench = sub.add_parser(
        "bench", help="measure the loop against the broker's own limit",
        description="Start (or connect to) NATS, daemon process(es) and a reference applier; "
                    "drive N proposals at concurrency C through the whole loop (a mix of L0, "
                    "L3 with a grant, L2 approved by a signing bench operator, and proposals "
                    "rejected at triage); report end-to-end proposals/s, audited transitions/s, "
                    "p50/p99 per stage, the raw pipelined JetStream publish rate measured in "
                    "the same run, audit verify and rebuild rates, and the daemons' peak RSS.")
    bench.add_argument("--nats", metavar="URL", help="use this server instead of an embedded one")
    bench.add_argument("-n", type=int, default=2000, help="proposals (2000)")
    bench.add_argument("-c", "--concurrency", type=int, default=200,
                       help="proposals in flight at once (200)")
    bench.add_argument("--mix", default="l3=0.7,l0=0.1,l2=0.1,reject=0.1",
                       help="weights of l0, l3 (with grant), l2 (approved), reject "
                            "(default l3=0.7,l0=0.1,l2=0.1,reject=0.1)")
    bench.add_argument("--replicas", type=int, default=1, help="daemon processes (1)")
    bench.add_argument("--sync", default="always",
                       help="embedded server fsync: always (durable, default) or e.g. 2m")
    bench.add_argument("--records", choices=("file", "memory"), default="file",
                       help="the daemons' records_storage (file)")
    bench.add_argument("--verify-acceptance", action="store_true",
                       help="the applier checks every order's acceptance on the audit chain "
                            "first, as an L2+ conformant service does")
    bench.add_argument("--paced", action="store_true",
                       help="also measure publish→decision latency at half the peak rate")
    bench.add_argument("--timeout", type=float, default=300.0, help="give up after (300 s)")
    bench.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    bench.set_defaults(func=lambda args: reference_command("bench")(args))

    crisis = sub.add_parser("crisis", help="resolve a crisis (a broken audit log)",
                            description="Crisis tools (constitution V.4).")
    crisis_sub = crisis.add_subparsers(dest="crisis_command", required=True, metavar="ACTION")
    cres = crisis_sub.add_parser(
        "resolve", help="sign the resolution of an open crisis",
        description="When the daemon finds the audit log broken (a chain that does not verify, "
                    "or trailers missing against a signed checkpoint) it refuses every apply "
                    "until an operator resolves the crisis with a signed act. Investigate first "
                    "(`improved audit verify`); the crisis id is in `improved status`.")
    common(cres)
    cres.add_argument("crisis", metavar="CRISIS_ID")
    signer(cres)
    cres.set_defaults(func=cmd_crisis_resolve)

    demo = sub.add_parser(
        "demo", help="walk through the whole loop in about a minute",
        description="Start everything embedded (a nats-server, the daemon, a skills store, a "
                    "ranking store and an artefact store) and walk through the loop: a skill "
                    "proposed at L1, its first execution approved by a demo operator, a grant, a "
                    "trusted re-execution, a refinement sent back to L2, a self-confirmed change "
                    "deferred, a forbidden target rejected, a rollback, an L4 binary swap "
                    "refused whole, then applied and reverted without a second approval — "
                    "printing a timeline and ending with every audit chain verified.")
    demo.add_argument("--pace", type=float, default=0.4, metavar="SECONDS",
                      help="pause between steps (0.4)")
    demo.add_argument("--data-dir", metavar="DIR",
                      help="keep the demo's store here (a new or empty directory)")
    demo.set_defaults(func=cmd_demo)

    skill = sub.add_parser("skill", help="skill tools", description="Skill tools.")
    skill_sub = skill.add_subparsers(dest="skill_command", required=True, metavar="ACTION")
    shash = skill_sub.add_parser(
        "hash", help="print a skill's NAME:SHA256 identity",
        description="Print NAME:SHA256, the content identity an L3 grant binds: SHA-256 of "
                    "the canonical MessagePack of the skill's definition fields only. FILE is "
                    "a skill definition, or a proposal carrying one in proposal_data.skill.")
    shash.add_argument("file", metavar="FILE|-")
    shash.set_defaults(func=cmd_skill_hash)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"improved: {exc}", file=sys.stderr)
        return 2
    except (bus.BusError, StoreError) as exc:
        print(f"improved: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
