"""The vLLM side of `preempt bench vllm` and of the plugin's tests. Runs in the peer
virtualenv (`make peer`), never in preempt's own process.

Reads a JSON list of jobs on stdin and writes `{"vllm_version": ..., "results": [...]}` on
stdout, one result per job (`{"error": ...}` for a job that failed; the others still run):

- `{"kind": "decisions", "workload": {...}, "settings": {...}, "clock": {"starts_s": [...],
  "durations_s": [...]}}`: the plugin scheduler driven without a model, exactly as
  `preempt.parity.vllm_peer` drives vLLM's own (same requests, same fake model output),
  on a replay of preempt's engine clock; `"async_scheduler": true` drives the plugin's
  `AsyncScheduler` class instead. Result: `{"trace": [...], "metrics": {...}}`.
- `{"kind": "llm", "model_dir": D, "engine": {...}, "requests": [...], "arms": [...]}`: a
  real `vllm.LLM` per arm on a tiny local checkpoint (written with transformers when D
  has none), requests added at their `arrival_step` (and aborted at their `abort_step`, or
  with `abort_loading` the first time a KV connector is loading their KV, as a client that
  goes away) and the engine stepped by hand.
  An arm is `{"name": ..., "scheduler": "default" | "preempt", "policy": "fcfs" |
  "priority", "settings": {...}}`. Result per arm: per request its output token ids,
  arrival, first-token and finish steps, the steps it entered the running batch and was
  preempted at, how many steps began while its KV was being loaded; totals (steps, preemptions and recomputed
  tokens seen at `_preempt_request`, vLLM's own `vllm:num_preemptions` and the plugin's
  `preempt:*` counters read from the same Prometheus registry, wall time).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

from preempt.integrations.vllm.settings import PLUGIN_CLS
from preempt.model.random_llama import write_random_llama


# ----------------------------------------------------------------- decisions
def run_decisions(job: dict, model_dir: str) -> dict:
    from preempt.integrations.vllm.clock import ReplayClock
    from preempt.integrations.vllm.scheduler import PreemptAsyncScheduler, PreemptScheduler
    from preempt.parity.vllm_peer import _build_scheduler, run_job

    holder = {}

    def build(workload, policy, directory):
        scheduler, effective = _build_scheduler(
            workload,
            "priority",  # requests carry priorities; the plugin orders and picks victims itself
            directory,
            # the same policy on vLLM's AsyncScheduler, driven one step at a time
            scheduler_cls=PreemptAsyncScheduler if job.get("async_scheduler") else PreemptScheduler,
            additional_config={"preempt": job.get("settings", {})},
        )
        clock = job["clock"]
        scheduler.clock = ReplayClock(clock["starts_s"], clock["durations_s"])
        holder["scheduler"] = scheduler
        return scheduler, effective

    result = run_job(job["workload"], "priority", model_dir, build=build)
    result["metrics"] = holder["scheduler"].plugin_metrics()
    return result


# ----------------------------------------------------------------- a real LLM
def _in_process_scheduler(llm):
    # VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core (and its scheduler) live here.
    return llm.llm_engine.engine_core.engine_core.scheduler


def _metric_values(names: tuple[str, ...]) -> dict[str, float]:
    from prometheus_client import REGISTRY

    values: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name in names:
                key = sample.name
                reason = sample.labels.get("reason")
                if reason:
                    key += "{reason=" + reason + "}"
                values[key] = values.get(key, 0.0) + sample.value
    return values


LOADING = "WAITING_FOR_REMOTE_KVS"  # vLLM's status while a KV connector loads a request's KV


def _external(request_id: str) -> str:
    """The id given to `add_request` (vLLM's engine appends `-<8 random characters>`)."""
    return request_id.rsplit("-", 1)[0]


def _statuses(scheduler) -> dict[str, str]:
    """Each request's status in the scheduler by the id given to `add_request`."""
    return {_external(rid): request.status.name for rid, request in scheduler.requests.items()}


def run_arm(job: dict, arm: dict, model_dir: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = job["engine"]
    kwargs = {}
    if arm["scheduler"] == "preempt":
        kwargs["scheduler_cls"] = PLUGIN_CLS
        kwargs["additional_config"] = {"preempt": arm.get("settings", {})}
    if arm.get("connector") is not None:  # preempt's KV connector, with these settings
        from preempt.integrations.vllm.kv_store import CONNECTOR_MODULE, kv_transfer_config

        kwargs["kv_transfer_config"] = kv_transfer_config(
            arm["connector"],
            module_path=arm.get("connector_module", CONNECTOR_MODULE),
            connector=arm.get("connector_cls", "PreemptKVConnector"),
        )
    started = time.perf_counter()
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype=engine.get("dtype", "bfloat16"),
        enforce_eager=True,
        seed=0,
        block_size=engine["block_size"],
        num_gpu_blocks_override=engine["num_gpu_blocks"],
        max_model_len=engine["max_model_len"],
        max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        # preempt has no prefix cache: recompute is recompute (the connector's tests turn it on)
        enable_prefix_caching=engine.get("prefix_caching", False),
        scheduling_policy=arm.get("policy", "fcfs"),
        disable_log_stats=False,
        **kwargs,
    )
    start_s = time.perf_counter() - started
    scheduler = _in_process_scheduler(llm)
    seen = {"preemptions": 0, "recomputed_tokens": 0}
    original = scheduler._preempt_request

    def counting(request, *args, **kw):
        seen["preemptions"] += 1
        seen["recomputed_tokens"] += request.num_computed_tokens
        if _external(request.request_id) in records:
            records[_external(request.request_id)]["preempted_steps"].append(step)
        return original(request, *args, **kw)

    scheduler._preempt_request = counting
    names = ("vllm:num_preemptions_total", "preempt:preemptions_total", "preempt:recomputed_tokens_total",
             "preempt:kv_saves_total", "preempt:kv_loads_total", "preempt:kv_fallbacks_total",
             "preempt:kv_preempted_tokens_total", "preempt:kv_loaded_tokens_total",
             "preempt:kv_early_tokens_total", "preempt:kv_resume_waits_total")  # fmt: skip
    before = _metric_values(names)  # counters are per process: arms before this one added to them
    uses_priority = arm["scheduler"] == "preempt" or arm.get("policy") == "priority"
    pending = sorted(job["requests"], key=lambda r: (r["arrival_step"], r["id"]))
    engine_obj = llm.llm_engine
    records: dict[str, dict] = {}
    running: set[str] = set()
    step = 0
    next_index = 0
    run_started = time.perf_counter()
    while next_index < len(pending) or engine_obj.has_unfinished_requests():
        while next_index < len(pending) and pending[next_index]["arrival_step"] <= step:
            spec = pending[next_index]
            next_index += 1
            req_id = f"{spec['id']:08d}"
            engine_obj.add_request(
                req_id,
                TokensPrompt(prompt_token_ids=spec["prompt_token_ids"]),
                SamplingParams(
                    max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False
                ),
                priority=spec["priority"] if uses_priority else 0,
            )
            records[req_id] = {
                "id": spec["id"],
                "priority": spec["priority"],
                "arrival_step": step,
                "first_token_step": None,
                "finish_step": None,
                "token_ids": [],
                "abort_step": spec.get("abort_step"),
                "abort_loading": spec.get("abort_loading", False),
                "aborted": False,
                "aborted_while": None,
                "admitted_steps": [],  # steps that put it in the running batch (again)
                "preempted_steps": [],
                "loading_steps": 0,  # steps begun while a KV connector loaded its KV
            }
        # a client that goes away: the request is aborted between steps, as vLLM's server
        # does, at a given step or (abort_loading) the first time its KV is being loaded
        statuses = _statuses(scheduler)
        for rid, status in statuses.items():
            if status == LOADING and rid in records:
                records[rid]["loading_steps"] += 1
        aborts = [
            rid
            for rid, r in records.items()
            if r["finish_step"] is None
            and (r["abort_step"] == step or (r["abort_loading"] and statuses.get(rid) == LOADING))
        ]
        if aborts:
            for rid in aborts:
                records[rid].update(aborted=True, finish_step=step, aborted_while=statuses.get(rid))
            engine_obj.abort_request(aborts)
        outputs = engine_obj.step()
        now_running = {_external(r.request_id) for r in scheduler.running}
        for rid in now_running - running:
            if rid in records:
                records[rid]["admitted_steps"].append(step)
        running = now_running
        for out in outputs:
            record = records[out.request_id]
            token_ids = list(out.outputs[0].token_ids)
            if token_ids and record["first_token_step"] is None:
                record["first_token_step"] = step
            record["token_ids"] = token_ids
            if out.finished:
                record["finish_step"] = step
        step += 1
        if step > 200_000:
            raise RuntimeError("no end after 200000 steps")
    run_s = time.perf_counter() - run_started
    after = _metric_values(names)
    metrics = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    result = {
        "name": arm["name"],
        "start_s": start_s,
        "run_s": run_s,
        "steps": step,
        "preemptions": seen["preemptions"],
        "recomputed_tokens": seen["recomputed_tokens"],
        "prometheus": metrics,
        "plugin": scheduler.plugin_metrics() if hasattr(scheduler, "plugin_metrics") else None,
        "requests": sorted(records.values(), key=lambda r: r["id"]),
    }
    del scheduler, engine_obj, llm
    gc.collect()
    return result


def run_llm(job: dict) -> dict:
    # "served": the HTTP bench's byte-level model, whose peaked logits keep greedy tokens
    # stable across batch shapes (outputs are compared token for token)
    model_dir = str(write_random_llama(Path(job["model_dir"]), job.get("model", "tiny")))
    return {"arms": [run_arm(job, arm, model_dir) for arm in job["arms"]]}


def main() -> int:
    import tempfile

    import vllm

    from preempt.parity.vllm_peer import _MODEL_CONFIG

    jobs = json.load(sys.stdin)
    # vLLM logs to stdout; the report alone goes there, everything else to stderr.
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    results = []
    with tempfile.TemporaryDirectory(prefix="preempt-plugin-") as config_dir:
        (Path(config_dir) / "config.json").write_text(
            json.dumps({**_MODEL_CONFIG, "max_position_embeddings": 1 << 20})
        )
        for job in jobs:
            try:
                if job["kind"] == "decisions":
                    results.append(run_decisions(job, config_dir))
                elif job["kind"] == "llm":
                    results.append(run_llm(job))
                else:
                    results.append({"error": f"unknown job kind {job['kind']!r}"})
            except Exception as err:  # noqa: BLE001 - reported per job, the others still run
                results.append({"error": f"{type(err).__name__}: {err}"})
    json.dump({"vllm_version": vllm.__version__, "results": results}, report)
    report.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # GiB of KV memory: vLLM's CPU backend would otherwise reserve 92% of the machine's.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main())
