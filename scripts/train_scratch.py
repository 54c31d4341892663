"""Train a small transformer classifier from scratch with concatenated or collaborative heads at several key
sizes, same budget, several seeds, through the Hugging Face Trainer (see configs/scratch.yaml,
collab_attn/glue/scratch.py and the model in collab_attn/models/scratch.py).

    python scripts/train_scratch.py output_dir=experiments/scratch_sst2/trainer
    python scripts/train_scratch.py 'key_sizes=[128,16]' seeds=[0] train.max_steps=100 output_dir=outputs/scratch_try

Each run's result JSON appears only when the run has finished, and a run whose JSON exists is skipped, so an
interrupted sweep resumes by running the same command again (the interrupted run from its last checkpoint, every
checkpoint_every steps). results.md and curves.png are rewritten at the end.
Bad input (ValueError, FileNotFoundError) exits with status 2 and one ``error: ...`` line, before any training.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from collab_attn.cli import run_or_exit
from collab_attn.glue.scratch import run_sweep


def run(cfg: DictConfig) -> list[dict]:
    settings = OmegaConf.to_container(cfg, resolve=True)
    settings.pop("hydra", None)
    return run_sweep(settings, progress=bool(settings.get("progress", True)))


@hydra.main(version_base="1.3", config_path="../configs", config_name="scratch")
def main(cfg: DictConfig) -> None:
    run_or_exit(run, cfg)


if __name__ == "__main__":
    main()
