"""What a mesh service uses to take part in the loop: `sdk.MeshClient` to propose, refine and
serve ApplyOrders, `acceptance.check` to verify on the audit chain that an order it was sent
was really accepted, `chains` to read and verify a chain, `connection` to reach the bus as its
own user (`credentials`: the password file of its data directory's server), `keys` to read the
key it signs with, `streams` to bring its streams to their configuration and `chain_writer` to
append to its own chain. The daemon's shell stands on the same pieces (its store extends
`ChainWriter`). Depends on the protocol and the core only, never on the daemon."""
