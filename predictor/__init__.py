"""The learned preemption predictor (SPEC §8): an LSTM in PyTorch Lightning trained on the
engine's feature logs (`preempt collect`, preempt.obs.dataset).

Modules: `data` (the features dataset as request histories, split by request), `model`
(the SPEC's LSTM -> Linear -> sigmoid as a LightningModule), `train` (`preempt train`,
wandb seam), `evaluate` (metrics, `preempt eval-predictor`), `baselines` (rule, logistic
regression, oracle), `online` (the engine's side: one batched LSTM step per engine step,
each request's state carried). Importing this package imports nothing heavy; `data`,
`model`, `train` and `baselines` import pytorch_lightning (~5 s), so `preempt/` (engine,
server) may import only `online` (torch, never Lightning).
"""
