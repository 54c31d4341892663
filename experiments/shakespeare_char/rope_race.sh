#!/usr/bin/env bash
# The from-scratch race with rotary positions (issue 69): Tiny Shakespeare, nanoGPT's cpu model (4 layers, 4 heads
# of 32, d = 128) at a context of 256 with batch 3 (nanoGPT's 768 tokens a step), 2,000 steps, seeds 0-2.
# Sizes: python scripts/kv_budgets.py --positions rope. Resumable: a finished run is skipped, an interrupted one
# continues from its last checkpoint.
#   bash experiments/shakespeare_char/rope_race.sh                 # the race, every run one after the other
#   bash experiments/shakespeare_char/rope_race.sh race 0 2        # worker 0 of 2 (every other run), beside worker 1
#   bash experiments/shakespeare_char/rope_race.sh extra 0 2       # what explains its gaps (below)
#   bash experiments/shakespeare_char/rope_race.sh long 0 2        # three rows at 4,000 steps
#   bash experiments/shakespeare_char/rope_race.sh longer 0 2      # the same three at 8,000 steps
#   bash experiments/shakespeare_char/rope_race.sh longer-rest 0 2 # 1/2 and 1/8 at 8,000 steps
#   bash experiments/shakespeare_char/rope_race.sh longer-peers 0 2 # MLA at 1/2 and 1/4 at 8,000 steps
#   bash experiments/shakespeare_char/rope_race.sh longer-tpa 0 2  # TPA at its two budgets at 8,000 steps
#   bash experiments/shakespeare_char/rope_race.sh longest 0 2     # 1/2 and 1/8 at 12,000 steps
#   bash experiments/shakespeare_char/rope_race.sh longest-original 0 2  # the original at 12,000 steps
#   bash experiments/shakespeare_char/rope_race.sh longest-tpa 0 2 # TPA at ranks 2/2 at 12,000 steps
# Then: python scripts/summarize.py lm experiments/shakespeare_char
set -euo pipefail
set_name=${1:-race}
worker=${2:-0}
workers=${3:-1}
C="block_size=256 trainer.per_device_train_batch_size=3 eval_iters=100 threads=1 progress=false save_models=[]"
O="output_dir=experiments/shakespeare_char/rope_race $C trainer.eval_steps=200"
R="$O positions=rope"
seeds="0 1 2"
case $set_name in
  race) runs=(
    "$R attention=concat"                                   # 1: the original, rotary
    "$O attention=concat"                                   # 1: the original, learned positions (GPT-2)
    "$R attention=gqa kv_heads=2"                           # 1/2
    "$R attention=collab rank=64 value_rank=64"         # 1/2
    "$R attention=mla latent_size=112"                      # 1/2 (rotary key 16)
    "$R attention=tpa rank=2"                           # 0.5625 (ranks 2 and 2: its closest to 1/2)
    "$R attention=mqa"                                      # 1/4
    "$R attention=collab rank=32 value_rank=32"         # 1/4
    "$R attention=mla latent_size=48"                       # 1/4 (rotary key 16)
    "$R attention=tpa rank=1"                           # 0.281 (ranks 1 and 1: its closest to 1/4)
    "$R attention=collab rank=16 value_rank=16"         # 1/8
    "$R attention=mla latent_size=16"                       # 1/8 (rotary key 16)
  );;
  # the rotary original at the cpu recipe itself (context 64, batch 12), against kv_race's learned-position original
  # (the same settings); collaborative keys and values at 1/4 with the 64 numbers per layer split otherwise
  extra) runs=(
    "output_dir=experiments/shakespeare_char/rope_cpu threads=1 progress=false save_models=[] positions=rope
attention=concat"
    "$R attention=collab rank=48 value_rank=16"
    "$R attention=collab rank=16 value_rank=48"
  );;
  # twice the steps: how much longer training moves the original and the 1/4 row
  long)
    seeds="0 1 2"
    L="output_dir=experiments/shakespeare_char/rope_race_long $C trainer.max_steps=4000 trainer.eval_steps=400
positions=rope"
    runs=("$L attention=concat" "$L attention=mqa" "$L attention=collab rank=32 value_rank=32");;
  # four times the steps: until the last 10% of training moves the loss by less than the spread over seeds
  longer|longer-rest|longer-peers|longer-tpa)
    L="output_dir=experiments/shakespeare_char/rope_race_8000 $C trainer.max_steps=8000 trainer.eval_steps=400
positions=rope"
    if [[ $set_name == longer ]]; then
      runs=("$L attention=concat" "$L attention=mqa" "$L attention=collab rank=32 value_rank=32")
    elif [[ $set_name == longer-rest ]]; then
      runs=("$L attention=gqa kv_heads=2" "$L attention=collab rank=64 value_rank=64"
            "$L attention=mla latent_size=16" "$L attention=collab rank=16 value_rank=16")
    elif [[ $set_name == longer-peers ]]; then
      runs=("$L attention=mla latent_size=48" "$L attention=mla latent_size=112")
    else
      runs=("$L attention=tpa rank=2" "$L attention=tpa rank=1")
    fi;;
  # six times the steps, for the rows whose last 10% still moved more than their spread at 8,000
  longest|longest-original|longest-tpa)
    L="output_dir=experiments/shakespeare_char/rope_race_12000 $C trainer.max_steps=12000 trainer.eval_steps=600
positions=rope"
    if [[ $set_name == longest ]]; then
      runs=("$L attention=mla latent_size=112" "$L attention=collab rank=64 value_rank=64"
            "$L attention=gqa kv_heads=2" "$L attention=mla latent_size=16"
            "$L attention=collab rank=16 value_rank=16")
    elif [[ $set_name == longest-original ]]; then
      runs=("$L attention=concat")
    else
      runs=("$L attention=tpa rank=2")
    fi;;
  *) echo "unknown run set $set_name: race, extra, long, longer, longer-rest, longer-peers, longer-tpa, longest, longest-original or longest-tpa" >&2
     exit 2;;
esac
i=0
for seed in $seeds; do
  for run in "${runs[@]}"; do
    if (( i % workers == worker )); then
      # shellcheck disable=SC2086
      python scripts/train_lm.py $run seed=$seed
    fi
    i=$((i + 1))
  done
done
