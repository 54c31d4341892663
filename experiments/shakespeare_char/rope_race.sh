#!/usr/bin/env bash
# The from-scratch race with rotary positions (issue 69): Tiny Shakespeare, nanoGPT's cpu model (4 layers, 4 heads
# of 32, d = 128) at a context of 256 with batch 3 (nanoGPT's 768 tokens a step), 2,000 steps, seeds 0-2.
# Sizes: python scripts/kv_budgets.py --positions rope. Resumable: a finished run is skipped, an interrupted one
# continues from its last checkpoint.
#   bash experiments/shakespeare_char/rope_race.sh          # every run, one after the other
#   bash experiments/shakespeare_char/rope_race.sh 0 2      # worker 0 of 2 (every other run), beside worker 1
# Then: python scripts/summarize_lm.py experiments/shakespeare_char
set -euo pipefail
worker=${1:-0}
workers=${2:-1}
O="output_dir=experiments/shakespeare_char/rope_race block_size=256 trainer.per_device_train_batch_size=3
eval_iters=100 trainer.eval_steps=200 threads=1 progress=false save_models=[]"
R="$O positions=rope"
runs=(
  "$R attention=concat"                                   # 1: the original, rotary
  "$O attention=concat"                                   # 1: the original, learned positions (GPT-2)
  "$R attention=gqa kv_heads=2"                           # 1/2
  "$R attention=collab key_size=64 value_size=64"         # 1/2
  "$R attention=mla latent_size=112"                      # 1/2 (rotary key 16)
  "$R attention=tpa key_size=2"                           # 0.5625 (ranks 2 and 2: its closest to 1/2)
  "$R attention=mqa"                                      # 1/4
  "$R attention=collab key_size=32 value_size=32"         # 1/4
  "$R attention=mla latent_size=48"                       # 1/4 (rotary key 16)
  "$R attention=tpa key_size=1"                           # 0.281 (ranks 1 and 1: its closest to 1/4)
  "$R attention=collab key_size=16 value_size=16"         # 1/8
  "$R attention=mla latent_size=16"                       # 1/8 (rotary key 16)
)
i=0
for seed in 0 1 2; do
  for run in "${runs[@]}"; do
    if (( i % workers == worker )); then
      # shellcheck disable=SC2086
      python scripts/train_lm.py $run seed=$seed
    fi
    i=$((i + 1))
  done
done
