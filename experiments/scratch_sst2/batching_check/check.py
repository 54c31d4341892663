"""The hand-written loop that made ../runs (collab_attn/glue/scratch.py at commit 4910c22, before issue 28), run
again for collaborative heads: ``pooled`` keeps its batches (length-sorted pools of 50 batches, batches shuffled),
``random`` swaps in uniformly random batches like the Trainer's. Does the batching explain why the collaborative
numbers moved when the sweep went through the Trainer (../trainer)?

    git show 4910c22:collab_attn/glue/scratch.py > /tmp/old_scratch.py
    mkdir -p /tmp/sweep_src && git archive e63e4a9 collab_attn configs scripts | tar -x -C /tmp/sweep_src
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=/tmp/sweep_src python experiments/scratch_sst2/batching_check/check.py pooled
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=/tmp/sweep_src python experiments/scratch_sst2/batching_check/check.py random
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, "/tmp")
import old_scratch as old  # noqa: E402

mode = sys.argv[1]
if mode == "random":
    def random_batches(lengths, batch_size, generator, pool_batches=50):
        while True:
            order = torch.randperm(len(lengths), generator=generator).tolist()
            for start in range(0, len(order), batch_size):
                yield order[start:start + batch_size]

    old._shuffled_batches = random_batches
here = Path(__file__).resolve().parent
settings = {
    "task": "sst2", "glue_dir": str(here.parents[3] / "shared" / "data" / "glue"), "max_train_samples": None,
    "max_eval_samples": None, "tokenizer": "minilm", "max_length": 64,
    "model": {"d_model": 128, "num_layers": 2, "num_heads": 8, "ffn_dim": 512, "dropout": 0.1, "pooling": "mean",
              "mixing_init": "random"},
    "kinds": ["collab"], "ranks": [64, 32] if mode == "random" else [64], "seeds": [0, 1, 2] if mode == "random" else [0],
    "train": {"steps": 500, "batch_size": 64, "lr": 1e-3, "weight_decay": 0.01, "warmup_ratio": 0.1, "grad_clip": 1.0,
              "eval_every": 50, "eval_batch_size": 256},
    "threads": 1, "output_dir": str(here / mode),
}
old.run_sweep(settings, progress=False)
