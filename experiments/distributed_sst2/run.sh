#!/usr/bin/env bash
# docs/glue.md, "Several processes, one job": one short SST-2 job (fine-tune 24 steps on 768 sentences, convert at
# rank 128, re-fine-tune) on 1 process, on 2 processes (torchrun, gloo on the CPU: each process 16 of the 32 examples
# of a step), and on 1 process with seed 1 (the seed-to-seed spread the process count is compared with); every dev
# sentence scored. Each in its own output_root: a job's folder does not depend on the process count, so a finished job
# is skipped by a rerun with another count. Resumable.
#
#   bash experiments/distributed_sst2/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
out=experiments/distributed_sst2
job=(task=sst2 data.glue_dir=../shared/data/glue collab.rank=128 collab.tol=1e-5 collab.n_iter_max=30
     trainer.learning_rate=1e-4 refit.learning_rate=1e-4 trainer.max_steps=24 data.max_train_samples=768
     sweep_name=distributed_sst2)
OMP_NUM_THREADS=1 "$PYTHON" scripts/train_glue.py "${job[@]}" output_root=$out/one_process
OMP_NUM_THREADS=1 "$PYTHON" -m torch.distributed.run --nproc_per_node=2 scripts/train_glue.py "${job[@]}" \
  output_root=$out/two_processes
OMP_NUM_THREADS=1 "$PYTHON" scripts/train_glue.py "${job[@]}" seed=1 output_root=$out/one_process
