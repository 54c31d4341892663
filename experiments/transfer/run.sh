#!/usr/bin/env bash
# Issue 91's transfer matrix: SmolLM2-135M converted by key-svd, fitted by the 10-minute recipe of the race
# (experiments/smollm2/ten_minutes: calibration on 16,384 tokens, 150 layer-fit steps on them, 32 end-to-end steps
# on the first 32,768 fitting tokens, kept only if the loss on the next 4,096 fell) on one fitting text at a time,
# measured on every domain: validation (wikipedia, shakespeare, code; 16 windows of 256) where choices are made, and
# the test split (the same three and docs, which no fit and no choice reads; 32 windows of 256), read once.
#
#   bash experiments/transfer/run.sh fit own mixed          # these fitting texts at 1/2 (BUDGET=0.25 for 1/4)
#   bash experiments/transfer/run.sh stages mixed own       # their calibrated and layer-fitted stages (validation)
#   E2E_STEPS=128 E2E_TOKENS=131072 E2E_CHECK_EVERY=32 bash experiments/transfer/run.sh fit all
#       # a longer end-to-end fit, its held-out loss every 32 steps, the lowest's weights kept (early stopping)
#   E2E_CHECK_EVERY=4 E2E_HELD_OUT_TEXT=code SPLITS=validation bash experiments/transfer/run.sh fit wikipedia
#       # judged, and stopped early, on another domain's fit split (code) that the fit does not read; validation only
#   E2E_ANCHOR=10 SPLITS=validation bash experiments/transfer/run.sh fit wikipedia   # pulled toward its start
#   python scripts/summarize.py transfer experiments/transfer [--split test]   # the tables
#
# Fitting texts (scripts/race_smollm2.py --fit-text): own (the original's own samples, collab_attn.own_text; kept in
# experiments/transfer/own_text/, not committed), all (the wikipedia, shakespeare and code fit splits interleaved),
# mixed (wikipedia and shakespeare: the race's text so far), wikipedia, shakespeare, code, every (own samples and the
# three fit splits, a quarter each). Resumable: a finished run
# is skipped. One torch thread per command; two commands side by side on the project's 2-core CPU took about 30-35
# minutes per fitting text (both splits).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
what=${1:?usage: $0 fit|stages TEXT...}
shift
recipe=(--out experiments/transfer --budgets "${BUDGET:-0.5}" --methods key-svd --calibration-tokens 16384
        --fit-steps 150 --threads 1)
for text in "$@"; do
  case "$what" in
    fit)
      steps=${E2E_STEPS:-32} tokens=${E2E_TOKENS:-32768} every=${E2E_CHECK_EVERY:-0} held=${E2E_HELD_OUT_TEXT:-}
      anchor=${E2E_ANCHOR:-0}  # written as the run names write it: 10, 0.5
      stop=$( ((every)) && echo "stop$every" || true) pull=$([ "$anchor" = 0 ] || echo "anchor$anchor")
      e2e=("${recipe[@]}" --e2e-steps "$steps" --e2e-tokens "$tokens" --e2e-held-out-tokens 4096 --fit-text "$text"
           --e2e-held-out-text "$held" --e2e-check-every "$every" --e2e-anchor "$anchor"
           --rows "e2e${steps}on${tokens}held4096${held}${stop}${pull}(-text[a-z]+)?\$")
      "$PYTHON" scripts/race_smollm2.py "${e2e[@]}" --domains wikipedia shakespeare code
      [ "${SPLITS:-validation test}" = validation ] ||
        "$PYTHON" scripts/race_smollm2.py "${e2e[@]}" --split test --windows 32 ;;
    stages)
      "$PYTHON" scripts/race_smollm2.py "${recipe[@]}" --fit-text "$text" \
        --rows 'calibrated16384(-fitted150)?(-text[a-z]+)?$' --domains wikipedia shakespeare code ;;
    *) echo "usage: $0 fit|stages TEXT..." >&2; exit 2 ;;
  esac
done
