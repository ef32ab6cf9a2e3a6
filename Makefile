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

# Main job on embedded defaults: 2 minutes of the bundled Azure conversation trace at 2x
# its rate through the tiny model on the virtual H200 clock, with the SPEC's design on
# (serve_config.json: priority score, dynamic slices, zstd saves to a 4 GB host pool) and
# a KV pool of 2,000 blocks (32k tokens) so that requests really are preempted.
run: $(STAMP)
	$(BIN)/preempt run --config serve_config.json --trace azure-conv --duration 120 --rate-scale 2 \
		--set cache.num_blocks=2000 --out runs/main

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check preempt predictor kernels experiments tests

bench: $(STAMP)
	$(BIN)/preempt bench engine --json

clean:
	rm -rf runs .pytest_cache
