"""The foundations every other layer stands on: requests, KV blocks, configs, clocks.

- `request`: a request's state and tokens; `block_pool`: which KV blocks are free;
  `block_table`: logical -> physical block rows;
- `config`: the frozen, validated engine config (every key of a run);
- `clock`: virtual and wall clocks; `cost_model`: step and copy durations of a target;
- `sizes`, `limits`: byte sizes and request limits; `workload`: traces -> requests.

Must never import anything of preempt outside `preempt.core` (a test keeps this: it is
the bottom layer), nor torch at import time (the vLLM peer imports `limits` and `config`).
"""
