# The README's two commands: `make run` (set up + main job) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Main job on embedded defaults (experiments/main.py): train the reference LM (cached in
# runs/lm), head importance -> plan, collect features, train the predictor, the `quick`
# ablation with wandb offline, the codec benchmark, the claims report. ~3 min after the
# LM's first training (~5 min) on 2 cores.
run: $(STAMP)
	$(BIN)/python -m experiments.main --out runs/main

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check preempt predictor kernels experiments tests

bench: $(STAMP)
	$(BIN)/preempt bench engine --json

clean:
	rm -rf runs .pytest_cache
