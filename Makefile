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

# Main job on embedded defaults: 2 minutes of the bundled Azure conversation trace
# through the tiny model on the virtual H200 clock.
run: $(STAMP)
	$(BIN)/preempt run --trace azure-conv --duration 120 --out runs/main

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check preempt predictor kernels experiments tests

bench: $(STAMP)
	$(BIN)/preempt bench engine --json

clean:
	rm -rf runs .pytest_cache
