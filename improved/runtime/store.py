"""JetStream streams, the KV buckets, and the chain append (DESIGN §7 "store").

Four streams, four buckets and the inbound consumer, made to match this configuration by
`Store.ensure` (`runtime.provisioning`), which looks before it changes anything: under
deploy/accounts.conf only the provisioning user (`improved provision`) may create or change
most of them, and the daemon finds them as they should be.
- IMPROVE_IN: inbound requests (`improve.proposals.<svc>`, …), kept so nothing is lost while no
  daemon runs; one durable pull consumer shared by every replica.
- IMPROVE_RECORDS: retained records, one message per subject (the current state), among them
  the review index (`improve.review.<svc>.<id>`, one entry per open item of the operator's
  queue; an item that leaves is overwritten by an empty message with a per-message TTL, so its
  subject disappears) and the marker a complete refill leaves (`improve.review._filled.records`,
  naming the stream's incarnation, its creation time, and the index format): it lives and dies
  with what it vouches for, so a broker restart over file storage keeps both, and a re-created
  (memory storage) or purged stream loses both and is refilled.
- IMPROVE_AUDIT: the trailers, append-only (deny delete, no limits); purged only by an
  operator removing an exported, sealed epoch (runtime.archive).
- KV `improved_dedup` and `improved_ledger`: the newest proposal per dedup_key and the
  rejection ledger, hints the chain confirms (`runtime.buckets`).
- KV `improved_windows` and `improved_learned`: stage 1's analyzer windows and learned weights,
  shared by every replica (`runtime.observing`); outputs of signals and of committed trailers,
  read by nothing but the analyzers, so never an input to an authority decision.

The chain append is the commit point of every transition. It carries
`Nats-Expected-Last-Subject-Sequence`, so a trailer joins the chain only if nothing joined since
the writer last looked: a redelivery, a restart or a second replica gets a conflict instead of a
duplicate trailer, re-reads the chain, and finds its transition already made.

`Store` is one face over the concerns, each in a module of its own and sharing the one
connection: provisioning the streams and buckets (`runtime.provisioning`), the appends to the
audit chains (`runtime.audit_log`), the dedup heads and rejection ledger
(`runtime.buckets`), the retained records and indexes written (`runtime.retained`) and the
grant chains' verdicts (`runtime.grant_reads`); what a lost race in a bucket looks like is `runtime.conflicts`. The
streams' own upkeep (a stream brought to its configuration, its sentinel) and the chain append
are the client's (`improved.client.streams`, `improved.client.chain_writer`), which the
reference services use too, and so are the reads of the chains and the retained records
(`improved.client.deployment`), which the command line uses; `Store` extends them, so the
daemon reads through the same code. The shell talks to this one face.
"""

from __future__ import annotations

from collections import OrderedDict

from nats.aio.client import Client

from improved.client.acks import Acks
from improved.client.chain_writer import ChainWriter
from improved.client.config import RECORDS_STORAGE
from improved.client.records import TOMBSTONE_TTL_S
from improved.protocol import subjects as S
from improved.protocol.model import Refusal, to_json
from improved.runtime.audit_log import AuditLog
from improved.runtime.buckets import Buckets
from improved.runtime.grant_reads import GrantReads, _GrantChain
from improved.runtime.provisioning import Provisioning
from improved.runtime.retained import Retained

PROBE_TIMEOUT_S = 1.0  # a status read during a restore (Store._probe)


class Store(Provisioning, AuditLog, Buckets, Retained, GrantReads):
    """The daemon's JetStream, one concern a base: a part reads only the connection and the
    state this constructor sets, and no part calls another's methods."""

    def __init__(self, nc: Client, replicas: int = 1, records_storage: str = RECORDS_STORAGE, *,
                 audit_stream: str = S.STREAM_AUDIT):
        # the connection, the audit stream its chains live in (the daemon's log, or the tool
        # runtimes'), and the daemon's key every trailer is signed with once it is loaded
        # (`signer`): the client's chain writer, which the audit log extends
        ChainWriter.__init__(self, nc, audit_stream=audit_stream)
        # for the small status reads of a restore: a server still loading its streams after a
        # restart answers nothing, and the restore tries again sooner than the default 5 s
        self._probe = nc.jetstream(timeout=PROBE_TIMEOUT_S)
        self.replicas = replicas
        self.records_storage = records_storage
        self.tombstone_ttl_s = TOMBSTONE_TTL_S
        self.record_acks = Acks(nc)  # the retained records' acknowledgements
        # whether the dedup bucket's stream takes per-message TTLs (`ensure` finds out)
        self.dedup_ttl = False
        self.notes: list[str] = []
        # skill hash → the grant chain as last read whole: re-read only when it has moved
        self._grants: OrderedDict[str, _GrantChain] = OrderedDict()

    async def refuse(self, svc: str, refusal: Refusal) -> None:
        """Record a refused inbound message (what and why, never the payload)."""
        await self.js.publish(S.refused(svc), to_json(refusal), stream=S.STREAM_REFUSED)
