"""What a run measures and writes: observers of the engine, never part of its step.

- `results`: the run's files (requests.parquet, preemptions.parquet, summary.json);
- `latency`: ttft, tpot, e2e, defined once (results, the server and metrics report them);
- `metrics`: the server's Prometheus metrics;
- `dataset`: `preempt collect`'s feature rows, their labels, the predictor's dataset;
- `tracking`: the wandb seam (offline by default) and Lightning's quiet logging.

Where a preemption is measured: its `PreemptionRecord` (preempt.kv.record) is written
out by `results` and counted by `metrics`. Imports `preempt.core`, `preempt.kv` and
`preempt.engine`; nothing here may change engine or request state.
"""
