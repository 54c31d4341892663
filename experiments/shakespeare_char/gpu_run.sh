#!/usr/bin/env bash
# Every Tiny Shakespeare run of issue 30 on one GPU, in at most LM_DEADLINE seconds (default 510), from the
# repository root:
#
#   OUT=/some/empty/folder bash experiments/shakespeare_char/gpu_run.sh
#
# At the same time:
#   - the gpu recipe (nanoGPT's 6x6x384, 5000 iterations): concatenated, seed 0, and collaborative at d/2, seed 0;
#   - the cpu-recipe grid: {concat, collab} x {128, 64, 32, 16} x seeds {0, 1, 2}, LM_PARALLEL (8) processes at once;
#   - as soon as the cpu-recipe concatenated seed-0 model exists: its conversions (none, cp, cp-aware, svd, prune at
#     64, 32, 16), one process per method.
# Results: $OUT/shakespeare_char/{cpu,gpu}/runs/*.json and cpu/convert/runs/*.json, laid out so that copying
# $OUT/shakespeare_char/ over experiments/shakespeare_char/ gives the committed layout; then, on any machine,
# `python scripts/summarize.py lm` writes the tables, plots and samples into experiments/shakespeare_char/results.md.
# Logs go to $OUT/lm_logs, the trained cpu-recipe model to $OUT/lm_models (neither is committed).
# Every process runs under `timeout` against one deadline, so the script always finishes and keeps what finished.
#
# Settings (environment): PYTHON (python), LM_DATA (the Tiny Shakespeare input.txt; looked for beside the project
# otherwise), LM_DEADLINE (seconds, 510), LM_PARALLEL (8), LM_GPU_COLLAB (1: also the collaborative gpu run),
# LM_SMOKE (1: tiny models and a few iterations, to test this script on a CPU in a minute or two).
set -u
: "${OUT:?set OUT to the folder that receives the results}"
PYTHON=${PYTHON:-python}
DEADLINE=${LM_DEADLINE:-510}
PARALLEL=${LM_PARALLEL:-8}
START=$(date +%s)
R="$OUT/shakespeare_char"
LOGS="$OUT/lm_logs"
mkdir -p "$R" "$LOGS"
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1

DATA=${LM_DATA:-}
for candidate in "$DATA" ../shared/data/tinyshakespeare/input.txt shared/data/tinyshakespeare/input.txt; do
  if [ -n "$candidate" ] && [ -f "$candidate" ]; then DATA=$candidate; break; fi
done
if [ ! -f "$DATA" ]; then echo "error: no Tiny Shakespeare input.txt; set LM_DATA" >&2; exit 2; fi

# Seconds left before the deadline, less a margin for the last writes.
# Never below 1: `timeout 0` would mean no limit at all.
left() { local s=$(( DEADLINE - ($(date +%s) - START) - ${1:-10} )); echo $(( s > 0 ? s : 1 )); }

COMMON=("data.path=$DATA" "progress=false" "threads=1" "checkpoint_every=null")
D=128   # the cpu recipe's n_embd
GPU_D=384
if [ "${LM_SMOKE:-0}" = 1 ]; then
  SMOKE=("model.n_layer=1" "model.n_head=2" "model.n_embd=16" "block_size=16" "eval_iters=2" "trainer.max_steps=20"
         "trainer.eval_steps=10" "trainer.logging_steps=10" "trainer.warmup_steps=2" "sample_chars=40")
  COMMON+=("${SMOKE[@]}")
  D=16
  GPU_D=16
fi

{ nvidia-smi || true; "$PYTHON" -c "import torch, transformers; print(torch.__version__, transformers.__version__, \
torch.cuda.is_available())"; } > "$LOGS/environment.txt" 2>&1

# 1. The gpu recipe, in the background.
gpu_run() {  # kind key
  timeout "$(left 15)" "$PYTHON" scripts/train_lm.py recipe=gpu "${COMMON[@]}" output_dir="$R/gpu" attention="$1" \
    rank="$2" seed=0 'save_models=[]' > "$LOGS/gpu-$1-k$2.log" 2>&1
  echo "gpu recipe $1 k$2: exit $? after $(( $(date +%s) - START )) s"
}
gpu_run concat "$GPU_D" &
GPU_PIDS=($!)
if [ "${LM_GPU_COLLAB:-1}" = 1 ]; then
  gpu_run collab $(( GPU_D / 2 )) &
  GPU_PIDS+=($!)
fi

# 2. The conversions, in the background, once the cpu-recipe concatenated seed-0 model is saved.
convert_all() {
  local model="$R/cpu/models/concat-k$D-seed0"
  while [ ! -f "$R/cpu/runs/concat-k$D-seed0.json" ]; do
    [ "$(left 60)" -le 1 ] && { echo "conversion: no trained model in time"; return; }
    sleep 5
  done
  local pids=()
  for method in none cp cp-aware svd prune; do
    timeout "$(left 10)" "$PYTHON" scripts/convert_lm.py "${COMMON[@]}" train_dir="$R/cpu" model_dir="$model" \
      "methods=[$method]" > "$LOGS/convert-$method.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  echo "conversions: done after $(( $(date +%s) - START )) s"
}
convert_all &
CONVERT_PID=$!

# 3. The cpu-recipe grid, LM_PARALLEL at a time; the concatenated seed-0 run first (the conversions wait for it).
for seed in 0 1 2; do
  for key in $D $(( D / 2 )) $(( D / 4 )) $(( D / 8 )); do
    for kind in concat collab; do echo "$kind $key $seed"; done
  done
done > "$LOGS/grid.txt"
export PYTHON R LOGS START DEADLINE
export COMMON_ARGS="${COMMON[*]}"
xargs -P "$PARALLEL" -L 1 bash -c '
  left=$(( DEADLINE - ($(date +%s) - START) - 10 ))
  [ "$left" -le 0 ] && exit 0
  read -r -a common <<< "$COMMON_ARGS"
  timeout "$left" "$PYTHON" scripts/train_lm.py "${common[@]}" output_dir="$R/cpu" attention="$0" rank="$1" \
    seed="$2" > "$LOGS/cpu-$0-k$1-seed$2.log" 2>&1
  echo "cpu recipe $0 k$1 seed$2: exit $? after $(( $(date +%s) - START )) s"
  exit 0
' < "$LOGS/grid.txt"

wait "$CONVERT_PID" "${GPU_PIDS[@]}"
# Keep the trained model and the leftovers of interrupted runs out of the committed layout.
mkdir -p "$OUT/lm_models"
for folder in "$R"/*/models; do [ -d "$folder" ] && cp -r "$folder"/. "$OUT/lm_models/" && rm -rf "$folder"; done
rm -rf "$R"/*/.checkpoints "$R"/*/convert/.checkpoints
echo "finished after $(( $(date +%s) - START )) s:"
find "$R" -name '*.json' | sort | sed "s|$R/||"
