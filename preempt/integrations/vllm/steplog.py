"""Every scheduler step of a real vLLM, logged: its shape and its wall time.

`StepLogScheduler` is vLLM 0.32's own `Scheduler`, unchanged in every decision, that
writes one JSON line per step; `PreemptScheduler` (the plugin) writes the same lines.
Both turn on with a path in vLLM's additional config:

    vllm serve MODEL --scheduler-cls preempt.integrations.vllm.steplog.StepLogScheduler \\
      --additional-config '{"step_log": "steps.jsonl"}'

The file (read by `preempt calibrate --from vllm`, `preempt.calibrate.vllm_steps`):
- first line, `{"kind": "header", ...}`: the served model's shape (its config.json), the
  dtype, the engine's block size, blocks, seats and token budget, vLLM's version, the
  scheduler class and whether async scheduling is on;
- `{"kind": "add", "id", "t", "arrival", "prompt", "priority"}` when a request reaches the
  scheduler (at a step's boundary); `arrival` is vLLM's own arrival stamp, set when its API
  server made the request (vLLM's TTFT and e2e metrics count from it);
- `{"kind": "step", "step", "t", "end", "busy", "ids", "chunks", "preempted", "waiting",
  "free_blocks"}` per step: `t` when `schedule()` began and `end` when
  `update_from_output()` returned (both `time.time()`, so a client on the same machine can
  line them up with its own), `chunks` `[tokens computed before, new tokens]` per scheduled
  request (the same order as `ids`), `preempted` `[id, tokens computed]` of each request
  preempted while this step was scheduled (the tokens vLLM recomputes), `busy` whether
  requests were left unfinished (then, with synchronous scheduling, the next step starts
  at once: its `t` less this one's is this step's whole cost, host work included);
- `{"kind": "finish", "id", "t", "tokens"}` when a request finishes.

Async scheduling is off for a `Scheduler` subclass (vLLM says so when it loads one): these
steps are synchronous, schedule then forward then update, as preempt's engine models them.
Imports vLLM; never import it from preempt's own code paths.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

STEP_LOG_KEY = "step_log"  # in vLLM's additional_config: the file to write


def step_log_path(additional_config: object) -> str | None:
    if isinstance(additional_config, dict):
        path = additional_config.get(STEP_LOG_KEY)
        if path is not None and not isinstance(path, str):
            raise ValueError(f"additional_config.{STEP_LOG_KEY}: expected a file path, got {path!r}")
        return path
    return None


class StepLog:
    """The JSON-lines writer; line-buffered, so a killed server leaves whole lines."""

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the server's life
        self._write({"kind": "header", **header})

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def add(self, request_id: str, prompt: int, priority: int, arrival: float) -> None:
        record = {"kind": "add", "id": request_id, "t": time.time(), "arrival": arrival}
        self._write({**record, "prompt": prompt, "priority": priority})

    def step(self, record: dict[str, Any]) -> None:
        self._write({"kind": "step", **record})

    def finish(self, request_id: str, tokens: int, t: float) -> None:
        self._write({"kind": "finish", "id": request_id, "t": t, "tokens": tokens})


def _header(scheduler: Scheduler) -> dict[str, Any]:
    import vllm

    config = scheduler.vllm_config
    hf = config.model_config.hf_config
    num_heads = hf.num_attention_heads
    return {
        "vllm_version": vllm.__version__,
        "scheduler": type(scheduler).__qualname__,
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "policy": config.scheduler_config.policy,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "model": {
            "name": config.model_config.served_model_name or config.model_config.model,
            "num_layers": hf.num_hidden_layers,
            "hidden_size": hf.hidden_size,
            "num_q_heads": num_heads,
            "num_kv_heads": getattr(hf, "num_key_value_heads", num_heads),
            "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            "intermediate_size": hf.intermediate_size,
            "vocab_size": hf.vocab_size,
        },
        "block_size": scheduler.block_size,
        "num_gpu_blocks": scheduler.kv_cache_config.num_blocks,
        "max_num_seqs": scheduler.max_num_running_reqs,
        "max_num_batched_tokens": scheduler.max_num_scheduled_tokens,
    }


class StepLogging:
    """The logging, as a mixin placed before vLLM's `Scheduler` in a class's bases: it
    wraps `add_request`, `schedule`, `_preempt_request` and `update_from_output` and
    changes nothing they decide. Off (no cost but an attribute check) without a path."""

    step_log: StepLog | None = None

    def _open_step_log(self) -> None:
        path = step_log_path(self.vllm_config.additional_config)
        if path is not None:
            self.step_log = StepLog(path, _header(self))
        self._step_index = 0
        self._step_started = 0.0
        self._step_preempted: list[list] = []

    def add_request(self, request) -> None:
        super().add_request(request)
        if self.step_log is not None:
            self.step_log.add(
                request.request_id, request.num_prompt_tokens, request.priority, request.arrival_time
            )

    def schedule(self, *args, **kwargs):
        if self.step_log is None:
            return super().schedule(*args, **kwargs)
        self._step_started = time.time()
        return super().schedule(*args, **kwargs)

    def _preempt_request(self, request, *args, **kwargs) -> None:
        if self.step_log is not None:
            self._step_preempted.append([request.request_id, request.num_computed_tokens])
        super()._preempt_request(request, *args, **kwargs)

    def update_from_output(self, scheduler_output, model_runner_output):
        if self.step_log is None:
            return super().update_from_output(scheduler_output, model_runner_output)
        # Before vLLM's update: each scheduled request's tokens computed after this step
        # (schedule() advanced them); a request finishing in the update is still here.
        ids, chunks, scheduled = [], [], {}
        for request_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            ids.append(request_id)
            chunks.append([request.num_computed_tokens - num_new, num_new])
            scheduled[request_id] = request
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        end = time.time()
        for output in outputs.values():
            for out in output.outputs:
                if out.finish_reason is not None:
                    request = scheduled.get(out.request_id)  # vLLM has freed it by now
                    tokens = request.num_output_tokens if request is not None else -1
                    self.step_log.finish(out.request_id, tokens, end)
        self.step_log.step(
            {
                "step": self._step_index,
                "t": self._step_started,
                "end": end,
                "busy": self.get_num_unfinished_requests() > 0,
                "ids": ids,
                "chunks": chunks,
                "preempted": self._step_preempted,
                "waiting": len(self.waiting),
                "free_blocks": self.kv_cache_manager.block_pool.get_num_free_blocks(),
            }
        )
        self._step_index += 1
        self._step_preempted = []
        return outputs


class StepLogScheduler(StepLogging, Scheduler):
    """vLLM's own scheduler (its FCFS or priority policy, `--scheduling-policy`), every
    step logged (`--additional-config '{"step_log": PATH}'`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._open_step_log()
