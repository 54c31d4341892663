"""Texts to calibrate activation-aware fitting on: a file of one text per line, sampled with a seed.

Nothing here knows GLUE: ``collab_attn.glue.calibrate.load_texts`` reads a GLUE ``.tsv`` and hands any other file
to ``read_texts``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CALIBRATION_SAMPLES = 512  # texts sampled from a file or a task to calibrate on, unless told otherwise
DEFAULT_MAX_LENGTH = 128  # tokens per calibration text


def read_texts(source: str | Path, limit: int | None = CALIBRATION_SAMPLES, seed: int = 0) -> list[str]:
    """The texts of a text file, one per non-empty line. With more than ``limit`` texts, a sample of ``limit``
    drawn with ``seed`` (in file order)."""
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"calibration text file {path} not found")
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
