"""GLUE pipeline entry point: fine-tune, reparametrize, evaluate, re-fine-tune (see configs/train_glue.yaml).

    python scripts/train_glue.py task=mrpc data.glue_dir=../shared/data/glue collab.rank=128
    python scripts/train_glue.py -m task=mrpc,rte collab.rank=384,256,128 seed=0,1,2
    python scripts/train_glue.py -m +experiment=minilm_mrpc_rte data.glue_dir=../shared/data/glue
    torchrun --nproc_per_node=2 scripts/train_glue.py task=mrpc data.glue_dir=../shared/data/glue collab.rank=128

Each job appends nothing until it has finished: its results.jsonl appears whole at the end, and a job whose
results exist is skipped, so an interrupted sweep resumes by running the same command again. Every job of the
command line (each of a ``-m`` sweep) is checked before anything is written: bad input exits with status 2 and one
``error: ...`` line (collab_attn/cli.py).
Launched in several processes (torchrun, accelerate launch), every process trains and rank 0 alone writes: the
other ranks keep Hydra from writing its run folder and logs too.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

from omegaconf import DictConfig

from collab_attn.cli import hydra_main, settings_of
from collab_attn.distributed import is_main
from collab_attn.glue.jobs import GlueJob
from collab_attn.glue.pipeline import run_job, validate


def run(cfg: DictConfig) -> list[dict]:
    return run_job(GlueJob.of(settings_of(cfg)))


def _quiet_replica() -> None:
    """Hydra's folders and log file of a rank other than 0 go to a temporary folder, removed at exit."""
    scratch = tempfile.mkdtemp(prefix=f"train_glue-rank{os.environ['RANK']}-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    sys.argv += [
        f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}", "hydra.output_subdir=null",
        "hydra/job_logging=disabled",
    ]


@hydra_main("train_glue", validate, report=is_main)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    if not is_main():
        _quiet_replica()
    main()
