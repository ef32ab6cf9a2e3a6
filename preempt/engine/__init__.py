"""The engine: who runs, who is preempted, and one step through the model.

Where a preemption is decided: `scheduler` (the step's batch, both triggers, the
fallback), with the victim and admission order from `policies` (a registry by name) and
`priority` (the priority score, docs/design.md §1), admitting from `waiting` (the waiting
queue in that order); `sglang_scheduler` is SGLang's loop for the `sglang_*` policies.
Who is saved early or restored ahead: `early_save` (its policies, `lookahead` the oracle
that forks the engine, `online_predictor` the trained LSTM) and `prefetch`, reading
`features` (what a policy may know of a running request).

`engine` wires them with the model (`model_runner`, `sampling`) and the KV data path
(`preempt.kv`) and runs the step; `step` holds what a step returns and the view of the
engine its hooks read. Imports `preempt.core`, `preempt.kv`, `preempt.model` and
`kernels`; never `preempt.obs` or anything above it.
"""
