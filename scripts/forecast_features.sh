#!/usr/bin/env bash
# The LSTM that reads the forecast (issue 15; docs/archive/predictor-history.md, "The LSTM reads the
# forecast"): the `forecast` feature set collected on the 11 deployment-regime windows of
# the lstm-deploy3 recipe (azure-conv [0, 1200) and [2400, 3000) s, azure-code [0, 1200) s;
# async restores and prefetch), three training seeds with the waste cap chosen on the dev
# windows (0.1), AUPRC per dataset and on mooncake-synthetic (never trained on), how
# often the feature alone is right, and the held-out windows of both traces
# (`preempt bench early --windows --arms lookahead,forecast_k4,lstm`).
# ~7 min of collects, ~9 min of training, ~1 min of evals, then ~45 min of benches
# (the two traces side by side) on 2 cores. Usage: bash scripts/forecast_features.sh [OUT]
set -euo pipefail
B=${1:-runs/pred15c/fcset}
C=preempt/configs/collect.yaml
F=(--set features.feature_set=forecast --set features.horizon_steps=4
   --set preemption.async_restore=true --set early_save.prefetch=true)
mkdir -p "$B"
D=""
for w in conv:0:swap:swapa conv:200:swap_zstd:zstda conv:400:swap:swapa conv:600:swap_zstd:zstda \
         conv:800:swap_zstd:zstda conv:1000:swap:swapa conv:2400:swap_zstd:zstda conv:2600:swap:swapa \
         conv:2800:swap_zstd:zstda code:0:swap:swapa code:600:swap_zstd:zstda; do
  IFS=: read -r trace start mode tag <<< "$w"
  X=()
  [ "$trace" = code ] && X=(--trace azure-code --set workload.duration_s=600)
  name=$trace-$tag-$start
  [ -d "$B/$name" ] || preempt collect --config $C "${F[@]}" "${X[@]}" --set preemption.mode="$mode" \
      --set workload.start_s="$start" --out "$B/collect-$name" --features "$B/$name" --no-progress > "$B/collect-$name.log"
  D=${D:+$D,}$B/$name
done
[ -d "$B/moon" ] || preempt collect --config $C --set features.feature_set=forecast --set features.horizon_steps=4 \
    --trace mooncake-synthetic --set model.max_model_len=200000 --set cache.num_blocks=16384 \
    --set clock.target=4xh200-llama3-70b --out "$B/collect-moon" --features "$B/moon" --no-progress > "$B/collect-moon.log"
M=""
for s in 0 1 2; do
  [ -f "$B/lstm10-s$s/metrics.json" ] || preempt train --data "$D" --out "$B/lstm10-s$s" --seed $s \
      --max-waste-share 0.1 --wandb disabled > "$B/train10-s$s.log"
  preempt eval-predictor --ckpt "$B/lstm10-s$s/predictor.ckpt" --data "$D" --json > "$B/eval-s$s.json"
  preempt eval-predictor --ckpt "$B/lstm10-s$s/predictor.ckpt" --data "$B/moon" --source-data "$D" \
      --split all --json > "$B/eval-moon-s$s.json"
  M=${M:+$M,}$B/lstm10-s$s/predictor.ckpt
done
B="$B" python - <<'PY'
import json, os

import numpy as np
from datasets import load_from_disk

b = os.environ["B"]
print("seed | AUPRC test (all) | azure-conv windows: lstm / logreg / rule | azure-code [0,600) | [600,1200) | mooncake")
for seed in (0, 1, 2):
    ev = json.load(open(f"{b}/eval-s{seed}.json"))["predictors"]
    moon = json.load(open(f"{b}/eval-moon-s{seed}.json"))["predictors"]
    per = {name: ev[name]["per_source"] for name in ("lstm", "logreg", "rule")}
    conv = [k for k in per["lstm"] if k.startswith("azure-conv")]
    span = {n: f"{min(per[n][k]['auprc'] for k in conv):.3f}-{max(per[n][k]['auprc'] for k in conv):.3f}" for n in per}
    code = [" / ".join(f"{per[n][k]['auprc']:.3f}" for n in per) for k in ("azure-code#1", "azure-code#2")]
    wins = sum(per["lstm"][k]["auprc"] > max(per["logreg"][k]["auprc"], per["rule"][k]["auprc"]) for k in conv)
    moon_s = " / ".join(f"{moon[n]['auprc']:.3f}" for n in ("lstm", "logreg", "rule"))
    print(f"{seed} | {ev['lstm']['auprc']:.3f} | {' / '.join(span.values())} (lstm first on {wins}/{len(conv)}) "
          f"| {code[0]} | {code[1]} | {moon_s}")
# The feature alone: its rows' share of positives, and the share of positive rows it marks.
for name in ("conv-swapa-0", "moon"):
    table = load_from_disk(f"{b}/{name}").data.table
    lead = np.stack(table.column("features").to_numpy(zero_copy_only=False))[:, 4]
    label = table.column("label").to_numpy()
    on = lead > 0
    print(f"{name}: forecast_lead > 0 on {on.sum()} rows, {label[on].mean():.4f} of them positive, "
          f"{label[on].sum() / label.sum():.3f} of the {label.sum()} positive rows")
PY
preempt bench early --windows --model "$M" --arms lookahead,forecast_k4,lstm --json > "$B/bench-windows-conv.json" &
preempt bench early --windows --trace azure-code --model "$M" --arms lookahead,forecast_k4,lstm --json \
    > "$B/bench-windows-code.json"
wait
