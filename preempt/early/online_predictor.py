"""Online, stateful, batched inference of the trained preemption LSTM (docs/design.md §8, issue #6).

Owns: loading a `preempt train` checkpoint without Lightning, each running request's LSTM
state (h, c) in a preallocated slot, and the step: one LSTM step for all requests of an
engine step in one batched call, returning P(preempted within the horizon) per request.

Must never: import pytorch_lightning or anything of `predictor/` (the engine
imports this module; Lightning costs ~5 s), run a request's history again (one LSTM step
per call, carried state), or do per-request tensor work in the hot path (one gather, one
GEMM, a few elementwise ops and one scatter for the whole batch).

How the engine must call it, so online probabilities equal the offline ones the model
was trained and evaluated on (predictor.data, predictor.model):
- `step` exactly when `preempt.obs.dataset.FeatureLogger` would log a row: after each engine
  step that ran something (and every `every_k_steps`-th one if the training data was
  collected with k > 1), with the features of *every* running request of that step;
- `forget` only when a request finishes or is aborted. A preempted request keeps its
  state while it waits: its logged history simply has a gap there, and training read
  the history across that gap too.
A new request id starts from the zero state, as every training history does.

Checkpoint: the Lightning checkpoint itself, read with `torch.load(weights_only=True)`
(its hyper-parameters are plain types, so no safe globals and no Lightning classes are
needed). The plain `torch.nn.LSTM` + `Linear` are rebuilt from its state dict and kept
(`history_probs` runs them over whole histories: the offline reference); the step uses
the same weights fused into one matrix (input and hidden projections in one GEMM, gates
reordered so the three sigmoid gates are contiguous, tanh computed as 2 sigmoid(2a) - 1,
1/std folded into the input columns; the mean is subtracted explicitly, because folding
it into the bias cancels catastrophically when a feature's std is tiny).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

NUM_FEATURES = 8
HIDDEN_SIZE = 64
_STATE_KEYS = {
    "lstm.weight_ih_l0": (4 * HIDDEN_SIZE, NUM_FEATURES),
    "lstm.weight_hh_l0": (4 * HIDDEN_SIZE, HIDDEN_SIZE),
    "lstm.bias_ih_l0": (4 * HIDDEN_SIZE,),
    "lstm.bias_hh_l0": (4 * HIDDEN_SIZE,),
    "head.weight": (1, HIDDEN_SIZE),
    "head.bias": (1,),
    "feature_mean": (NUM_FEATURES,),
    "feature_std": (NUM_FEATURES,),
}


class PredictorCheckpointError(ValueError):
    """A predictor checkpoint that cannot be used; the message names the file and why."""


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, hyper-parameters) of a `preempt train` checkpoint, checked for the
    the design's shapes; never imports Lightning."""
    path = Path(path)
    if not path.is_file():
        raise PredictorCheckpointError(
            f"predictor checkpoint not found: {path} (write one with `preempt train`)"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, not a torch file, disallowed pickle global, ...
        raise PredictorCheckpointError(
            f"cannot read predictor checkpoint {path}: {type(err).__name__}: {str(err).splitlines()[0]}"
        ) from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise PredictorCheckpointError(f"{path} is not a `preempt train` checkpoint (no state_dict)")
    state = checkpoint["state_dict"]
    for key, shape in _STATE_KEYS.items():
        tensor = state.get(key)
        if not isinstance(tensor, torch.Tensor):
            raise PredictorCheckpointError(
                f"{path}: state_dict has no '{key}' (not a preemption LSTM checkpoint)"
            )
        if tuple(tensor.shape) != shape:
            raise PredictorCheckpointError(
                f"{path}: '{key}' has shape {tuple(tensor.shape)}, the design's LSTM(8, 64) needs {shape}"
            )
    hparams = checkpoint.get("hyper_parameters") or {}
    return state, dict(hparams)


def check_trained_for(
    path: str | Path,
    hparams: dict[str, Any],
    horizon_ms: float,
    horizon_steps: int,
    feature_set: str,
    every_k_steps: int = 1,
) -> None:
    """Refuse a checkpoint trained for another horizon, feature set or stride: its
    probabilities answer another question, read other columns, or stand for another
    number of engine steps per LSTM step. Checkpoints from before these were recorded
    were trained on `v1` features with a 50 ms, time-only horizon, every step. The
    feature *names* are compared too: a set whose columns changed under the same name
    (scale_free's `free_kv_fraction` -> `headroom`) is refused, not misread."""
    from preempt.early.features import FEATURE_SETS

    trained = (
        float(hparams.get("horizon_ms", 50.0)),
        int(hparams.get("horizon_steps", 0)),
        str(hparams.get("feature_set", "v1")),
        int(hparams.get("every_k_steps", 1)),
    )
    wanted = (float(horizon_ms), int(horizon_steps), str(feature_set), int(every_k_steps))
    if trained != wanted:
        raise PredictorCheckpointError(
            f"{path} was trained for horizon_ms={trained[0]:g}, horizon_steps={trained[1]}, "
            f"feature_set={trained[2]}, every_k_steps={trained[3]}, but the engine asks for "
            f"horizon_ms={wanted[0]:g}, horizon_steps={wanted[1]}, feature_set={wanted[2]}, "
            f"every_k_steps={wanted[3]} (set early_save.horizon_ms/horizon_steps/feature_set/"
            "every_k_steps to match, or retrain on data collected that way)"
        )
    names = list(hparams.get("feature_names") or [])
    expected = list(FEATURE_SETS.get(str(feature_set), ()))
    if names and names != expected:
        raise PredictorCheckpointError(
            f"{path} was trained on the features {names}, but feature_set={feature_set} now "
            f"computes {expected} (retrain on data collected with this version)"
        )


class OnlinePredictor:
    """P(preempted within the horizon) for the running requests, one LSTM step per call.

    Not thread-safe: one engine thread calls it."""

    def __init__(
        self,
        state_dict: dict[str, torch.Tensor],
        threshold: float,
        hparams: dict[str, Any] | None = None,
        capacity: int = 256,
    ) -> None:
        try:
            threshold = float(threshold)
        except (TypeError, ValueError):
            threshold = math.nan
        if math.isnan(threshold):
            raise ValueError("threshold must be a number (inf: never warn)")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.threshold = threshold
        """Start an early save when p >= threshold (the checkpoint's val-chosen one unless overridden)."""
        self.hparams = dict(hparams or {})
        self.every_k_steps = int(self.hparams.get("every_k_steps", 1))
        """The training data's logging period: `step` stands for this many engine steps."""
        H = HIDDEN_SIZE
        with torch.no_grad():
            # The reference modules (offline path), exactly the training network.
            self.lstm = nn.LSTM(NUM_FEATURES, H, batch_first=True)
            self.head = nn.Linear(H, 1)
            self.lstm.load_state_dict(
                {k.removeprefix("lstm."): v for k, v in state_dict.items() if k.startswith("lstm.")}
            )
            self.head.load_state_dict(
                {k.removeprefix("head."): v for k, v in state_dict.items() if k.startswith("head.")}
            )
            self.lstm.requires_grad_(False)
            self.head.requires_grad_(False)
            self.feature_mean = state_dict["feature_mean"].detach().to(torch.float32).clone()
            self.feature_std = state_dict["feature_std"].detach().to(torch.float32).clone()

            # The fused step weights (float64 while combining, float32 to run).
            w_ih = self.lstm.weight_ih_l0.double() / self.feature_std.double()[None, :]  # (4H, 8)
            w_hh = self.lstm.weight_hh_l0.double()  # (4H, H)
            bias = (self.lstm.bias_ih_l0 + self.lstm.bias_hh_l0).double()  # (4H,)
            # torch's gate order is (i, f, g, o); (i, f, o, g) puts the sigmoid gates together.
            order = torch.cat(
                [torch.arange(0, 2 * H), torch.arange(3 * H, 4 * H), torch.arange(2 * H, 3 * H)]
            )
            # tanh(a) = 2 sigmoid(2a) - 1: torch's CPU tanh runs ~5x slower than its sigmoid
            # (42 vs 8 us on a (256, 64) tensor), so the g gate's rows are doubled and all
            # four gates take one sigmoid; absolute error ~1e-7.
            scale = torch.ones(4 * H, dtype=torch.float64)
            scale[3 * H :] = 2.0
            weight = torch.cat([w_ih, w_hh], dim=1)[order] * scale[:, None]  # (4H, 8 + H)
            self._weight = weight.t().contiguous().float()  # (8 + H, 4H)
            self._bias = (bias[order] * scale).float().contiguous()  # (4H,)
            self._head_weight = self.head.weight[0].detach().clone()  # (H,)
            self._head_bias = self.head.bias.detach().clone()  # (1,)
        # Slot layout [x | h | c]: a gathered row is the GEMM's input [x, h] as is, and one
        # index_copy_ writes h and c back. Column block x is scratch.
        self._state = torch.zeros(capacity, NUM_FEATURES + 2 * H)  # (capacity, 8 + 2H)
        self._workspace(capacity)
        self._slot_of: dict[int, int] = {}
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_checkpoint(
        cls, path: str | Path, threshold: float | None = None, capacity: int = 256
    ) -> OnlinePredictor:
        """Load `preempt train`'s predictor.ckpt; `threshold` overrides the checkpoint's
        operating threshold (chosen at max F1 on the val split)."""
        state, hparams = load_checkpoint(path)
        if threshold is None:
            if "threshold" not in hparams:
                raise PredictorCheckpointError(f"{path} holds no operating threshold: pass threshold=")
            threshold = float(hparams["threshold"])
        elif not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if hparams.get("history") != "full":
            warnings.warn(
                f"{path} was trained on zero-started windows, not whole request histories: its online "
                "probabilities differ from its offline evaluation (retrain with `preempt train`)",
                stacklevel=2,
            )
        return cls(state, threshold, hparams, capacity)

    # ----------------------------------------------------------------- state
    @property
    def capacity(self) -> int:
        return self._state.shape[0]

    @property
    def num_tracked(self) -> int:
        """Requests with a state (seen by `step`, not yet forgotten)."""
        return len(self._slot_of)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._slot_of

    def forget(self, request_ids: Iterable[int]) -> None:
        """Drop the state of finished or aborted requests (unknown ids are ignored). Not
        for preemptions: a preempted request keeps its history (module docstring)."""
        for request_id in request_ids:
            slot = self._slot_of.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)

    def reset(self) -> None:
        """Forget every request."""
        self._slot_of.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    def _workspace(self, capacity: int) -> None:
        # Preallocated step buffers: fresh 100-260 KB tensors every step come from mmap
        # (glibc's threshold) and fault their pages in again; inside the engine loop that
        # nearly doubled the step (493 vs 260 us at N=256, `preempt bench predictor`).
        self._rows = torch.empty(capacity, self._state.shape[1])  # gathered [x | h | c]
        self._gates = torch.empty(capacity, 4 * HIDDEN_SIZE)
        self._tanh_c = torch.empty(capacity, HIDDEN_SIZE)

    def _grow(self) -> None:
        old = self.capacity
        state = torch.zeros(2 * old, self._state.shape[1])
        state[:old] = self._state
        self._state = state
        self._workspace(2 * old)
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free

    def _slots(self, request_ids: Sequence[int]) -> torch.Tensor:
        """(N,) int64 slot of each id; new ids get a free slot with the zero state."""
        slot_of = self._slot_of
        slots = [slot_of.get(request_id, -1) for request_id in request_ids]
        if -1 in slots:
            new = []
            for i, slot in enumerate(slots):
                if slot < 0:
                    if request_ids[i] in slot_of:  # absent at the lookup: given earlier in this call
                        raise ValueError(f"step: request id {request_ids[i]} appears twice in one step")
                    if not self._free:
                        self._grow()
                    slot = self._free.pop()
                    slot_of[request_ids[i]] = slot
                    slots[i] = slot
                    new.append(slot)
            self._state.index_fill_(0, torch.tensor(new, dtype=torch.int64), 0.0)
        if len(set(slots)) != len(slots):
            raise ValueError("step: a request id appears twice in one step")  # known ids
        return torch.tensor(slots, dtype=torch.int64)

    # ----------------------------------------------------------------- the step
    def step(self, request_ids: Sequence[int], features: np.ndarray) -> np.ndarray:
        """Advance each request's (h, c) by one LSTM step on its features of this engine
        step and return p (N,) float32 in [0, 1].

        request_ids: N distinct ids (ids seen for the first time start from the zero
        state); features: (N, 8) raw features (preempt.early.features.compute_features)."""
        x = np.ascontiguousarray(features, dtype=np.float32)
        num = len(request_ids)
        if x.shape != (num, NUM_FEATURES):
            raise ValueError(f"step: features must be ({num}, {NUM_FEATURES}) for {num} ids, got {x.shape}")
        if num == 0:
            return np.zeros(0, dtype=np.float32)
        H = HIDDEN_SIZE
        index = self._slots(request_ids)  # (N,)
        rows = torch.index_select(self._state, 0, index, out=self._rows[:num])  # (N, 8 + 2H): [x | h | c]
        torch.sub(torch.from_numpy(x), self.feature_mean, out=rows[:, :NUM_FEATURES])  # 1/std: in the weight
        gates = torch.addmm(self._bias, rows[:, : NUM_FEATURES + H], self._weight, out=self._gates[:num])
        gates.sigmoid_()  # (N, 4H): i f o | g
        i, f, o, g2 = gates[:, :H], gates[:, H : 2 * H], gates[:, 2 * H : 3 * H], gates[:, 3 * H :]
        g = g2.mul_(2.0).sub_(1.0)  # tanh of the g gate (its pre-activation was doubled)
        c = rows[:, NUM_FEATURES + H :]  # (N, H)
        c.mul_(f).addcmul_(i, g)  # c = f * c + i * g
        tanh_c = torch.mul(c, 2.0, out=self._tanh_c[:num]).sigmoid_().mul_(2.0).sub_(1.0)  # 2 sig(2c) - 1
        h = rows[:, NUM_FEATURES : NUM_FEATURES + H]  # (N, H)
        torch.mul(o, tanh_c, out=h)  # h = o * tanh(c)
        self._state.index_copy_(0, index, rows)
        return torch.addmv(self._head_bias, h, self._head_weight).sigmoid_().numpy()  # (N,), a new array

    # ----------------------------------------------------------------- offline reference
    @torch.no_grad()
    def history_probs(self, x: np.ndarray | torch.Tensor) -> np.ndarray:
        """P at every step of whole histories x (B, T, 8) from the zero state, with the
        plain rebuilt nn.LSTM (the offline computation); touches no online state."""
        x = torch.as_tensor(x, dtype=torch.float32)
        out, _ = self.lstm((x - self.feature_mean) / self.feature_std)  # (B, T, H)
        return torch.sigmoid(self.head(out).squeeze(-1)).numpy()  # (B, T)
