"""Calibration of the virtual clock: fit the cost model's device constants to measured
operator times (Vidur's public profiles, `vidur.py` + `fit.py`) or measure them on a
CUDA device (`gpu.py`), and write a profile JSON that `clock.target` can name.

Owns: the data loading, the fitting and the measurement protocol. Never imported by the
engine (the engine reads the profile files through `preempt.core.cost_model`).
"""
