"""What a mesh service uses to take part in the loop: `sdk.MeshClient` to propose, refine and
serve ApplyOrders, `acceptance.check` to verify on the audit chain that an order it was sent
was really accepted, `chains` to read and verify a chain, `connection` to reach the bus as its
own user (`credentials`: the password file of its data directory's server), `keys` to read the
key it signs with, `streams` to bring its streams to their configuration and `chain_writer` to
append to its own chain (its acknowledgements, like the daemon's, through `acks`). And what
an operator or an outside auditor runs against a deployment, as a client of the bus:
`deployment` (one connection's reads, nothing created) over `audit_log` (the chains read,
the whole log through `pulls`, as the daemon's inbound consumer pulls) and `records` (the
retained records and indexes read), `indexing` (an index confirmed by its chains), the
verifiers `checkpointing`, `archive` (sealed epochs and their exports), `tool_chains` and
`anchor` (the kept checkpoint read), `archiving` (an operator's export and removal of sealed
epochs), `config` (the configuration file), `answers` (a request that hears every answer)
and `conformance` (the SPEC 09 probe). The daemon's shell stands on the same pieces (its
store extends `ChainWriter`, a `Deployment`). Depends on the protocol and the core only, never
on the daemon."""
