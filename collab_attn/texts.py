"""Texts to calibrate activation-aware fitting on: a file of one text per line, sampled with a seed; a long text cut
into windows of tokens one after another (``windows``: held-out text, fitting and distillation windows).

Nothing here knows GLUE: ``collab_attn.glue.calibrate.load_texts`` reads a GLUE ``.tsv`` and hands any other file
to ``read_texts``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

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


def windows(tokenizer, text: str, length: int, count: int | None = None) -> torch.Tensor:
    """``count`` consecutive windows of ``length`` tokens (the first one the beginning-of-text token) from the start
    of ``text``: a (count, length) tensor; every window the text holds when ``count`` is None. Refused when the text
    is too short, and for fewer than 2 tokens a window or no windows (nothing to predict)."""
    whole = count is None
    if type(length) is not int or length < 2 or not (whole or type(count) is int and count >= 1):
        raise ValueError(f"windows of length={length!r} x count={count!r}: a window holds the beginning-of-text token "
                         "and at least one more (length >= 2), and at least one window is asked for (count >= 1)")
    body = length - 1
    if whole:  # the whole text, tokenized once
        ids = tokenizer(text, add_special_tokens=False).input_ids
        count = max(1, len(ids) // body)
    needed = body * count
    characters = 8 * needed  # tokenize a prefix that is long enough (a whole corpus takes seconds)
    while not whole:
        ids = tokenizer(text[:characters], add_special_tokens=False).input_ids
        if len(ids) > needed + 16 or characters >= len(text):  # the tokens near a cut may differ: keep a margin
            break
        characters *= 2
    if len(ids) < needed:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {count} windows of {length}")
    bos = tokenizer.bos_token_id
    if bos is None:
        raise ValueError("the tokenizer has no beginning-of-text token to start each window with")
    rows = [[bos] + ids[i * body:(i + 1) * body] for i in range(count)]
    return torch.tensor(rows)
