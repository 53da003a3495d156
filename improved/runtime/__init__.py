"""The daemon's imperative shell, one concern a module (docs/architecture.md, "Functional core,
imperative shell"): `daemon` (start, serve, drain) and what it runs — `inbound` (the shared
consumer's jobs, pulled by `client.pulls`), `request_reply` and `admission` (the request
handlers), `upkeep` (the periodic passes), `index_checks`; `engine` (one proposal's pass:
load, ask the planner, carry out one step at a time; `commits`, what it decided appended as
one message) and what a pass relies on — `intake`, `signed_acts`, `trusting`,
`autonomy`, `records`, `service_requests`, `publishing`, `checkpointer`, `policy_chain`,
`passes`; `store` (one face over JetStream: `provisioning`, `audit_log` (the appends),
`buckets`, `retained` (the index writes), `grant_reads`, `conflicts`); `archive` (sealing
epochs of the log), `anchor` (writing the kept checkpoint), `clock`,
`metrics`, `notify`, `bus` (the embedded nats-server), `accounts` (its users), `observing`,
`surfaces`. Connecting, the configuration, keys, the chain append, every read of a deployment
and every verifier an auditor runs are the client's (`improved.client`): the shell stands on
them as a mesh service and the command line do, so the daemon and an auditor run the same
reading code."""
