"""The wire contract of DESIGN §3 as this daemon reads it (docs/protocol.md): every message as a
msgspec Struct (`model`), the subjects (`subjects`), error replies (`wire`), the canonical OMS
encoding and content addresses (`canonical`), and CAL batches (`cal`). No I/O."""
