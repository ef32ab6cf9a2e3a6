"""`preempt bench save`: the KV save/restore path on real KV from the tiny model.

Three measurements, each against a baseline taken in the same run:
1. Codec throughput: save (gather + encode + store into the host pool) and restore (load
   + decode + scatter) MB/s per codec, and compression ratio, against `torch.clone` of
   the same bytes.
2. Overlap on the wall clock: engine decode steps while a zstd save runs on the saver's
   worker thread, against steps alone and the save alone: the share of the save hidden.
3. Soak: the whole azure-conv hour at 4x on the `null` backend with priority preemption,
   a small host pool and a small KV pool, so that every failure path is reached; checks
   that accounting never drifts and every request ends in a final state.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Any

import numpy as np
import torch

from preempt.core.config import build_config
from preempt.core.request import Request
from preempt.engine.engine import Engine
from preempt.kv.saver import Saver

MB = 1e6


def _long_request(request_id: int, num_tokens: int, max_tokens: int = 64) -> Request:
    rng = np.random.default_rng(request_id)
    return Request(
        request_id=request_id,
        arrival_s=0.0,
        prompt_token_ids=rng.integers(32, 127, size=num_tokens, dtype=np.int32),
        max_tokens=max_tokens,
        target_output_tokens=max_tokens,
    )


def _prefill(engine: Engine, requests: list[Request]) -> None:
    for request in requests:
        engine.add_request(request)
        if request.state.is_final:
            raise ValueError(f"bench request {request.request_id} was rejected: {request.abort_reason}")
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests):
        engine.step()


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _codec_throughput(num_tokens: int, repeats: int, dtype: str) -> dict[str, Any]:
    overrides = {
        "model": {"backend": "tiny", "dtype": dtype, "max_model_len": num_tokens + 64},
        "cache": {"num_blocks": 2 * (num_tokens // 16 + 8)},
        "scheduler": {"max_num_batched_tokens": 4096},
        "preemption": {"mode": "swap", "host_mem": "1GB", "slot_size": "1GB"},
    }
    engine = Engine(build_config(overrides))
    request = _long_request(0, num_tokens)
    _prefill(engine, [request])
    kv_cache, pool = engine.runner.kv_cache, engine.block_pool
    kv = kv_cache.read_blocks(request.block_ids[: -(-request.num_computed_tokens // engine.block_size)])
    nbytes = kv.numel() * kv.element_size()
    clone_s = _median_s(lambda: kv.clone(), repeats)
    result: dict[str, Any] = {
        "kv_dtype": dtype,
        "kv_bytes": nbytes,
        "kv_shape": list(kv.shape),
        "clone_mb_s": round(nbytes / clone_s / MB, 1),
        "codecs": {},
    }
    variants = {  # name -> (codec, its options): every lossless codec, as a save uses it
        "raw": ("raw", {}),
        "zstd": ("zstd", {"shuffle": False}),
        "zstd_shuffle": ("zstd", {"shuffle": True}),
        "zstd_shuffle_2threads": ("zstd", {"shuffle": True, "threads": 2}),
        "lz4": ("lz4", {"shuffle": False}),
        "lz4_shuffle": ("lz4", {"shuffle": True}),
    }
    for name, (codec, options) in variants.items():
        preemption = {**overrides["preemption"], "codecs": {codec: options}}
        config = build_config({**overrides, "preemption": preemption})
        saver = Saver(config, kv_cache, engine.cost_model, engine.block_size)
        original_blocks = list(request.block_ids)
        save_times, restore_times, stored = [], [], 0
        for _ in range(repeats):
            started = time.perf_counter()
            saved = saver.save(request, codec, 0.0)
            assert saved.failure is None, saved.failure
            stored = saved.bytes_stored.result()  # the blob is stored once this returns
            save_times.append(time.perf_counter() - started)
            request.block_ids = pool.allocate(len(original_blocks))  # restore into fresh blocks
            started = time.perf_counter()
            assert saver.restore(request, 0.0).ok
            restore_times.append(time.perf_counter() - started)
            pool.free(request.block_ids)
            request.block_ids = original_blocks
        save_s, restore_s = statistics.median(save_times), statistics.median(restore_times)
        result["codecs"][name] = {
            "save_mb_s": round(nbytes / save_s / MB, 1),
            "restore_mb_s": round(nbytes / restore_s / MB, 1),
            "save_vs_clone": round(clone_s / save_s, 3),
            "restore_vs_clone": round(clone_s / restore_s, 3),
            "ratio": round(nbytes / stored, 4),
        }
    raw, plain, shuffled = (result["codecs"][k] for k in ("raw", "zstd", "zstd_shuffle"))
    result["targets"] = {
        "raw_save_vs_clone_ge_0.5": raw["save_vs_clone"] >= 0.5,
        "shuffle_beats_plain_zstd_ratio": shuffled["ratio"] > plain["ratio"],
        "shuffle_beats_plain_zstd_speed": shuffled["save_mb_s"] > plain["save_mb_s"],
    }
    return result


def _overlap(
    num_decoding: int, context: int, save_tokens: int, num_steps: int, num_threads: int
) -> dict[str, Any]:
    """Wall clock: is the worker's encode+store hidden behind the engine's steps?"""
    config = build_config(
        {
            "model": {
                "backend": "tiny",
                "dtype": "bfloat16",
                "num_threads": num_threads,
                "max_model_len": max(context + 5 * num_steps, save_tokens) + 256,
            },
            "cache": {"num_blocks": (num_decoding * (context + 64) + save_tokens) // 16 + 64},
            "clock": {"kind": "wall"},
            "scheduler": {"max_num_seqs": num_decoding + 1, "max_num_batched_tokens": 4096},
            "preemption": {"mode": "swap_zstd", "host_mem": "1GB", "slot_size": "1GB"},
        }
    )
    engine = Engine(config)
    # Enough output budget that nobody finishes during the 1 + 3 + 3 timed rounds of steps.
    decoding = [_long_request(i, context, max_tokens=5 * num_steps + 16) for i in range(num_decoding)]
    big = _long_request(num_decoding, save_tokens, max_tokens=2)  # still running after prefill
    _prefill(engine, [big])
    big_blocks = list(big.block_ids)
    engine.scheduler.running.remove(big)  # hold its KV outside the batch, as a victim's
    _prefill(engine, decoding)
    saver: Saver = engine.saver

    def steps() -> None:
        for _ in range(num_steps):
            engine.step()

    def save_and_wait() -> None:
        big.block_ids = big_blocks
        assert saver.save(big, "zstd", 0.0).failure is None
        saver.discard(big)  # waits for the worker, frees the slot

    steps()  # warm up
    steps_alone = _median_s(steps, 3)
    save_alone = _median_s(save_and_wait, 3)

    def combined() -> None:
        big.block_ids = big_blocks
        assert saver.save(big, "zstd", 0.0).failure is None  # gather here, encode on the worker
        steps()
        saver.discard(big)

    both = _median_s(combined, 3)
    engine.close()
    hidden = (steps_alone + save_alone - both) / save_alone
    return {
        "torch_threads": num_threads,
        "num_decoding": num_decoding,
        "context_tokens": context,
        "save_tokens": save_tokens,
        "steps": num_steps,
        "steps_alone_s": round(steps_alone, 4),
        "save_alone_s": round(save_alone, 4),
        "steps_with_save_s": round(both, 4),
        "save_hidden_fraction": round(hidden, 3),
        "target_hidden_fraction": 0.7,
    }


def _soak(rate_scale: float, duration_s: float | None) -> dict[str, Any]:
    config = build_config(
        {
            "model": {"backend": "null", "max_model_len": 16384},
            # 24k tokens of KV, 24 seats and a 1 GB host pool (4 slots of 256 MB of
            # Llama-3-8B KV): forced and priority preemptions, a full pool, blobs over a
            # slot and the consecutive limit all happen. The weights favour the SLA term so
            # that VIP arrivals do preempt (with the design's weights the age term lets
            # almost no new arrival win).
            "cache": {"num_blocks": 1500},
            "scheduler": {"policy": "priority_score", "max_num_seqs": 24},
            "workload": {"trace": "azure-conv", "rate_scale": rate_scale, "duration_s": duration_s},
            "preemption": {
                "mode": "swap_zstd",
                "host_mem": "1GB",
                "slot_size": "256MB",
                "priority_weights": {"age": 0.1, "sla": 2.0, "tokens": 0.5},
            },
        }
    )
    from preempt.core.workload import build_workload

    requests = build_workload(config.workload, seed=config.seed)
    engine = Engine(config)
    drift: list[str] = []

    def check(_output) -> None:
        try:
            engine.block_pool.check()
            engine.saver.host_pool.check()
        except Exception as err:  # noqa: BLE001 - report, do not crash the soak
            drift.append(str(err))

    started = time.perf_counter()
    engine.run(requests, on_step=check)
    wall_s = time.perf_counter() - started
    records = engine.scheduler.records
    states = Counter(r.state.value for r in requests)
    return {
        "num_requests": len(requests),
        "final_states": dict(states),
        "all_final": all(r.state.is_final for r in requests),
        "num_preemptions": engine.scheduler.num_preemptions,
        "preemptions_by_reason": dict(Counter(r.reason for r in records if r.action != "none")),
        "failures_by_reason": dict(Counter(r.failure for r in records if r.failure)),
        "num_preemption_failed_requests": engine.scheduler.num_preemption_failed,
        "num_restore_fallbacks": engine.scheduler.num_restore_fallbacks,
        "accounting_drift": drift[:3],
        "blocks_free_at_end": engine.block_pool.num_free == engine.block_pool.num_blocks,
        "host_slots_free_at_end": engine.saver.host_pool.num_used_slots == 0,
        "preemption_stall_s": round(engine.stall_s, 3),
        "sim_time_s": round(engine.clock.now(), 1),
        "wall_s": round(wall_s, 1),
    }


def bench_save(quick: bool = False) -> dict[str, Any]:
    cores = torch.get_num_threads()
    num_tokens, repeats = (4096, 2) if quick else (32768, 5)
    if quick:
        overlap = {"num_decoding": 8, "context": 256, "save_tokens": 4096, "num_steps": 5}
    else:
        overlap = {"num_decoding": 32, "context": 1024, "save_tokens": 32768, "num_steps": 20}
    result = {
        "bench": "save",
        # bf16 is the KV dtype of real deployments; the tiny model's default is float32.
        "codec_throughput_bf16": _codec_throughput(num_tokens, repeats, "bfloat16"),
        "codec_throughput_fp32": _codec_throughput(num_tokens, repeats, "float32"),
        # All cores to torch, then one core left to the save worker (model.num_threads).
        "overlap_all_cores": _overlap(**overlap, num_threads=cores),
        "overlap_one_core_for_worker": _overlap(**overlap, num_threads=max(1, cores - 1)),
        "soak_azure_conv_4x_null": _soak(4.0, 120.0 if quick else None),
    }
    torch.set_num_threads(cores)
    return result
