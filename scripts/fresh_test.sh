#!/usr/bin/env bash
# Before saying CI is green: the README's test command in a fresh clone of HEAD with no
# variable set, as a new user (and CI) runs it. Usage: bash scripts/fresh_test.sh [DIR]
# (default: a new temporary folder). Installs .venv and the vLLM peer there (~6 min with a
# warm pip cache), then runs the whole suite.
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
dir=${1:-$(mktemp -d)/preempt}
git clone -q "$repo" "$dir"
cd "$dir"
echo "fresh clone of $(git rev-parse --short HEAD) in $dir"
env -i HOME="$HOME" PATH=/usr/bin:/bin make test
