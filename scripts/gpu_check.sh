#!/usr/bin/env bash
# The GPU session's one prepared script (run it when a GPU is lent, then record what it
# printed in docs/gpu.md with the date and the device). The GPU machine reaches no package
# registry and lacks pydantic and zstandard: `make gpu-wheels` here first (it fills .whl/,
# git-ignored), carry `.whl` along, and on the device machine, in the repo root:
#   bash scripts/gpu_check.sh            # writes $OUT/ (or ./gpu_out/): JSON + logs
# Stages, most valuable first, each under its own time limit (the whole script < 10 min):
# 1. the virtual clock's calibration (`preempt calibrate --device cuda`, 45 s on an H200):
#    a measured profile for h200-llama3-8b and its log;
# 2. the compiled Triton kernels against their torch references, and the vLLM connector's
#    host side on the device (pytest -m gpu);
# 3. kernel bandwidth vs HBM peak and the save path vs the raw PCIe copy (bench kernels);
# 4. the save benchmark's codec numbers (bench save --quick).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_DATASETS_OFFLINE=1
PY=${PY:-python3}
WHEELS=${WHEELS:-.whl}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.csv" 2>&1
cat "$OUT/device.csv"
if [ -d "$WHEELS" ]; then
  # Offline: the carried wheels into a side directory, the repo itself from its source tree.
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    > "$OUT/install.log" 2>&1 || { echo "wheel install failed"; tail -20 "$OUT/install.log"; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  $PY -m pip install -q -e '.[dev]' > "$OUT/install.log" 2>&1 || { echo "install failed"; tail -20 "$OUT/install.log"; }
fi
$PY -c "import preempt.cli, zstandard, pydantic; print('imports ok')" || exit 1

echo "== 1. calibrate"
timeout 400 $PY -m preempt.cli calibrate --device cuda --out "$OUT/h200-measured.json" 2> >(tee "$OUT/calibrate.log" >&2)
echo "calibrate rc=$?"
echo "== 2. pytest -m gpu"
timeout 150 $PY -m pytest -m gpu -q -p no:cacheprovider tests/kernels tests/integrations/test_vllm_kv_store.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -5
echo "== 3. bench kernels"
timeout 90 $PY -m preempt.cli bench kernels --json > "$OUT/bench_kernels.json" 2> "$OUT/bench_kernels.err"
tail -c 1500 "$OUT/bench_kernels.json"
echo "== 4. bench save --quick"
timeout 90 $PY -m preempt.cli bench save --quick --json > "$OUT/bench_save_quick.json" 2> "$OUT/bench_save.err"
tail -c 600 "$OUT/bench_save_quick.json"
echo
echo "== done"
