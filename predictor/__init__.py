"""The learned preemption predictor (docs/design.md §8): an LSTM in PyTorch Lightning trained on the
engine's feature logs (`preempt collect`, preempt.obs.dataset).

Modules: `data` (the features dataset as request histories, split by request), `model`
(the design's LSTM -> Linear -> sigmoid as a LightningModule), `train` (`preempt train`),
`evaluate` (`preempt eval-predictor`), `metrics` (AUROC, AUPRC, F1 in numpy),
`baselines` (rule, logistic regression, oracle), `diagnose` (positive rows logged before
their preemption's challenger arrived: what any predictor can know). The engine's side (one batched LSTM
step per engine step, each request's state carried; torch, never Lightning) is
`preempt.early.online_predictor`: preempt/ never imports this package, only the CLI
does. Importing this package imports nothing heavy; `data`, `model`, `train` and
`baselines` import pytorch_lightning (~5 s).
"""
