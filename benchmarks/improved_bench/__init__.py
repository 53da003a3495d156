"""`improved bench`: the loop measured against the broker's own limit (`bench`), with the mesh's
side in a process of its own (`publisher`). It runs daemons and reference services, so it
stands on every layer of `improved` and on `improved_reference`; nothing imports it (the
`improved bench` command finds it through its `improved.commands` entry point)."""
