"""Convert the trained concatenated character model at n_embd/2, /4, /8 with plain CP, activation-aware CP,
SVD-truncated heads and head pruning; validation loss without and after a short re-training, and samples
(configs/convert_lm.yaml, collab_attn/char_lm/convert.py).

    python scripts/convert_lm.py train_dir=experiments/shakespeare_char/cpu
    python scripts/convert_lm.py train_dir=experiments/shakespeare_char/cpu 'methods=[svd]' 'ranks=[64]'

Finished (method, rank) results are skipped; run the same command again to resume.
Every setting, the trained model and the whole (method, rank) grid are checked before anything is written: bad
input exits with status 2 and one ``error: ...`` line (collab_attn/cli.py).
"""

from __future__ import annotations

from omegaconf import DictConfig

from collab_attn.char_lm.convert import check, run_conversions
from collab_attn.cli import hydra_main, settings_of


def run(cfg: DictConfig) -> list[dict]:
    settings = settings_of(cfg)
    return run_conversions(settings, progress=bool(settings.get("progress", True)))


@hydra_main("convert_lm", check)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
