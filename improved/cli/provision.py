"""`improved provision`: create or update the loop's streams, buckets and inbound consumer with
the deployment's provisioning credential.

Under deploy/accounts.conf the daemon's user may not create, update, delete or purge the audit
stream (nor update or delete the other streams), so that a compromised daemon cannot weaken or
drop the chain. This is the step that may, run by an administrator before the first start and
again after an upgrade or a change of `replicas`. Without accounts it is optional: the daemon
creates what is missing itself."""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys

import nats
from nats.js.errors import ServiceUnavailableError

from improved.cli.common import add_connection_args, chain_record, config_of, url_of
from improved.client import connection, credentials
from improved.client.connection import Target
from improved.client.streams import NeedsProvision, StoreError
from improved.core import propose
from improved.runtime.store import Store

ADMIN = "IMPROVED_NATS_USER=improved-admin IMPROVED_NATS_PASSWORD_FILE=FILE"


async def provisioned(url: str | Target, replicas: int, records_storage: str,
                      sweep_ttl_s: int | None = None, move_records: bool = False
                      ) -> tuple[list[str], list[str]]:
    """What provisioning found and left as it is (said, not changed), and what it changed
    (nothing when all is in place), connected to `url`."""
    nc = await connection.connect(url, "improved-provision", persistent=False)
    try:
        store = Store(nc, replicas, records_storage)
        store.move_records = move_records
        changes = await store.ensure(strict=True)
        changes += await store.remove_retired()
        if sweep_ttl_s is not None:
            changes.append(await sweep_dedup(store, sweep_ttl_s))
        return store.notes, changes
    finally:
        await connection.close(nc)


async def sweep_dedup(store: Store, ttl_s: int) -> str:
    """Give every dedup key whose proposal is closed the TTL a daemon gives it at the close
    (`records_ttl_days`): a key closed before daemons did so is otherwise kept for good. A
    one-off after upgrading: it reads every key and the chain of the proposal each names, so
    its cost follows the bucket's size. Only a chain whose links verify is believed, and
    `propose.head_may_expire` decides, as at a close; the write is a compare-and-set, so a
    head a newer proposal claims meanwhile is left alone."""
    try:
        keys = await store.dedup.keys()
    except Exception:  # nats-py raises NoKeysError on an empty bucket
        keys = []
    given = 0
    for key in keys:
        svc, _, dedup = key.partition(".")
        head = await store.dedup_head(svc, dedup)
        if head is None:  # none, or no head (the bucket is a hint)
            continue
        record = await chain_record(store, svc, head.proposal_id)
        if record is None:  # no chain, or one whose links do not verify: not believed
            continue
        if await store.expire_dedup_head(svc, dedup, ttl_s,
                                         functools.partial(propose.head_may_expire, record)):
            given += 1
    return (f"dedup keys: {given} of {len(keys)} (their proposals closed) given the TTL "
            f"of {ttl_s} s")


def cmd_provision(args: argparse.Namespace) -> int:
    config = config_of(args)
    replicas = args.replicas or config.replicas
    url = url_of(args, config)
    where = url.where  # never print a password
    sweep = None
    if args.sweep_dedup:
        if config.records_ttl_days <= 0:
            print("improved provision: --sweep-dedup gives closed proposals' dedup keys the "
                  "TTL records_ttl_days; it is 0 (kept for good) in this configuration, so "
                  "there is nothing to give", file=sys.stderr)
            return 2
        sweep = int(config.records_ttl_days * 86400)
    try:
        notes, changes = asyncio.run(provisioned(url, replicas, config.records_storage, sweep,
                                                 args.move_records))
    except NeedsProvision as exc:
        print(f"improved provision: {exc.what}, and these credentials may not change it "
              f"(JetStream did not answer): connect as the provisioning user, e.g. "
              f"{ADMIN}", file=sys.stderr)
        return 2
    except StoreError as exc:
        print(f"improved provision: {exc}", file=sys.stderr)
        return 2
    except ServiceUnavailableError:
        print(f"improved provision: {where}: JetStream is not available there (not enabled, "
              "or not ready yet)", file=sys.stderr)
        return 2
    except nats.errors.Error as exc:
        print(f"improved provision: {where}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    for line in notes + changes:
        print(line)
    print(f"provisioned {where}: the loop's streams, buckets and inbound consumer are in place "
          f"(R{replicas}, records on {config.records_storage}); "
          + (f"{len(changes)} changed" if changes else "nothing changed"))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `provision` command to the `improved` parser."""
    p = sub.add_parser(
        "provision", help="create or update the streams and buckets (admin credential)",
        description="Create what the loop needs on the NATS server and bring it to this "
                    "configuration: the streams IMPROVE_IN, IMPROVE_RECORDS, IMPROVE_AUDIT, "
                    "IMPROVED_REFUSED, IMPROVE_TOOLS_AUDIT (the tool runtimes' audit "
                    "chains, durable as IMPROVE_AUDIT), IMPROVE_TOOLS_SPENT and "
                    "IMPROVE_TOOLS_REVOKED (the tool runtimes' spent grants and proofs and "
                    "revoked upgrades: marks nobody can delete, purge or replace; the "
                    "first's sentinel, its first message, is written into one an earlier "
                    "version made without it), the KV buckets improved_dedup, improved_ledger, "
                    "improved_windows and improved_learned, and the inbound durable consumer; "
                    "the bucket improved_state an earlier version kept is removed. It looks "
                    "first and "
                    "changes only what is missing or differs, so running it again is safe; "
                    "it prints each change. With deploy/accounts.conf the daemon's user may "
                    "not do this (it cannot create, update, delete or purge the audit stream, "
                    "nor update or delete the other streams): run it as the provisioning user "
                    f"({ADMIN}, or its [nats] user and password_file) before the daemon's first start and after an "
                    "upgrade or a change of `replicas`. Replicas and records storage come "
                    "from the daemon's configuration file (--config). Exits 2, with one line "
                    "saying why, when a change is not allowed or refused.")
    add_connection_args(p)
    p.add_argument("--replicas", type=int, choices=(1, 3, 5), metavar="N",
                   help="JetStream replicas of every stream and new bucket: 1, 3 or 5 "
                        "(default: config replicas, else 1)")
    p.add_argument("--sweep-dedup", action="store_true",
                   help="also give the dedup keys of closed proposals the TTL "
                        "records_ttl_days (daemons do so at each close; keys closed before "
                        "they did are otherwise kept for good): once, after upgrading; it "
                        "reads every key and its proposal's chain")
    p.add_argument("--move-records", action="store_true",
                   help="make the records stream IMPROVE_RECORDS again when its storage is "
                        "not the configured records_storage (a stream's storage is fixed when "
                        "it is made): it is removed and made anew, and the daemon refills "
                        "what it holds from the audit chains after the last sealed epoch")
    p.set_defaults(func=cmd_provision, as_user=credentials.ADMIN)
