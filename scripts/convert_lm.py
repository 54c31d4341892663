"""Convert the trained concatenated character model at n_embd/2, /4, /8 with plain CP, activation-aware CP,
SVD-truncated heads and head pruning; validation loss without and after a short re-training, and samples
(configs/convert_lm.yaml, collab_attn/lm/convert.py).

    python scripts/convert_lm.py train_dir=experiments/shakespeare_char/cpu
    python scripts/convert_lm.py train_dir=experiments/shakespeare_char/cpu 'methods=[svd]' 'key_sizes=[64]'

Finished (method, key size) results are skipped; run the same command again to resume.
Bad input (ValueError, FileNotFoundError) exits with status 2 and one ``error: ...`` line.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from collab_attn.cli import run_or_exit
from collab_attn.lm.convert import run_conversions


def run(cfg: DictConfig) -> list[dict]:
    settings = OmegaConf.to_container(cfg, resolve=True)
    settings.pop("hydra", None)
    return run_conversions(settings, progress=bool(settings.get("progress", True)))


@hydra.main(version_base="1.3", config_path="../configs", config_name="convert_lm")
def main(cfg: DictConfig) -> None:
    run_or_exit(run, cfg)


if __name__ == "__main__":
    main()
