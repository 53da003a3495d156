"""`improved demo`: the whole loop on an embedded mesh, walked through for a newcomer (`demo`).
It runs a daemon and the reference services in process, so it stands on every layer of
`improved` and on `improved_reference`; nothing imports it (the `improved demo` command finds
it through its `improved.commands` entry point)."""
