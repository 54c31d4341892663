#!/usr/bin/env bash
# Convert the packaged MiniLM at ranks 384 (exact), 192 and 128 with the paper's CP (tensorly, svd init,
# 100 iterations) and keep each reparam_report.json here. Run from the repository root:
#   bash experiments/reparametrize_minilm/run.sh
set -euo pipefail
export HF_HUB_OFFLINE=1
here=experiments/reparametrize_minilm
for rank in 384 192 128; do
  out=$(mktemp -d)/model
  python scripts/reparametrize.py collab.rank=$rank output_dir="$out" | tee "$here/cp-rank$rank.txt"
  cp "$out/reparam_report.json" "$here/cp-rank$rank.json"
  rm -rf "$(dirname "$out")"
done
