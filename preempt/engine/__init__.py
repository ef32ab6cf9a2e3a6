"""The engine: who runs, who is preempted, and one step through the model.

Where a preemption is decided: `scheduler` (the step's batch, both triggers, the
fallback), with the victim and admission order from `policies` (a registry by name) and
`priority` (the priority score, docs/design.md §1), admitting from `waiting` (the waiting
queue in that order); `sglang_scheduler` is SGLang's loop for the `sglang_*` policies;
`remaining` (with `lengths`, the learned output-length model) estimates the work a request
has left, which the score reads. `gate` rate-limits preemptions.

`engine` wires them with the model (`model_runner`, `sampling`) and the KV data path
(`preempt.kv`) and runs the step; `view` holds what a step returns and the view of the
engine its hooks read. Who is saved early or restored ahead lives one layer up, in
`preempt.early`: the engine builds those hooks by name through `preempt.core.registry`
(`STEP_HOOKS`) and calls them with the view after each step, never importing them.
Imports `preempt.core`, `preempt.kv`, `preempt.model` and `kernels`; never
`preempt.early`, `preempt.obs` or anything above them.
"""

from preempt.core.registry import SCHEDULING_POLICIES

# The policies, by the name `scheduler.policy` gives them (imported when first built).
SCHEDULING_POLICIES.add("vllm_fcfs", "preempt.engine.policies:VllmFcfsPolicy")
SCHEDULING_POLICIES.add("vllm_priority", "preempt.engine.policies:VllmPriorityPolicy")
SCHEDULING_POLICIES.add("vllm_lcf", "preempt.engine.policies:VllmLcfPolicy")
SCHEDULING_POLICIES.add("sglang_fcfs", "preempt.engine.policies:SglangFcfsPolicy")
SCHEDULING_POLICIES.add("sglang_priority", "preempt.engine.policies:SglangPriorityPolicy")
SCHEDULING_POLICIES.add("uniboost", "preempt.engine.policies:UniBoostPolicy")
SCHEDULING_POLICIES.add("priority_score", "preempt.engine.policies:PriorityScorePolicy")
SCHEDULING_POLICIES.add("priority_score_class", "preempt.engine.policies:ClassStrictScorePolicy")
SCHEDULING_POLICIES.add("fastserve_mlfq", "preempt.engine.policies:FastServeMlfqPolicy")
SCHEDULING_POLICIES.add("srpt", "preempt.engine.policies:SrptPolicy")
