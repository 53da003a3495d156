"""The reference mesh services: stores that take a daemon's ApplyOrders (ranking, skills,
artefacts, knowledge, documents), a tool runtime, and their pure helpers. They stand on
`improved`; the bench and the demo, which run them next to a daemon, stand on them."""
