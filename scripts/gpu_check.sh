#!/usr/bin/env bash
# The GPU session's one prepared script (DEVELOPERS: run it when a GPU is lent, then record
# what it printed in docs/gpu.md with the date and the device). On the device machine:
#   bash scripts/gpu_check.sh            # writes $OUT/ (or ./gpu_out/) JSON + logs
# 1. the compiled Triton kernels against their torch references (pytest -m gpu);
# 2. kernel bandwidth vs HBM peak and the save path vs the raw PCIe copy (bench kernels);
# 3. the save benchmark's codec numbers (bench save --quick).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.csv" 2>&1
pip install -q -e '.[dev]' > "$OUT/install.log" 2>&1 || { echo "install failed"; tail -20 "$OUT/install.log"; }
python -m pytest -m gpu -q tests/kernels 2>&1 | tee "$OUT/pytest_gpu.log" | tail -5
preempt bench kernels --json 2>&1 | tee "$OUT/bench_kernels.json"
preempt bench save --quick --json > "$OUT/bench_save_quick.json" 2> "$OUT/bench_save.err"; tail -c 600 "$OUT/bench_save_quick.json"
# 4. the virtual clock's calibration (< 6 min on one H200): profile + log for docs/gpu.md
timeout 420 preempt calibrate --device cuda --out "$OUT/h200-measured.json" 2> "$OUT/calibrate.log"; tail -3 "$OUT/calibrate.log"
