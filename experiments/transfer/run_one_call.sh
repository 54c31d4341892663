#!/usr/bin/env bash
# Section 4 of experiments/transfer/README.md: README's one-call path for SmolLM2 at half its cache, no texts (own
# samples), timed by its wall clock; its report is copied to experiments/transfer/one_call/reparam_report.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/smollm2-kv96-own}
start=$(date +%s)
HF_HUB_OFFLINE=1 python scripts/reparametrize.py model=smollm2 collab=key-svd collab.rank=96 collab.value_rank=96 \
  collab.fit_steps=150 collab.e2e_steps=32 output_dir="$out" overwrite=true
echo "wall seconds: $(( $(date +%s) - start ))"
cp "$out/reparam_report.json" experiments/transfer/one_call/reparam_report.json
