"""`preempt bench predictor`: the online predictor's cost per engine step (issue #6).

Protocol: a `null`-backend engine holds 256 decoding requests and 2,000 waiting ones (the
state of `preempt bench engine`'s scheduler overhead). Each timed iteration runs one
engine step, then computes the running requests' features (preempt.early.features) and runs
`OnlinePredictor.step` on them, with torch on one thread; all three are timed in the same
iteration, so load from other processes hits the baseline and the predictor alike.
Reported: medians over the iterations, the predictor's step as a fraction of the engine
step (target <= 5%), the same with the feature computation included (both feature sets),
the first step of 256 new requests (slot allocation), the step alone at other batch
sizes, and the amortized cost when the model steps every k engine steps (a checkpoint
trained on rows logged every k steps, `preempt collect --set features.every_k_steps=k`:
the engine's `lstm` policy then computes features and steps once per k steps).

Also timed on the same engine: the present-knowledge `forecast` (preempt.early.lookahead
with `knows_future=False`: fork the engine, simulate the policy over the horizon), every
`FORECAST_EVERY` iterations, as a fraction of the same engine step and amortized when it
forks every k steps (`early_save.lookahead_every_steps`); and the cheap forecast without
a fork (preempt.early.projection) at every iteration, against the `null` step on this CPU
and against the step the virtual clock models for the target at this batch (the host
work beside a real GPU step: the cost yardstick is <= 5% of it and <= one `null` step),
alone and with the learned output-length model's check (preempt.engine.lengths,
`confident_steps` over every projected step: the `projection_learned` policy's whole
host cost; the model fitted on azure-conv with max_tokens 1024).

The predictor has random weights: its cost does not depend on their values, and the
benchmark must not need a trained checkpoint.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from preempt.bench.engine import decoding_engine
from preempt.early.features import engine_features
from preempt.early.lookahead import Lookahead
from preempt.early.online_predictor import HIDDEN_SIZE, NUM_FEATURES, OnlinePredictor
from preempt.early.projection import Projection
from preempt.engine.lengths import LengthModel

TARGET_FRACTION = 0.05
# The forecast's horizon: the deployed checkpoints' (docs/archive/predictor-history.md: 50 ms or 4 steps).
FORECAST_HORIZON_MS, FORECAST_HORIZON_STEPS = 50.0, 4
FORECAST_EVERY = 10  # iterations between timed forecasts (a fork costs ~15 steps)


def random_predictor(seed: int = 0) -> OnlinePredictor:
    """An OnlinePredictor with freshly initialised weights (the design's shapes)."""
    generator = torch.Generator().manual_seed(seed)
    lstm = torch.nn.LSTM(NUM_FEATURES, HIDDEN_SIZE)
    head = torch.nn.Linear(HIDDEN_SIZE, 1)
    state = {
        f"lstm.{k}": torch.randn(v.shape, generator=generator) * 0.1 for k, v in lstm.state_dict().items()
    }
    state |= {
        f"head.{k}": torch.randn(v.shape, generator=generator) * 0.1 for k, v in head.state_dict().items()
    }
    state["feature_mean"] = torch.zeros(NUM_FEATURES)
    state["feature_std"] = torch.ones(NUM_FEATURES)
    return OnlinePredictor(state, threshold=0.5)


def _length_model() -> LengthModel:
    from preempt.core.config import WorkloadConfig

    workload = WorkloadConfig(trace="azure-conv", max_tokens_mode="fixed")
    return LengthModel.from_trace(workload, seed=0, exclude=(0.0, 0.0))


def _median_us(samples: list[float]) -> float:
    return round(1e6 * statistics.median(samples), 2)


def _step_alone(predictor: OnlinePredictor, num: int, reps: int) -> float:
    ids = list(range(10_000_000, 10_000_000 + num))
    features = np.random.default_rng(num).random((num, NUM_FEATURES), dtype=np.float32)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        predictor.step(ids, features)
        times.append(time.perf_counter() - started)
    predictor.forget(ids)
    return _median_us(times[reps // 5 :])  # the first calls allocate slots


def bench_predictor(quick: bool = False) -> dict[str, Any]:
    num_running, num_waiting = 256, 2000
    num_steps = 40 if quick else 400
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = decoding_engine(num_running, num_waiting)
        predictor = random_predictor()
        forecaster = Lookahead(FORECAST_HORIZON_MS, FORECAST_HORIZON_STEPS, knows_future=False)
        projector = Projection(FORECAST_HORIZON_MS, FORECAST_HORIZON_STEPS)
        step_s, features_s, predictor_s, scale_free_s, forecast_s = [], [], [], [], []
        projection_s, learned_s, modelled_s = [], [], []
        lengths = _length_model()
        for index in range(num_steps + 20):
            started = time.perf_counter()
            output = engine.step()
            stepped = time.perf_counter()
            features = engine_features(engine.view)
            ids = [r.request_id for r in engine.scheduler.running]
            featured = time.perf_counter()
            probs = predictor.step(ids, features)
            done = time.perf_counter()
            engine_features(engine.view, "scale_free")
            scaled = time.perf_counter()
            if index >= 20:  # warm-up: allocation, caches, the allocator's first sizes
                step_s.append(stepped - started)
                features_s.append(featured - stepped)
                predictor_s.append(done - featured)
                scale_free_s.append(scaled - done)
                modelled_s.append(output.step_s)
                projected = time.perf_counter()
                forecast = projector.forecast(engine.view, output.step_s)
                checked = time.perf_counter()
                lengths.confident_steps(engine.view.running, 0.69, forecast.num_steps)
                projection_s.append(checked - projected)
                learned_s.append(time.perf_counter() - projected)
                if index % FORECAST_EVERY == 0:
                    forked = time.perf_counter()
                    forecaster.forecast(engine.view)
                    forecast_s.append(time.perf_counter() - forked)
        assert len(engine.scheduler.running) == num_running and len(probs) == num_running
        cold_s = []
        for _ in range(5 if quick else 20):
            predictor.reset()
            started = time.perf_counter()
            predictor.step(ids, features)
            cold_s.append(time.perf_counter() - started)
        step_us = _median_us(step_s)
        predictor_us = _median_us(predictor_s)
        features_us = _median_us(features_s)
        scale_free_us = _median_us(scale_free_s)
        forecast_us = _median_us(forecast_s)
        projection_us = _median_us(projection_s)
        learned_us = _median_us(learned_s)
        modelled_us = _median_us(modelled_s)
        return {
            "bench": "predictor",
            "num_running": num_running,
            "num_waiting": num_waiting,
            "num_steps": num_steps,
            "torch_threads": 1,
            "null_engine_step_us_median": step_us,
            "predictor_step_us_median": predictor_us,
            "features_us_median": features_us,
            "predictor_fraction_of_step": round(predictor_us / step_us, 4),
            "features_and_predictor_fraction_of_step": round((features_us + predictor_us) / step_us, 4),
            "scale_free_features_us_median": scale_free_us,
            "scale_free_features_and_predictor_fraction_of_step": round(
                (scale_free_us + predictor_us) / step_us, 4
            ),
            "amortized_fraction_every_k_steps": {
                str(k): round((scale_free_us + predictor_us) / k / step_us, 4) for k in (1, 4, 8, 16, 32)
            },
            "forecast_us_median": forecast_us,
            "forecast_horizon": {"ms": FORECAST_HORIZON_MS, "steps": FORECAST_HORIZON_STEPS},
            "forecast_fraction_every_k_steps": {
                str(k): round(forecast_us / k / step_us, 4) for k in (1, 4, 16, 64)
            },
            "projection_us_median": projection_us,
            "projection_fraction_of_null_step": round(projection_us / step_us, 4),
            "modelled_step_us_median": modelled_us,
            "projection_fraction_of_modelled_step": round(projection_us / modelled_us, 4),
            "projection_learned_us_median": learned_us,
            "projection_learned_fraction_of_null_step": round(learned_us / step_us, 4),
            "projection_learned_fraction_of_modelled_step": round(learned_us / modelled_us, 4),
            "target_fraction": TARGET_FRACTION,
            "meets_target": predictor_us / step_us <= TARGET_FRACTION,
            "predictor_first_step_256_new_us_median": _median_us(cold_s),
            "predictor_step_alone_us_median": {
                str(num): _step_alone(predictor, num, 20 if quick else 200) for num in (16, 64, 256, 1024)
            },
            "pytorch_lightning_imported": "pytorch_lightning" in sys.modules,
        }
    finally:
        torch.set_num_threads(threads)
