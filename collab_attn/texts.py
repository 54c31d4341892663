"""Texts to calibrate activation-aware fitting on: read from a file, sampled with a seed.

A GLUE ``.tsv`` is read through ``collab_attn.glue.tasks`` (its task's text fields), imported only when such a file
is asked for, so that this module itself depends on no GLUE code.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CALIBRATION_SAMPLES = 512  # texts sampled from a file or a task to calibrate on, unless told otherwise


def load_texts(
    source: str | Path, limit: int | None = CALIBRATION_SAMPLES, seed: int = 0
) -> list[str | tuple[str, str]]:
    """Calibration texts from a file: a ``.tsv`` of the GLUE layout (``<glue_dir>/<Task>/{train,dev}.tsv``: the
    task's text fields, one text or sentence pair per row) or any other text file (one text per non-empty line).
    With more than ``limit`` texts, a sample of ``limit`` drawn with ``seed`` (in file order)."""
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"calibration text file {path} not found")
    if path.suffix == ".tsv":
        from collab_attn.glue.tasks import task_texts

        split = {"train.tsv": "train", "dev.tsv": "validation"}.get(path.name)
        if split is None:
            raise ValueError(f"{path}: expected a GLUE train.tsv or dev.tsv")
        return task_texts(path.parent.name, path.parent.parent, split, limit=limit, seed=seed)
    with path.open(encoding="utf-8") as handle:
        texts = [line.strip() for line in handle if line.strip()]
    if not texts:
        raise ValueError(f"{path} holds no texts")
    return sample_texts(texts, limit, seed)


def sample_texts(texts: list, limit: int | None, seed: int) -> list:
    """``texts`` as they are when ``limit`` is None or not exceeded, else ``limit`` of them drawn with ``seed``, in
    their order."""
    if limit is not None and len(texts) > limit:
        keep = np.sort(np.random.RandomState(seed).choice(len(texts), limit, replace=False))
        texts = [texts[i] for i in keep]
    return texts
