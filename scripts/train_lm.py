"""Train GPT-2-architecture character models on Tiny Shakespeare with concatenated or collaborative heads
(configs/train_lm.yaml, configs/recipe/{cpu,gpu}.yaml, collab_attn/char_lm/).

    python scripts/train_lm.py                                                   # cpu recipe, concatenated, seed 0
    python scripts/train_lm.py recipe=gpu attention=collab rank=192 seed=1
    python scripts/train_lm.py mode=sweep output_dir=experiments/shakespeare_char/cpu
    python scripts/train_lm.py trainer.max_steps=20 trainer.eval_steps=10 eval_iters=2 output_dir=outputs/lm_try

A finished run's JSON is skipped; run the same command again to resume an interrupted one.
Every setting, the text and the whole grid of runs are checked before anything is written: bad input exits with
status 2 and one ``error: ...`` line (collab_attn/cli.py).
Tables and plots: scripts/summarize.py lm.
"""

from __future__ import annotations

from omegaconf import DictConfig

from collab_attn.char_lm.runs import check, run_many
from collab_attn.cli import hydra_main, settings_of


def run(cfg: DictConfig) -> list[dict]:
    settings = settings_of(cfg)
    return run_many(settings, check(settings), progress=bool(settings.get("progress", True)))


@hydra_main("train_lm", check)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
