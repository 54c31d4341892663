"""Tiny Shakespeare as nanoGPT's ``data/shakespeare_char/prepare.py`` defines it, and the blocks models train on.

- Vocabulary: the sorted set of the file's characters; a character's id is its index in that list.
- Split: the first 90% of the characters (``int(n * 0.9)``) are the training text, the rest the validation text,
  in order.
- Training blocks: nanoGPT's ``get_batch``: a block starts at a uniformly random offset ``i`` of the training text,
  its inputs are ``text[i : i + block]`` and its targets ``text[i + 1 : i + block + 1]`` (every position is
  predicted, the last one included). All offsets of a run are drawn up front from one seeded generator, so every
  variant trained with the same seed sees the same batches in the same order.
- Validation: nanoGPT estimates the loss as the mean over ``eval_iters`` batches drawn afresh at each evaluation.
  Here the ``eval_iters x batch`` blocks are drawn once with a fixed seed (``EVAL_SEED``) and every evaluation of
  every run uses the same ones: the same estimator in expectation, without the evaluation-to-evaluation noise, and
  the same blocks for every variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from collab_attn import cli

DEFAULT_PATH = Path("../shared/data/tinyshakespeare/input.txt")
EVAL_SEED = 1337  # nanoGPT's seed; the validation blocks are the same for every run


@dataclass
class CharCorpus:
    chars: list[str]
    train: torch.Tensor  # (n_train,) int64 character ids
    val: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        index = {c: i for i, c in enumerate(self.chars)}
        unknown = sorted(set(text) - set(index))
        if unknown:
            raise ValueError(f"characters {unknown} are not in the vocabulary")
        return [index[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def corpus_from_text(text: str) -> CharCorpus:
    """Vocabulary and 90/10 split of ``text``, as nanoGPT's ``prepare.py``."""
    if len(text) < 20:
        raise ValueError(f"the text has {len(text)} characters; need at least 20 for a 90/10 split")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    n = int(len(text) * 0.9)
    return CharCorpus(chars, ids[:n], ids[n:])


def load_corpus(path: str | Path = DEFAULT_PATH, name: str = "data.path") -> CharCorpus:
    """The corpus of the UTF-8 text file ``path``; a missing, unreadable or binary file, or a text too short to split,
    is refused naming the setting ``name`` it came from."""
    path = Path(path)
    if not path.exists():
        raise cli.Missing(
            f"no text at {path}: pass {name}=<input.txt> (Tiny Shakespeare: "
            "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt)"
        )
    with cli.naming(name, path):
        return corpus_from_text(cli.text_file(name, path))


class Blocks(Dataset):
    """``count`` blocks of ``block_size`` characters at offsets drawn uniformly with ``seed`` from ``ids``. Item ``i``
    is ``{"input_ids", "labels", "shift_labels"}``: ``shift_labels`` holds the next character of each position (the
    transformers causal-LM loss uses it as the targets, unshifted); ``labels`` only tells the model to compute a
    loss. Read in order (the Trainer's ``train_sampling_strategy="sequential"``) they are nanoGPT's batches."""

    def __init__(self, ids: torch.Tensor, block_size: int, count: int, seed: int):
        if block_size < 1 or count < 1:
            raise ValueError(f"need a positive block size and count, got {block_size} and {count}")
        if len(ids) <= block_size:
            raise ValueError(f"the text has {len(ids)} characters, too few for blocks of {block_size} + 1")
        self.ids, self.block_size = ids, block_size
        generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(len(ids) - block_size, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = int(self.offsets[i])
        chunk = self.ids[start : start + self.block_size + 1]
        inputs, targets = chunk[:-1].clone(), chunk[1:].clone()
        return {"input_ids": inputs, "labels": targets, "shift_labels": targets}


def train_blocks(corpus: CharCorpus, block_size: int, batch_size: int, steps: int, seed: int) -> Blocks:
    """Every training block of a run: ``steps x batch_size`` of them, drawn with the run's seed."""
    return Blocks(corpus.train, block_size, steps * batch_size, seed)


def val_blocks(corpus: CharCorpus, block_size: int, batch_size: int, eval_iters: int) -> Blocks:
    """The fixed validation blocks (``eval_iters`` batches of ``batch_size``), the same for every run."""
    return Blocks(corpus.val, block_size, eval_iters * batch_size, EVAL_SEED)


def input_batches(blocks: Blocks, batch_size: int, limit: int) -> list[dict[str, torch.Tensor]]:
    """The first ``limit`` blocks as ``{"input_ids"}`` batches (for calibration statistics)."""
    ids = torch.stack([blocks[i]["input_ids"] for i in range(min(limit, len(blocks)))])
    return [{"input_ids": ids[i : i + batch_size]} for i in range(0, len(ids), batch_size)]
