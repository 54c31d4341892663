"""Train a small transformer classifier from scratch with concatenated or collaborative heads at several key
sizes, same budget, several seeds, through the Hugging Face Trainer (see configs/scratch.yaml,
collab_attn/glue/scratch.py and the model in collab_attn/models/scratch_classifier.py).

    python scripts/train_scratch.py output_dir=experiments/scratch_sst2/trainer
    python scripts/train_scratch.py 'ranks=[128,16]' seeds=[0] train.max_steps=100 output_dir=outputs/scratch_try

Each run's result JSON appears only when the run has finished, and a run whose JSON exists is skipped, so an
interrupted sweep resumes by running the same command again (the interrupted run from its last checkpoint, every
checkpoint_every steps). results.md and curves.png are rewritten at the end.
Every setting, the data files and the whole grid are checked before anything is written: bad input exits with
status 2 and one ``error: ...`` line (collab_attn/cli.py).
"""

from __future__ import annotations

from omegaconf import DictConfig

from collab_attn.cli import hydra_main, settings_of
from collab_attn.glue.scratch import check, run_sweep


def run(cfg: DictConfig) -> list[dict]:
    settings = settings_of(cfg)
    return run_sweep(settings, progress=bool(settings.get("progress", True)))


@hydra_main("scratch", check)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
