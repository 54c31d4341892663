#!/usr/bin/env bash
# Issue 56: the 1/4-cache row of the from-scratch race (kv_race.md) at twice the iterations (4,000, the cosine
# schedule over all 4,000), MQA and collaborative keys and values (D~ = D_v = 30), seeds 0-2, one thread each,
# one after another (seed by seed, the two methods alternating). Resumable: a finished run's JSON is skipped and an
# interrupted run continues from its last checkpoint, so run the same command again to finish the rest:
#   nohup nice -n 10 bash experiments/shakespeare_char/kv_race_4000_iters.sh > /tmp/kv_race_4000_iters.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=${PYTHON:-.venv/bin/python}
O="output_dir=experiments/shakespeare_char/kv_race_4000_iters threads=1 progress=false save_models=[] trainer.max_steps=4000"
for seed in 0 1 2; do
  $PY scripts/train_lm.py $O attention=mqa seed=$seed
  $PY scripts/train_lm.py $O attention=collab rank=30 value_rank=30 seed=$seed
done
