"""A running deployment as any client of the bus reads it, nothing created: the audit chains
(`improved.client.audit_log`), the retained records (`improved.client.records`), and whether the daemon's
buckets are there (`Deployment.bind`). What the operator commands and an outside auditor stand
on; the daemon's store reads through the same code (`runtime.store` extends these parts).
"""

from __future__ import annotations

from nats.aio.client import Client

from improved.client.audit_log import AuditReader
from improved.client.records import RecordReads
from improved.client.streams import Streams
from improved.protocol import subjects as S


class Deployment(Streams, AuditReader, RecordReads):
    """One connection's reads of a deployment: its chains on the daemon's audit stream, its
    retained records, and the shape of its streams and buckets (`Streams`)."""

    def __init__(self, nc: Client, *, audit_stream: str = S.STREAM_AUDIT):
        super().__init__(nc.jetstream(publish_async_max_pending=8192))
        self.nc = nc
        # the stream whose chains it reads: the daemon's log, or the tool runtimes'
        self.audit_stream = audit_stream

    async def bind(self) -> None:
        """Whether the deployment's buckets are there (a NeedsProvision or StoreError naming
        what is missing otherwise), as a command that relies on a provisioned one checks."""
        await self.existing_buckets()
