"""The daemon's imperative shell, one concern a module (docs/architecture.md, "Functional core,
imperative shell"): `daemon` (start, serve, drain) and what it runs — `inbound` (the shared
consumer's jobs), `request_reply` and `admission` (the request handlers), `upkeep` (the
periodic passes), `index_checks`; `engine` (one proposal's pass: load, ask the planner, carry
out one step at a time) and what a pass relies on — `intake`, `signed_acts`, `trusting`,
`autonomy`, `records`, `service_requests`, `publishing`, `checkpointer`, `policy_chain`,
`passes`; `store` (one face over JetStream: `provisioning`, `audit_log`, `buckets`, `retained`,
`grant_reads`, `conflicts`); `checkpointing` (verifying what the log gained), `archive`
(sealing, exporting and removing epochs of the log), `anchor`, `clock`, `config`, `keys`,
`metrics`, `notify`, `bus` (the embedded nats-server), `accounts` (its users), `conformance`
(probing a live service). Connecting, keys and the chain append are the client's
(`improved.client`): the shell stands on them as a mesh service does."""
