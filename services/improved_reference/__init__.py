"""The reference mesh services: stores that take a daemon's ApplyOrders (ranking, skills,
artefacts, knowledge, documents), a tool runtime, and their pure helpers. Each stands on
`improved.client` (with the pure `improved.protocol` and `improved.core`) as any mesh service
does, never on the daemon's shell (`improved.runtime`) nor its command line; the bench and the
demo, which run them next to a daemon, stand on them."""
