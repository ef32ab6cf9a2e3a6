"""preempt's priority-score policy as a vLLM 0.32 V1 scheduler plugin.

`vllm serve MODEL --scheduler-cls preempt.integrations.vllm.scheduler.PreemptScheduler`
(docs/vllm_plugin.md). Modules, by where they may run:

- `settings`, `clock`, `decider`, `metrics`: plain Python (pydantic, preempt's deciding
  code); importable anywhere, tested in preempt's own environment.
- `scheduler` (the `Scheduler` subclass) and `peer` (the driver `preempt bench vllm` and
  the tests start in the peer virtualenv): import vLLM; never import them from preempt.
"""
