"""The daemon's appends to the audit chains: a trailer appended only where its chain still ends
as the writer read it (the commit point of every transition), signed with the daemon's key,
and what it checks of the stream before relying on it keeping every trailer. The reads are the
client's (`improved.client.audit_log`), the same code the command line and an auditor run.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from improved.client.chain_writer import ChainWriter
from improved.client.streams import retention_differences
from improved.core import checkpoint
from improved.protocol import subjects as S
from improved.protocol.model import Trailer
from improved.runtime.provisioning import stream_configs


class AuditLog(ChainWriter):
    """Appends to the chains on `audit_stream` (the daemon's log, or the tool runtimes'), and
    their reads (the client's `AuditReader`, through `ChainWriter`); `written` holds the
    hashes this process appended since its last checkpoint."""

    js: JetStreamContext
    _probe: JetStreamContext
    audit_stream: str
    replicas: int
    signer: Ed25519PrivateKey | None
    written: set[str]

    async def has_chains(self) -> bool:
        return (await self._probe.stream_info(S.STREAM_AUDIT)).state.messages > 0

    async def append(self, service: str, pid: str, trailers: list[Trailer],
                     expected_seq: int) -> int:
        """Append the trailers of one commit to the chain of proposal `pid`, in one message,
        if the chain's last message is still at `expected_seq`; the message's sequence."""
        return await self.append_commit(S.audit(service, pid), trailers, expected_seq)

    async def audit_retention(self) -> tuple[checkpoint.StreamView, list[str]]:
        """The audit stream as its state says (`audit_view`, O(1)) and which of the settings
        it keeps every trailer by differ from the loop's (a limit set, deletes allowed): what
        a decision that relies on the log not forgetting checks first."""
        try:
            info = await self.js.stream_info(self.audit_stream)
        except NotFoundError:
            return checkpoint.StreamView(None), []
        state = info.state
        want = next(c for c in stream_configs(self.replicas) if c.name == S.STREAM_AUDIT)
        changed = retention_differences(want, info.config)
        return (checkpoint.StreamView(str(info.created), state.last_seq,
                                      first_seq=state.first_seq, messages=state.messages),
                changed)
