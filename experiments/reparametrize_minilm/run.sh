#!/usr/bin/env bash
# Convert the packaged MiniLM at ranks 384 (exact), 192 and 128 with CP and keep each reparam_report.json here:
# cp-rank*         the defaults (implicit ALS solver, SVD init, up to 100 iterations);
# cp-tensorly-rank* tensorly's dense parafac (SVD init, 100 iterations), the solver the paper's code uses.
# Run from the repository root:
#   bash experiments/reparametrize_minilm/run.sh
set -euo pipefail
export HF_HUB_OFFLINE=1
here=experiments/reparametrize_minilm
for solver in implicit tensorly; do
  tag=$([ "$solver" = implicit ] && echo cp || echo cp-tensorly)
  for rank in 384 192 128; do
    out=$(mktemp -d)/model
    python scripts/reparametrize.py collab.rank=$rank collab.solver=$solver output_dir="$out" | tee "$here/$tag-rank$rank.txt"
    cp "$out/reparam_report.json" "$here/$tag-rank$rank.json"
    rm -rf "$(dirname "$out")"
  done
done
