"""preempt: preemption in LLM inference serving.

The few objects a user needs, importable from here (each loaded when first used, so
`import preempt` stays light: no torch until an engine is built):

    from preempt import Engine, build_config, build_workload

Subpackages by role, bottom to top; each imports only the layers below it
(tests/test_architecture.py keeps this true):

    core/          requests, KV blocks, the config, clocks, the cost model, workloads
    model/         the tiny Llama with paged attention
    kernels/       Triton kernels + torch references (beside model/, the same layer)
    kv/            where a preempted request's KV goes: record, store, saver, codec, host pool
    engine/        who runs and who is preempted (scheduler, policies, the waiting
                   queue), the step
    early/         early saves and restores ahead: hooks the step calls by name
    obs/           what a run writes and measures: results, metrics, dataset, tracking
    lm/ calibrate/ replay.py    the reference LM; cost-model fits; one offline run
    parity/ integrations/       our scheduler beside vLLM's; our policies inside vLLM
    serve/ bench/               the HTTP server; the benchmarks
    cli/           the command line: the only package that imports predictor/, experiments/

Where a preemption is decided: preempt.engine.scheduler (with engine.policies); where its
KV moves: preempt.kv.saver; where it is measured: its preempt.kv.record.PreemptionRecord,
written by preempt.obs.results and counted by preempt.obs.metrics.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each layer adds its own plug-in names (policies, early-save policies and hooks, codecs)
# to preempt.core.registry when its package is imported: strings only, nothing heavy.
# Importing them here, where any `import preempt...` starts, makes every built-in name
# known before a config is validated.
from preempt import early, engine, kv  # noqa: F401

_EXPORTS = {
    "Engine": "preempt.engine.engine",
    "EngineConfig": "preempt.core.config",
    "ConfigError": "preempt.core.config",
    "build_config": "preempt.core.config",
    "load_config": "preempt.core.config_files",
    "Request": "preempt.core.request",
    "RequestState": "preempt.core.request",
    "build_workload": "preempt.core.workload",
    "load_trace": "preempt.core.workload",
    "replay": "preempt.replay",
    "SchedulingPolicy": "preempt.engine.policies",
    "EarlySavePolicy": "preempt.early.early_save",
    "SCHEDULING_POLICIES": "preempt.core.registry",
    "EARLY_SAVE_POLICIES": "preempt.core.registry",
    "LengthModel": "preempt.engine.lengths",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'preempt' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
