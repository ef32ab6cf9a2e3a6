"""The learned preemption predictor (LSTM in PyTorch Lightning): data, model, training,
evaluation and online use. Built on the engine's feature logs; see the predictor issue."""
