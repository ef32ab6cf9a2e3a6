"""The learned preemption predictor (SPEC §8): an LSTM in PyTorch Lightning trained on the
engine's feature logs (`preempt collect`, preempt.features).

Modules: `data` (the features dataset as windows, split by request), `model` (the SPEC's
LSTM -> Linear -> sigmoid as a LightningModule), `train` (`preempt train`, wandb seam),
`evaluate` (metrics, `preempt eval-predictor`), `baselines` (rule, logistic regression,
oracle). Importing this package imports nothing heavy; its modules import
pytorch_lightning (~5 s), so `preempt/` (engine, server) must never import them.
"""
