"""GLUE pipeline entry point: fine-tune, reparametrize, evaluate, re-fine-tune (see configs/train_glue.yaml).

    python scripts/train_glue.py task=mrpc data.glue_dir=../shared/data/glue collab.rank=128
    python scripts/train_glue.py -m task=mrpc,rte collab.rank=384,256,128 seed=0,1,2
    python scripts/train_glue.py -m +experiment=minilm_mrpc_rte data.glue_dir=../shared/data/glue

Each job appends nothing until it has finished: its results.jsonl appears whole at the end, and a job whose
results exist is skipped, so an interrupted sweep resumes by running the same command again. Bad input
(ValueError, FileNotFoundError) exits with status 2 and one ``error: ...`` line, before any training.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from collab_attn.glue.pipeline import run_job


def run(cfg: DictConfig) -> list[dict]:
    return run_job(OmegaConf.to_container(cfg, resolve=True))


@hydra.main(version_base="1.3", config_path="../configs", config_name="train_glue")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
