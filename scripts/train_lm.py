"""Train GPT-2-architecture character models on Tiny Shakespeare with concatenated or collaborative heads
(configs/train_lm.yaml, configs/recipe/{cpu,gpu}.yaml, collab_attn/lm/).

    python scripts/train_lm.py                                                   # cpu recipe, concatenated, seed 0
    python scripts/train_lm.py recipe=gpu attention=collab key_size=192 seed=1
    python scripts/train_lm.py mode=sweep output_dir=experiments/shakespeare_char/cpu
    python scripts/train_lm.py trainer.max_steps=20 trainer.eval_steps=10 eval_iters=2 output_dir=outputs/lm_try

A finished run's JSON is skipped; run the same command again to resume an interrupted one.
Bad input (ValueError, FileNotFoundError) exits with status 2 and one ``error: ...`` line, before any training.
Tables and plots: scripts/summarize_lm.py.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from collab_attn.cli import run_or_exit
from collab_attn.lm.runs import plan, run_many

MODES = ("train", "sweep")


def run(cfg: DictConfig) -> list[dict]:
    settings = OmegaConf.to_container(cfg, resolve=True)
    settings.pop("hydra", None)
    mode = settings["mode"]
    if mode == "train":
        key = settings["key_size"] or settings["model"]["n_embd"]
        runs = [(settings["attention"], int(key), int(settings["seed"]))]
    elif mode == "sweep":
        runs = plan(settings)
    else:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    return run_many(settings, runs, progress=bool(settings.get("progress", True)))


@hydra.main(version_base="1.3", config_path="../configs", config_name="train_lm")
def main(cfg: DictConfig) -> None:
    run_or_exit(run, cfg)


if __name__ == "__main__":
    main()
