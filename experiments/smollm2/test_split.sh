#!/usr/bin/env bash
# The headline rows of the SmolLM2 race (README.md's table, experiments/smollm2/README.md), measured once on the test
# split (issue 88): the held-out windows after the validation ones, which no choice of recipe read, and the test-only
# code domain (torch 2.13.0's own source; collab_attn/pretrained/heldout.py). Every recipe here was chosen on validation
# (fitted_2048/runs, fitted/runs); nothing is chosen from what this prints.
#
#   bash experiments/smollm2/test_split.sh              # everything, in order (resumable: a finished run is skipped)
#   bash experiments/smollm2/test_split.sh short        # one part: short, long-key-svd, long-cp-tucker
#   bash experiments/smollm2/test_split.sh long-cp-tucker --device cuda    # further options go to every command
#
# The parts can run side by side (one torch thread each; the original's run may be computed by both, the same file).
# Results: experiments/smollm2/fitted_2048/test/{runs/,summary.md,perplexity.png} (the validation runs of the same
# rows: experiments/smollm2/fitted_2048/runs/); the fitted weights are kept in fitted_2048/checkpoints/ (not
# committed). Every run: 64 windows of 256 tokens and 8 of 2,048 per domain (wikipedia, shakespeare, code), the
# interval of each verdict from those same windows (the summary's window bootstrap). Compare rows of the test
# split only with each other (scripts/compare_runs.py on two files of fitted_2048/test/runs; summary_markdown and
# comparison_markdown refuse runs of different splits).
#
# Cost on the project's 2-core CPU, one thread per run (estimated from the validation runs' times, not measured):
# the held-out measurement is about 2.4 times the validation one (98,088 predicted tokens per run against 40,912),
# about 25 minutes per run for both models;
#   short:          the original, then cp, tucker, key-svd, kv-svd at 1/2 and 1/4, calibrated on 16,384 tokens, and
#                   each also fitted 100 steps per layer: 17 runs, calibration 75 s once, fits 4-10 min each:
#                   about 8 hours;
#   long-key-svd:   key-svd and kv-svd at 1/2 and 1/4 with the long recipe (600 layer steps, then 64 end-to-end steps
#                   on the first 65,536 fitting tokens): 4 runs of about 80 minutes (25 + 30 + 30): about 5-6 hours;
#   long-cp-tucker: cp and tucker at 1/2 with the long recipe (the only budget they ran it at on validation):
#                   2 runs, about 3 hours.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
part=${1:-all}
[ $# -gt 0 ] && shift
common=(--fit-text mixed --out experiments/smollm2/fitted_2048 --split test --windows 64 --long-length 2048 --long-windows 8
        --calibration-tokens 16384 --threads 1)

short() {  # README.md's rows "calibrated on 16,384 tokens" and "+ each attention layer fitted ... 100 steps"
  "$PYTHON" scripts/race_smollm2.py "${common[@]}" --budgets 0.5 0.25 --methods cp tucker key-svd kv-svd \
    --fit-steps 100 --rows 'calibrated16384(-fitted100)?$' "$@"
}

long_key_svd() {  # "+ 600 steps a layer, then end to end on 65,536 fresh tokens" and "MHA2MLA's form, fitted the same way"
  "$PYTHON" scripts/race_smollm2.py "${common[@]}" --budgets 0.5 0.25 --methods key-svd kv-svd \
    --fit-steps 600 --e2e-steps 64 --e2e-tokens 65536 --rows 'fitted600-e2e64on65536$' "$@"
}

long_cp_tucker() {  # the long recipe's cp and tucker rows at 1/2 (experiments/smollm2/README.md, section 3; LOG.md,
                    # stops 82 and 84)
  "$PYTHON" scripts/race_smollm2.py "${common[@]}" --budgets 0.5 --methods cp tucker \
    --fit-steps 600 --e2e-steps 64 --e2e-tokens 65536 --rows 'fitted600-e2e64on65536$' "$@"
}

case "$part" in
  all) short "$@"; long_key_svd "$@"; long_cp_tucker "$@" ;;
  short) short "$@" ;;
  long-key-svd) long_key_svd "$@" ;;
  long-cp-tucker) long_cp_tucker "$@" ;;
  *) echo "usage: $0 [all|short|long-key-svd|long-cp-tucker] [race_smollm2.py options]" >&2; exit 2 ;;
esac
