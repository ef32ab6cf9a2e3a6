#!/usr/bin/env bash
# The forecast and the LSTM when max_tokens is not the true output length (issue 15):
# workload.max_tokens_mode noisy (lognormal, sigma 0.5, around the true length) and fixed
# (1024 for every request, a server's cap), on azure-conv's four held-out windows, swap,
# async restores; hidden against the same window's synchronous `none`. Prints one line
# per window and arm, then each arm's mean and 95% t-interval over the windows
# (experiments.stats). ~8 min on 2 cores. Usage: bash scripts/forecast_lengths.sh [CKPT]
set -euo pipefail
M=${1:-runs/pred15b/lstm-deploy3-s0/predictor.ckpt}
OUT=${OUT:-runs/forecast-lengths}
mkdir -p "$OUT"
for mt in noisy fixed; do
  for w in 1600 1800 2000 2200; do
    X=(--model "$M" --set "workload.max_tokens_mode=$mt" --set "workload.start_s=$w")
    python -m preempt.bench.early --mode swap --arm none --sync-restore "${X[@]}" > "$OUT/$mt-$w-none.json"
    for a in forecast_k4 lstm; do
      python -m preempt.bench.early --mode swap --arm "$a" "${X[@]}" > "$OUT/$mt-$w-$a.json"
    done
  done
done
OUT="$OUT" python - <<'PY'
import json, os
from experiments.stats import t_interval
out = os.environ["OUT"]
for mt in ("noisy", "fixed"):
    for arm in ("forecast_k4", "lstm"):
        hidden, waste = [], []
        for w in (1600, 1800, 2000, 2200):
            base = json.load(open(f"{out}/{mt}-{w}-none.json"))["stall_total_s"]
            row = json.load(open(f"{out}/{mt}-{w}-{arm}.json"))
            hidden.append(1 - row["stall_total_s"] / base)
            waste.append(row["waste_share"])
            print(f"{mt} {w} {arm}: hidden {hidden[-1]:.3f} waste {waste[-1]:.3f}")
        h, x = t_interval(hidden), t_interval(waste)
        print(f"== {mt} {arm}: hidden {h.mean:.3f} [{h.lo:.3f}, {h.hi:.3f}]  waste {x.mean:.3f} [{x.lo:.3f}, {x.hi:.3f}]")
PY
