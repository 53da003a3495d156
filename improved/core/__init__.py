"""Every decision of the loop, pure: `(record, input, policy, clock) → (record, trailer draft)`.

`propose`, `triage`, `apply`, `learnback` are the stages; `guards` and `gradient` the fixed
checks and the L0–L4 classes; `record` rebuilds a proposal from its chain and `audit` seals and
verifies the chain, `evidence` checks who wrote each trailer and the signed act under it;
`identity` says who verifiably sent evidence; `authority`, `signing`, `quorum` decide who may
move a proposal;
`breaker`, `lkg`, `tools`, `checkpoint` the safety rules; `planner` picks the next step. No
module here imports I/O, a clock or randomness (tests/unit/test_architecture.py)."""
