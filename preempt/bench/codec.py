"""`preempt bench codec`: the mixed-precision KV codec (`swap_mixed`), plan by plan.

For each head plan (uniform FP16 and FP8 (the baseline), each newer class uniformly
(FP8 per-token scales, KIVI 4/2-bit, KIVI with 5/6/8-bit keys and 4-bit values), a seeded
random plan with the design's shares and an importance plan when one is given, and, for a
trained model, the budget plans: restored-prefix sensitivity at <= `BUDGET` x FP16 and the
same classes placed by gradient-gate importance and at random over `NUM_RANDOM` seeds),
on real KV from the model:

- Size: every stored byte of a request of the prompt's length relative to its 16-bit KV
  (`size_vs_fp16`: scales, KIVI params and full-precision sink/recent tokens included, at
  a 16-bit cache dtype, what a GPU deployment stores) and the blob's measured bytes over
  the raw KV of this run's cache dtype (`blob_vs_raw`, header and scales included).
- Quality after a save/restore at the end of the prompt, against the same request never
  preempted: `greedy_agreement` (share of the next 64 greedy tokens equal to the
  unpreempted run's, position by position, generating freely), `prefix_match` (tokens
  until the first difference / 64), and teacher-forced on the unpreempted continuation,
  `kl_mean` (mean KL(p_ref || p_restored) of next-token distributions, nats) and
  `top1_agreement`. The restore follows the engine: the restored prefix of dropped heads
  masked for the rest of the request, the last `warmup_tokens` recomputed at full
  precision (and visible to every head). Each plan's row keeps `greedy_agreement`,
  `kl_mean` and `top1_agreement` per prompt too (`per_prompt`, the same prompt order in
  every row), so plans can be compared prompt by prompt; whether the sensitivity plan beats
  uniform FP8 is judged from those pairs with 95% intervals in the claims report
  (`preempt report --codec PATH`, experiments/claims/rules.py), not from the means here: over a
  few prompts the means' order flips with the number of prompts.
- CPU speed on `CPU_THREADS` torch thread(s) (`cpu_threads` in the JSON; encode, decode
  and clone alike): encode (quantize + pack into blob parts) and decode (unpack +
  dequantize into blocks) MB/s of raw KV, against `torch.clone` of the same tensor timed
  alternately with it, for a 2048-token request (`encode_vs_clone`: cache-resident, clone
  near memory bandwidth) and a 32k-token one (`encode_vs_clone_long`). One thread: on the
  two shared cores these run on, a second intra-op thread speeds clone up more than the
  codec (many small ops), so it would not raise the ratio.
- The same speed columns at the KV shape of a real served model (`served_model_speed`:
  Llama-3-8B's 32 layers x 8 KV heads x 128 channels at bfloat16, seeded synthetic KV,
  2048 and 8192 tokens, i.e. 268 MB and 1.07 GB; quick: 256 tokens). The tiny LM's
  2048-token KV (8 MB) stays in the CPU caches, a served model's does not: that is the
  size a real save moves.

Prompts are held-out text (the LM corpus's test split: Python stdlib sources); the
sensitivity and gate scores that choose the budget plans come from the validation split.
Quality numbers mean something only for a trained model (`--model runs/lm/lm.pt`); with
the seeded random preset the JSON says so.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from preempt.bench.save import _median_s
from preempt.core.config import build_config
from preempt.core.request import Request, ScheduledChunk
from preempt.engine.model_runner import TinyModelRunner
from preempt.kernels.plan import HeadClass, HeadPlan, size_vs_fp16
from preempt.kernels.quantize_heads import quantize_heads
from preempt.kernels.restore_blocks import restore_blocks
from preempt.kv.codec import MixedCodec

MB = 1e6
BLOCK_SIZE = 16
BUDGET = 0.35  # the target: <= 0.35x of FP16 at uniform FP8's quality or better
NUM_RANDOM = 5  # random placements of the sensitivity plan's classes: the seed-to-seed spread
KIVI_PARAMS = (64, 4, 8)  # (group_size, num_sink, num_recent) of every KIVI plan here
# The classes a budget plan may use (FP16 always): what the sensitivity scan prices.
BUDGET_CLASSES = ("fp8", "kivi4", "kivi_k5v4", "kivi_k6v4", "kivi_k8v4", "drop")
UNIFORM_CLASSES = ("fp8_token", "kivi4", "kivi2", "kivi_k5v4", "kivi_k6v4")
# The KV shape of a real served model (L, KV heads, head_dim): what a save of one of its
# requests moves (a 2048-token request is 268 MB at 16 bits), unlike the tiny LM's KV,
# which stays in the CPU caches at that length.
SERVED_MODEL = ("Llama-3-8B", 32, 8, 128)
SERVED_DTYPE = torch.bfloat16  # Llama-3's own dtype, as a served cache holds it
SERVED_CLASSES = ("fp8", "kivi4", "kivi_k5v4", "kivi_k6v4")  # uniform plans timed at that shape
CPU_THREADS = 1  # torch intra-op threads for everything timed (module doc)
# Quality kept per prompt in every plan's row (`per_prompt`), besides the means.
PER_PROMPT_KEYS = ("greedy_agreement", "kl_mean", "top1_agreement")
VERDICT = (
    "judged in the claims report, not here: `preempt report --codec PATH` pairs budget_sensitivity "
    "with fp8 prompt by prompt (`per_prompt`) with 95% intervals (experiments/claims/rules.py, codec_budget)"
)


def bench_codec(
    quick: bool,
    model: str | None = None,
    plan: str | None = None,
    warmup_tokens: int = 2,
    served_speed: bool = True,
    speed: bool = True,
    num_prompts: int | None = None,
) -> dict[str, Any]:
    """The module doc's table, one row per plan. `speed=False`: size and quality only (no
    CPU speed columns, no served-shape section); `num_prompts`: quality over this many
    prompts (16; quick 4). The main job takes both (32 prompts: preempt/cli/main_job.py)."""
    torch.set_num_threads(CPU_THREADS)  # comparable across machines; quality does not depend on it
    default_prompts, prompt_len, num_gen = (4, 256, 32) if quick else (16, 512, 64)
    num_prompts = num_prompts or default_prompts
    runner = _runner(model, num_blocks=4 * (prompt_len + num_gen + BLOCK_SIZE) // BLOCK_SIZE)
    cfg = runner.model.cfg
    plans = _plans(cfg.num_layers, cfg.num_kv_heads, plan)
    budget_info = None
    if model:
        budget_plans, budget_info = _budget_plans(model, prompt_len, num_gen, warmup_tokens, quick)
        plans.update(budget_plans)
    prompts = _prompts(num_prompts, prompt_len)
    references = [_reference(runner, prompt, num_gen) for prompt in prompts]
    result: dict[str, Any] = {
        "model": model
        or f"random {build_config({}).model.preset} (untrained: quality numbers are meaningless)",
        "model_dtype": str(runner.model.dtype).removeprefix("torch."),
        "num_layers": cfg.num_layers,
        "num_kv_heads": cfg.num_kv_heads,
        "prompts": f"{num_prompts} x {prompt_len} bytes of held-out text (LM corpus test split)",
        "num_generated": num_gen,
        "warmup_tokens": warmup_tokens,
        "cpu_threads": torch.get_num_threads(),
        "plans": {},
    }
    sizes = _speed_sizes(quick) if speed else {}
    speed_kvs = {name: _tiled(references[0]["kv"], tokens) for name, tokens in sizes.items()}
    result["speed_sizes"] = {
        name: {"num_tokens": kv.shape[2], "kv_mb": round(kv.nbytes / MB, 1)} for name, kv in speed_kvs.items()
    }
    for name, head_plan in plans.items():
        quality = [_quality(runner, head_plan, ref, warmup_tokens) for ref in references]
        row: dict[str, Any] = {
            "source": head_plan.source or name,
            "fp16_heads": head_plan.num_fp16,
            "fp8_heads": head_plan.num_fp8,
            "dropped_heads": head_plan.num_drop,
            "classes": _class_counts(head_plan),
            "size_vs_fp16": round(size_vs_fp16(head_plan, prompt_len, cfg.head_dim), 4),
            "blob_vs_raw": round(float(np.mean([q["blob_vs_raw"] for q in quality])), 4),
        }
        for key in ("greedy_agreement", "prefix_match", "top1_agreement", "kl_mean"):
            row[key] = float(f"{np.mean([q[key] for q in quality]):.4g}")
        # prompt by prompt, in `prompts` order for every plan: a judge pairs plans by prompt
        row["per_prompt"] = {key: [float(f"{q[key]:.6g}") for q in quality] for key in PER_PROMPT_KEYS}
        for size, kv in speed_kvs.items():
            speed = _speed(kv, head_plan)
            row.update(speed if size == "short" else {f"{k}_{size}": v for k, v in speed.items()})
        result["plans"][name] = row
    if budget_info is not None:
        result["budget"] = {**budget_info, **_budget_summary(result["plans"])}
    if speed and served_speed:  # the section takes minutes
        result["served_model_speed"] = _served_model_speed(quick, plans.get("budget_sensitivity"))
    return result


def _class_counts(plan: HeadPlan) -> dict[str, int]:
    return {cls.label: plan.count(cls) for cls in HeadClass if plan.count(cls)}


def _budget_plans(
    model: str, prompt_len: int, num_gen: int, warmup_tokens: int, quick: bool
) -> tuple[dict[str, HeadPlan], dict[str, Any]]:
    """Restored-prefix sensitivity -> the plan under BUDGET; the same classes placed by
    gradient-gate importance and at NUM_RANDOM seeded random placements. Scores come from
    the validation split (the quality rows from the test split)."""
    import time

    from preempt.lm import importance
    from preempt.lm.corpus import Corpus, sample_windows
    from preempt.model.checkpoint import load_tiny_lm

    started = time.perf_counter()
    lm = load_tiny_lm(model, dtype=torch.float32)
    num_windows = 4 if quick else 8
    windows = sample_windows(Corpus().stream("val"), num_windows, prompt_len + num_gen, seed=1)
    scores = importance.prefix_sensitivity(
        lm, windows, prompt_len, BUDGET_CLASSES, KIVI_PARAMS, warmup_tokens=warmup_tokens
    )
    sizes = importance.class_sizes(BUDGET_CLASSES, prompt_len, lm.cfg.head_dim, KIVI_PARAMS)
    source = f"restored-prefix sensitivity (KL after a {prompt_len}-token prefix, {num_windows} val windows)"
    chosen = importance.plan_for_budget(scores, sizes, BUDGET, params=KIVI_PARAMS, source=source)
    sensitivity_s = time.perf_counter() - started
    split = importance.key_value_split(
        lm, windows, prompt_len, ("fp8", "kivi4", "kivi_k5v4", "kivi_k6v4"), KIVI_PARAMS, warmup_tokens
    )
    calib = sample_windows(Corpus().stream("val"), 16 if quick else 64, 257, seed=0)
    gate = importance.kv_head_scores(importance.head_importance(lm, calib), lm.cfg.num_kv_heads).numpy()
    plans = {
        "budget_sensitivity": chosen,
        "budget_gate": importance.place_by_rank(chosen, gate, sizes, "gradient-gate importance placement"),
    }
    for seed in range(NUM_RANDOM):
        plans[f"budget_random_s{seed}"] = importance.place_at_random(chosen, seed)
    info = {
        "target_size_vs_fp16": BUDGET,
        "kivi_params": dict(zip(("group_size", "num_sink", "num_recent"), KIVI_PARAMS, strict=True)),
        "sensitivity_windows": f"{num_windows} x {prompt_len + num_gen} bytes (val split)",
        "sensitivity_kl": {k: np.round(v, 6).tolist() for k, v in scores.items()},
        "class_sizes_vs_fp16": {k: round(v, 4) for k, v in sizes.items()},
        "sensitivity_plan": chosen.to_dict()["layers"],
        # a head plan file as it is (`preemption.codecs.mixed.plan`)
        "sensitivity_plan_file": chosen.to_dict(),
        # every head at the class, only its keys / only its values / both quantized
        "key_value_split_kl": {k: {p: float(f"{v:.4g}") for p, v in row.items()} for k, row in split.items()},
        "scoring_s": round(time.perf_counter() - started, 1),
        "sensitivity_s": round(sensitivity_s, 1),
    }
    return plans, info


def _budget_summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Random placements' mean and spread (the sensitivity and gate placements are rows of
    their own), and where the sensitivity plan is judged against FP8 (`VERDICT`)."""
    randoms = [row for name, row in rows.items() if name.startswith("budget_random_s")]
    summary: dict[str, Any] = {}
    for key in ("greedy_agreement", "kl_mean", "top1_agreement"):
        values = np.array([row[key] for row in randoms])
        summary[f"random_{key}"] = {
            "mean": float(f"{values.mean():.4g}"),
            "std": float(f"{values.std(ddof=1):.4g}") if len(values) > 1 else 0.0,
            "min": float(f"{values.min():.4g}"),
            "max": float(f"{values.max():.4g}"),
        }
    # Not a verdict from the means here: over a few prompts it flips with their number.
    summary["sensitivity_vs_fp8"] = VERDICT
    return summary


# ---------------------------------------------------------------- setup


def _runner(model: str | None, num_blocks: int) -> TinyModelRunner:
    model_section: dict[str, Any] = {"backend": "tiny", "dtype": "float32", "num_threads": 1}
    if model:
        model_section["checkpoint"] = model
    return TinyModelRunner(build_config({"model": model_section}), num_blocks, BLOCK_SIZE)


def _plans(num_layers: int, num_kv_heads: int, plan_file: str | None) -> dict[str, HeadPlan]:
    plans = {
        "fp16": HeadPlan.all_fp16(num_layers, num_kv_heads),
        "fp8": HeadPlan.all_fp8(num_layers, num_kv_heads),
        **{
            label: HeadPlan.from_codes(
                np.full((num_layers, num_kv_heads), int(HeadClass[label.upper()])), label, KIVI_PARAMS
            )
            for label in UNIFORM_CLASSES
        },
        # The design's shares (10% dropped, 50% FP8): the control for an importance plan.
        "random": HeadPlan.random(num_layers, num_kv_heads, fp8_share=0.5, drop_share=0.1, seed=0),
    }
    if plan_file:
        plans["importance"] = HeadPlan.load(plan_file)
        plans["importance"].check_shape(num_layers, num_kv_heads)
        # The same class counts as the importance plan, placed at random: isolates what
        # the scores buy from what the shares buy.
        counts = plans["importance"]
        total = num_layers * num_kv_heads
        same_shares = HeadPlan.random(
            num_layers,
            num_kv_heads,
            fp8_share=counts.num_fp8 / total,
            drop_share=counts.num_drop / total,
            seed=0,
        )
        if same_shares.classes != plans["random"].classes:  # else `random` already is this control
            plans["random_same_shares"] = same_shares
    return plans


def _prompts(num_prompts: int, length: int) -> list[np.ndarray]:
    from preempt.lm.corpus import Corpus, sample_windows

    windows = sample_windows(Corpus().stream("test"), num_prompts, length, seed=0)
    return [w.astype(np.int32) for w in windows]


class _Blocks:
    """A trivial allocator over the runner's cache: fresh block ids for each sequence."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))

    def take(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // BLOCK_SIZE)
        taken, self.free = self.free[:count], self.free[count:]
        return taken


def _request(prompt: np.ndarray, num_gen: int) -> Request:
    return Request(0, 0.0, prompt, max_tokens=num_gen + 1, target_output_tokens=num_gen + 1)


def _step(runner: TinyModelRunner, request: Request, num_new: int) -> torch.Tensor:
    """Compute `num_new` tokens of `request` -> log-probs (V,) of the next token."""
    logits = runner.compute_logits([ScheduledChunk(request, num_new)])[0]
    request.num_computed_tokens += num_new
    return torch.log_softmax(logits.double(), dim=-1)


# ---------------------------------------------------------------- quality


def _reference(runner: TinyModelRunner, prompt: np.ndarray, num_gen: int) -> dict[str, Any]:
    """The unpreempted run: prefill, then greedy tokens t0..t_num_gen with the distribution
    each was drawn from; also the prompt's KV (L, 2, P, H, D): what a preemption right
    after t0 was sampled saves (in the engine, a decoding request's newest token has no
    KV yet, so the restore recomputes at least that one)."""
    request = _request(prompt, num_gen)
    request.block_ids = _Blocks(runner.kv_cache.num_blocks).take(len(prompt) + num_gen + 1)
    logprobs = [_step(runner, request, len(prompt))]
    kv = runner.kv_cache.read_blocks(request.block_ids[: -(-len(prompt) // BLOCK_SIZE)])
    kv = kv.flatten(2, 3)[:, :, : len(prompt)].clone()
    tokens = []
    for i in range(num_gen + 1):
        tokens.append(int(logprobs[-1].argmax()))
        request.output_token_ids.append(tokens[-1])
        if i < num_gen:
            logprobs.append(_step(runner, request, 1))
    return {"prompt": prompt, "tokens": tokens, "logprobs": logprobs, "kv": kv, "num_gen": num_gen}


def _restored(
    runner: TinyModelRunner, plan: HeadPlan, ref: dict[str, Any], warmup: int
) -> tuple[Request, torch.Tensor, float]:
    """The request preempted after sampling t0, restored through the mixed codec into
    fresh blocks as the engine does (dropped heads' restored prefix masked, the last
    `warmup` saved tokens recomputed with t0) -> (request, log-probs of t1, blob bytes / raw bytes)."""
    prompt, kv = ref["prompt"], ref["kv"]
    codec = MixedCodec(plan)
    blob = codec.encode(kv)
    quantized = codec.decode_quantized(blob)
    request = _request(prompt, ref["num_gen"])
    request.block_ids = _Blocks(runner.kv_cache.num_blocks).take(len(prompt) + ref["num_gen"] + 1)
    dropped = restore_blocks(quantized, runner.kv_cache.kv, request.block_ids).numpy()
    request.output_token_ids.append(ref["tokens"][0])
    request.num_computed_tokens = len(prompt) - min(warmup, len(prompt))
    if dropped.any():  # as the saver does: the restored prefix of dropped heads stays masked
        request.kv_masked_until = np.where(dropped, request.num_computed_tokens, 0)
    logprobs = _step(runner, request, request.num_tokens - request.num_computed_tokens)
    return request, logprobs, len(blob) / kv.nbytes


def _quality(runner: TinyModelRunner, plan: HeadPlan, ref: dict[str, Any], warmup: int) -> dict[str, float]:
    num_gen, ref_tokens, ref_logprobs = ref["num_gen"], ref["tokens"], ref["logprobs"]
    # Teacher-forced on the reference continuation: the distribution shift token by token.
    request, logprobs, blob_vs_raw = _restored(runner, plan, ref, warmup)
    kls, top1 = [], []
    for i in range(1, num_gen + 1):
        kls.append(float((ref_logprobs[i].exp() * (ref_logprobs[i] - logprobs)).sum()))
        top1.append(int(logprobs.argmax()) == ref_tokens[i])
        if i < num_gen:
            request.output_token_ids.append(ref_tokens[i])
            logprobs = _step(runner, request, 1)
    # Free-running greedy generation: what a user would see.
    request, logprobs, _ = _restored(runner, plan, ref, warmup)
    generated = []
    for i in range(1, num_gen + 1):
        generated.append(int(logprobs.argmax()))
        if i < num_gen:
            request.output_token_ids.append(generated[-1])
            logprobs = _step(runner, request, 1)
    same = [a == b for a, b in zip(generated, ref_tokens[1:], strict=True)]
    prefix = next((i for i, ok in enumerate(same) if not ok), num_gen)
    return {
        "blob_vs_raw": blob_vs_raw,
        "kl_mean": float(np.mean(kls)),
        "top1_agreement": float(np.mean(top1)),
        "greedy_agreement": float(np.mean(same)),
        "prefix_match": prefix / num_gen,
    }


# ---------------------------------------------------------------- speed


def _speed_sizes(quick: bool) -> dict[str, int]:
    """Request lengths timed: `short` (2048 tokens: its KV fits this CPU's caches, so
    `torch.clone` runs near memory-bandwidth speed) and `long` (32k tokens, quick 4096:
    a long request's KV, as a save meets it, where fresh pages cost clone and codec alike)."""
    return {"short": 2048, "long": 4096 if quick else 32768}


def _tiled(kv: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The prompt's KV tiled along tokens to `num_tokens` (L, 2, T, H, D): real values,
    a request of that length (per-call overheads would dominate a few hundred tokens)."""
    reps = -(-num_tokens // kv.shape[2])
    return kv.repeat(1, 1, reps, 1, 1)[:, :, :num_tokens].contiguous()


def _paired_s(fn, baseline, repeats: int = 5) -> tuple[float, float]:
    """Median seconds of `fn` and of `baseline`, timed alternately: on a shared machine
    both see the same load, so their ratio is steadier than two separate runs'."""
    fn()  # warm-up: first-touch allocations, lazily built tables
    fn_s, base_s = [], []
    for _ in range(repeats):
        base_s.append(_median_s(baseline, 1))
        fn_s.append(_median_s(fn, 1))
    return float(np.median(fn_s)), float(np.median(base_s))


def _speed(kv: torch.Tensor, plan: HeadPlan, repeats: int = 5) -> dict[str, float]:
    """Encode (quantize + pack into blob parts) and decode (blob -> dequantized into paged
    blocks) MB/s of raw KV, each against `torch.clone` of the same tensor timed alongside."""
    codec = MixedCodec(plan)
    num_layers, _, num_tokens, num_heads, head_dim = kv.shape
    cache = torch.zeros(
        num_layers, 2, -(-num_tokens // BLOCK_SIZE), BLOCK_SIZE, num_heads, head_dim, dtype=kv.dtype
    )
    block_ids = list(range(cache.shape[2]))

    def encode() -> list:
        return codec.encode_quantized(quantize_heads(kv, plan))

    blob = b"".join(bytes(memoryview(p)) for p in encode())

    def decode() -> None:
        restore_blocks(codec.decode_quantized(blob), cache, block_ids)

    encode_s, clone_enc_s = _paired_s(encode, kv.clone, repeats)
    decode_s, clone_dec_s = _paired_s(decode, kv.clone, repeats)
    return {
        "encode_mb_s": round(kv.nbytes / encode_s / MB, 1),
        "decode_mb_s": round(kv.nbytes / decode_s / MB, 1),
        "clone_mb_s": round(kv.nbytes / clone_enc_s / MB, 1),
        "encode_vs_clone": round(clone_enc_s / encode_s, 3),
        "decode_vs_clone": round(clone_dec_s / decode_s, 3),
    }


def _served_sizes(quick: bool) -> dict[int, int]:
    """Request lengths timed at the served model's shape -> medians of how many pairs: 2048
    tokens (268 MB at 16 bits) and 8192 (1.07 GB: 3 pairs, each encode takes seconds);
    quick: 256 tokens (34 MB), the section's shape checked, not its speed."""
    return {256: 2} if quick else {2048: 5, 8192: 3}


def _served_model_speed(quick: bool, budget_plan: HeadPlan | None) -> dict[str, Any]:
    """Encode / decode against `torch.clone` (`_speed`) of seeded synthetic KV at the KV
    shape of a real served model (`SERVED_MODEL`, `SERVED_DTYPE`): uniform plans of
    `SERVED_CLASSES`, and the sensitivity budget plan's classes tiled over its heads when
    there is one (a trained LM). Speed, not quality: the values only need a realistic spread."""
    name, num_layers, num_heads, head_dim = SERVED_MODEL
    plans = {
        label: HeadPlan.from_codes(
            np.full((num_layers, num_heads), int(HeadClass[label.upper()])), label, KIVI_PARAMS
        )
        for label in SERVED_CLASSES
    }
    if budget_plan is not None:
        plans["budget_sensitivity"] = _tile_plan(budget_plan, num_layers, num_heads)
    result: dict[str, Any] = {
        "model": name,
        "num_layers": num_layers,
        "num_kv_heads": num_heads,
        "head_dim": head_dim,
        "kv_dtype": str(SERVED_DTYPE).removeprefix("torch."),
        "kv_values": _SERVED_VALUES,
        "budget_placement": "the sensitivity plan's (layer, head) grid tiled over the heads"
        if budget_plan is not None
        else "none (the budget plans need a trained LM: --model)",
        "cpu_threads": torch.get_num_threads(),
        "sizes": {},
    }
    for num_tokens, repeats in _served_sizes(quick).items():
        kv = _served_kv(num_layers, num_heads, head_dim, num_tokens)
        rows = {}
        for label, plan in plans.items():
            rows[label] = {
                "classes": _class_counts(plan),
                "size_vs_fp16": round(size_vs_fp16(plan, num_tokens, head_dim), 4),
                **_speed(kv, plan, repeats),
            }
        result["sizes"][str(num_tokens)] = {
            "num_tokens": num_tokens,
            "kv_mb": round(kv.nbytes / MB, 1),
            "repeats": repeats,
            "plans": rows,
        }
        del kv
    return result


_SERVED_VALUES = (
    "seeded normal: values N(0, 1); keys N(0, 1) with 4 outlier channels per (layer, head) "
    "scaled x10 and a per-channel offset N(0, 1) (KIVI's fixed outlier channels in keys)"
)


def _served_kv(num_layers: int, num_heads: int, head_dim: int, num_tokens: int) -> torch.Tensor:
    """(L, 2, T, H, D) of `SERVED_DTYPE`, as `_SERVED_VALUES` says, generated in place."""
    gen = torch.Generator().manual_seed(num_tokens)
    kv = torch.empty(num_layers, 2, num_tokens, num_heads, head_dim, dtype=SERVED_DTYPE)
    channel_scale = torch.ones(num_layers, num_heads, head_dim)
    outliers = torch.randint(0, head_dim, (num_layers, num_heads, 4), generator=gen)
    channel_scale.scatter_(2, outliers, 10.0)
    offset = torch.randn(num_layers, num_heads, head_dim, generator=gen)
    for layer in range(num_layers):  # one float32 layer at a time: no full-size float32 copy
        x = torch.randn(2, num_tokens, num_heads, head_dim, generator=gen)
        x[0].mul_(channel_scale[layer]).add_(offset[layer])
        kv[layer].copy_(x)
    return kv


def _tile_plan(plan: HeadPlan, num_layers: int, num_heads: int) -> HeadPlan:
    """`plan`'s (L, H) class grid repeated over a (num_layers, num_heads) model, cropped
    where it does not divide: the same class shares (exact when it divides), placed
    deterministically."""
    codes = plan.codes()
    reps = (-(-num_layers // codes.shape[0]), -(-num_heads // codes.shape[1]))
    tiled = np.tile(codes, reps)[:num_layers, :num_heads]
    return plan.with_classes(tiled, f"{plan.source}, tiled to {num_layers} x {num_heads} heads")
