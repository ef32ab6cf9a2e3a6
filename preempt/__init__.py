"""preempt: preemption in LLM inference serving.

Subpackages by role, bottom to top; each imports only the layers below it
(tests/test_architecture.py keeps this true):

    core/          requests, KV blocks, the config, clocks, the cost model, workloads
    model/         the tiny Llama with paged attention (kernels/ beside it: Triton + refs)
    kv/            where a preempted request's KV goes: record, saver, codec, host pool
    engine/        who runs and who is preempted (scheduler, policies), early saves,
                   prefetch, the step
    obs/           what a run writes and measures: results, metrics, dataset, tracking
    lm/ calibrate/ replay.py    the reference LM; cost-model fits; one offline run
    parity/ integrations/       our scheduler beside vLLM's; our policies inside vLLM
    serve/ bench/               the HTTP server; the benchmarks
    cli.py         the command line: the only module that imports predictor/, experiments/

Where a preemption is decided: preempt.engine.scheduler (with engine.policies); where its
KV moves: preempt.kv.saver; where it is measured: its preempt.kv.record.PreemptionRecord,
written by preempt.obs.results and counted by preempt.obs.metrics.
"""
