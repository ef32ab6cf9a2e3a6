#!/usr/bin/env bash
# The early-save policies side by side in the deployment regime (max_tokens a fixed 1024,
# collect.yaml's default), on azure-conv's four held-out windows, swap and swap_zstd,
# async restores: the rule, the fork's forecast (every 4 steps or on news), the projection
# without and with the learned length model, the LSTM (three training seeds, the main
# job's recipe: collect.yaml's v1 features on three 200 s windows, [0, 600) s) and the
# lookahead oracle (swap). docs/predictor.md's policy table. The oracle runs beside the
# rest (~16 min; the rest ~10 min, after ~6 min of collects and training) on 2 cores.
# Usage: bash scripts/early_policies.sh [OUT]
set -euo pipefail
B=${1:-runs/early-policies}
mkdir -p "$B"
D=""
for w in 0 200 400; do
  [ -d "$B/features-$w" ] || preempt collect --config preempt/configs/collect.yaml \
      --set workload.start_s=$w --out "$B/collect-$w" --features "$B/features-$w" --no-progress > "$B/collect-$w.log"
  D=${D:+$D,}$B/features-$w
done
M=""
for s in 0 1 2; do
  [ -f "$B/lstm-s$s/predictor.ckpt" ] || preempt train --data "$D" --out "$B/lstm-s$s" --seed $s \
      --wandb disabled --no-progress > "$B/train-s$s.log"
  M=${M:+$M,}$B/lstm-s$s/predictor.ckpt
done
preempt lengths "$B"/collect-0 "$B"/collect-200 "$B"/collect-400 --out "$B/lengths.json" > "$B/lengths.log"
preempt bench early --windows --model "$M" --arms lookahead --json > "$B/oracle.json" &
preempt bench early --windows --model "$M" --lengths "$B/lengths.json" --json \
  --arms rule,forecast_k4,projection,projection_learned,lstm > "$B/policies.json"
wait
python - "$B" <<'PY'
import json, sys

b = sys.argv[1]
from experiments.early_windows import render_windows

for name in ("policies", "oracle"):
    print(render_windows(json.load(open(f"{b}/{name}.json"))))
PY
