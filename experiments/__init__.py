"""Ablation experiments: configs under `preempt/configs/`, thin runners over the
`preempt` and `predictor` packages."""
