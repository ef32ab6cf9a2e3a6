#!/usr/bin/env bash
# The projection with and without the learned output-length model (preempt.engine.lengths)
# on each bundled trace's four held-out windows, in the deployment regime: max_tokens a
# fixed 1024 (collect.yaml's default) and noisy (the true length times lognormal noise,
# sigma 0.5). `preempt bench early --windows` fits each window's length model on the
# trace outside that window. Prints docs/predictor.md's table: per trace, regime and mode,
# each arm's stall hidden and waste (95% t-intervals over windows) and the learned arm
# minus the projection, paired by window. Two benches at a time; ~8 min on 2 cores.
# Usage: bash scripts/lengths_windows.sh [OUT]
set -euo pipefail
OUT=${1:-runs/lengths}
mkdir -p "$OUT"
run() {
  for job in "$@"; do
    trace=${job%:*} regime=${job#*:}
    preempt bench early --windows --arms projection,projection_learned --trace "$trace" \
      --max-tokens "$regime" --json > "$OUT/$trace-$regime.json"
  done
}
run azure-conv:fixed azure-code:fixed mooncake-synthetic:fixed &
run azure-conv:noisy azure-code:noisy mooncake-synthetic:noisy
wait
python - "$OUT" <<'PY'
import json, sys

out = sys.argv[1]

def iv(e):
    return f"{e['mean']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}]" if e["lo"] is not None else f"{e['mean']:.3f}"

print("| trace | max_tokens | mode | projection hidden | waste | learned hidden | waste | learned - projection: hidden | waste |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for trace in ("azure-conv", "azure-code", "mooncake-synthetic"):
    for regime in ("fixed", "noisy"):
        result = json.load(open(f"{out}/{trace}-{regime}.json"))
        for mode, arms in result["summary"].items():
            p, l = arms["projection"], arms["projection_learned"]
            d = l["minus_projection"]
            print(
                f"| {trace} | {regime} | {mode} | {iv(p['stall_hidden'])} | {iv(p['waste_share'])} | "
                f"{iv(l['stall_hidden'])} | {iv(l['waste_share'])} | {iv(d['stall_hidden'])} | {iv(d['waste_share'])} |"
            )
PY
