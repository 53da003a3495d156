"""The daemon's imperative shell: `store` (JetStream streams, the chain append, retained
records), `engine` (loads a record, asks the planner, carries out one step at a time),
`daemon` (consumers, request handlers, checkpoints), `checkpointing` (verifying what the
log gained), `archive` (sealing, exporting and removing epochs of the log), `anchor`,
`config`, `keys`, `metrics`, `notify`,
`bus` (the embedded nats-server), `accounts` (its users), `conformance` (probing a live service)."""
