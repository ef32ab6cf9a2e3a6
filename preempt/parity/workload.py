"""Parity workloads: requests in scheduler steps, with the cache and scheduler settings
both schedulers get.

A workload file (JSON or YAML) holds:

    name: burst-tight                 # optional, defaults to the file's stem
    description: ...                  # optional
    block_size: 16                    # tokens per KV block
    num_gpu_blocks: 64                # vLLM's KV blocks, its null block included
    max_num_seqs: 16
    max_num_batched_tokens: 256       # the step's token budget (chunked prefill is on)
    max_model_len: 8192               # optional (default 8192)
    policy: fcfs                      # optional: fcfs | priority | lcf (the CLI may override it)
    requests:
      - {id: 0, prompt_tokens: 100, output_tokens: 50, arrival_step: 0, priority: 0}

`arrival_step` k: the request is added before the k-th call of `schedule()` (default 0).
`priority`: vLLM's (smaller is more important; default 0); `preempt` reads it as
`sla_level = -priority`. Every request generates exactly `output_tokens` tokens (EOS is
ignored). Both sides see prefix caching off, as `preempt` has no prefix cache.

Plain Python (pydantic, yaml): the vLLM side receives the validated workload as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from preempt.core.config import format_validation_error

BUNDLED_DIR = Path(__file__).parent / "workloads"
MAX_REQUEST_ID = 10**8  # vLLM orders equal-priority ties by the id *string*: ids are zero-padded


class WorkloadError(ValueError):
    """A parity workload that cannot be run, with a message naming the field."""


class ParityRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: int = Field(ge=0, lt=MAX_REQUEST_ID)
    prompt_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=0)
    arrival_step: int = Field(0, ge=0)
    priority: int = 0


class ParityWorkload(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "workload"
    description: str = ""
    block_size: int = Field(gt=0)
    num_gpu_blocks: int = Field(gt=1)
    max_num_seqs: int = Field(gt=0)
    max_num_batched_tokens: int = Field(gt=0)
    max_model_len: int = Field(8192, gt=0)
    policy: Literal["fcfs", "priority", "lcf"] = "fcfs"
    requests: list[ParityRequest] = Field(min_length=1)

    @model_validator(mode="after")
    def _runnable(self) -> ParityWorkload:
        ids = [r.id for r in self.requests]
        if len(set(ids)) != len(ids):
            duplicate = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"request id {duplicate} appears twice")
        if self.max_num_batched_tokens < self.max_num_seqs:  # vLLM's SchedulerConfig refuses it
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs})"
            )
        usable = self.num_gpu_blocks - 1
        for r in self.requests:
            total = r.prompt_tokens + r.output_tokens
            # vLLM caps a step's tokens at max_model_len - computed - 1: the last position
            # must leave room for the sampled token.
            if total >= self.max_model_len:
                raise ValueError(
                    f"request {r.id}: prompt_tokens + output_tokens = {total} must be < "
                    f"max_model_len ({self.max_model_len})"
                )
            # A request that can never hold all its KV would preempt itself forever.
            if -(-total // self.block_size) > usable:
                raise ValueError(
                    f"request {r.id}: {total} tokens need {-(-total // self.block_size)} blocks, "
                    f"more than the {usable} usable (num_gpu_blocks - 1 null block)"
                )
        return self

    @property
    def usable_blocks(self) -> int:
        """Blocks a request can get: vLLM keeps block 0 as its null block."""
        return self.num_gpu_blocks - 1


def parse_workload(data: object, name: str = "workload") -> ParityWorkload:
    if not isinstance(data, dict):
        raise WorkloadError("a parity workload must be a mapping")
    data = {"name": name, **data}
    try:
        return ParityWorkload.model_validate(data)
    except ValidationError as err:
        message = format_validation_error(err, "field", ParityWorkload)
        raise WorkloadError(f"parity workload '{data['name']}': {message}") from None


def load_workload(path: str | Path) -> ParityWorkload:
    """A workload file, or the name of a bundled one (`preempt parity vllm --list`)."""
    path = Path(path)
    if not path.is_file() and (BUNDLED_DIR / f"{path}.json").is_file():
        path = BUNDLED_DIR / f"{path}.json"
    if not path.is_file():
        raise WorkloadError(f"parity workload not found: {path} (bundled: {', '.join(bundled_names())})")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        kind = path.suffix.lstrip(".") or "YAML"
        raise WorkloadError(f"parity workload {path} is not valid {kind}: {err}") from None
    return parse_workload(data, name=path.stem)


def bundled_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.json"))
