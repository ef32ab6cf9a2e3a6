"""Ablation experiments: configs under `experiments/configs/`, thin runners over the
`preempt` and `predictor` packages."""
