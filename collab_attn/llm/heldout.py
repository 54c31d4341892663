"""A converted pretrained language model measured against its original on held-out text: perplexity of both, the
KL divergence from the original's next-token distribution to the converted model's, and how often their most likely
next tokens agree.

Text never seen by a conversion or its re-training (``texts``): two domains, each with a fitting split and an
evaluation split that share no text.

- ``wikipedia``: fit on RTE and MRPC train sentences (news and Wikipedia), evaluate on the QNLI dev sentences
  (Wikipedia; GLUE ships QNLI's dev split only, and no conversion reads it).
- ``shakespeare``: Tiny Shakespeare split 90% / 10% in order, as nanoGPT splits it: fit on the first part, evaluate
  on the last.

Evaluation windows are consecutive, non-overlapping token windows of the evaluation text (sentences joined by a
space), so every model sees the same tokens; each window starts from the tokenizer's beginning-of-text token.
``agreement`` keeps each window's sums beside the totals, so two runs on the same windows can be compared by a
paired bootstrap over windows (``collab_attn.stats.window_bootstrap``).
"""

from __future__ import annotations

import csv
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

DOMAINS = ("wikipedia", "shakespeare")


def _tsv_column(path: Path, columns: Sequence[str]) -> list[str]:
    with open(path, newline="", encoding="utf-8") as handle:
        rows = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        missing = [c for c in columns if c not in (rows.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: no column {missing[0]!r} (columns: {rows.fieldnames})")
        return [row[c].strip() for row in rows for c in columns if row[c] and row[c].strip()]


def texts(domain: str, split: str, glue_dir: str | Path, shakespeare: str | Path) -> str:
    """The ``fit`` or ``eval`` text of ``domain`` (``DOMAINS``), one string."""
    if split not in ("fit", "eval"):
        raise ValueError(f"split={split!r}: use 'fit' (calibration, re-training) or 'eval' (held out)")
    if domain == "wikipedia":
        glue = Path(glue_dir)
        if split == "eval":
            return " ".join(_tsv_column(glue / "QNLI" / "dev.tsv", ["sentence"]))
        return " ".join(_tsv_column(glue / "RTE" / "train.tsv", ["sentence1", "sentence2"])
                        + _tsv_column(glue / "MRPC" / "train.tsv", ["#1 String", "#2 String"]))
    if domain == "shakespeare":
        text = Path(shakespeare).read_text(encoding="utf-8")
        cut = int(0.9 * len(text))
        return text[:cut] if split == "fit" else text[cut:]
    raise ValueError(f"domain={domain!r}: choose one of {', '.join(DOMAINS)}")


def windows(tokenizer, text: str, length: int, count: int) -> torch.Tensor:
    """``count`` consecutive windows of ``length`` tokens (the first one the beginning-of-text token) from the start
    of ``text``: a (count, length) tensor. Refused when the text is too short."""
    body = length - 1
    needed = body * count
    characters = 8 * needed  # tokenize a prefix that is long enough (a whole corpus takes seconds)
    while True:
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


@dataclass(frozen=True)
class Window:
    """One evaluation window's sums: what a paired bootstrap over windows resamples (``collab_attn.stats``).
    ``fingerprint`` names the window's token ids (CRC-32), so two runs can be checked to hold the same windows."""

    tokens: int  # next tokens predicted
    nll: float  # the model's summed negative log-likelihood of those tokens, nats
    original_nll: float  # the original's
    kl: float  # summed KL(original || model), nats
    top1: int  # positions whose most likely next token is the original's
    fingerprint: str

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "nll": self.nll, "original_nll": self.original_nll, "kl": self.kl,
                "top1": self.top1, "fingerprint": self.fingerprint}


@dataclass(frozen=True)
class Agreement:
    """One model against the original on the same tokens (every next-token prediction of every window), with each
    window's sums in ``windows``."""

    tokens: int
    perplexity: float
    original_perplexity: float
    kl: float  # mean KL(original || model) per token, nats
    top1: float  # fraction of positions whose most likely next token is the original's
    windows: tuple[Window, ...] = ()

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "perplexity": self.perplexity, "original_perplexity": self.original_perplexity,
                "kl": self.kl, "top1": self.top1, "windows": [w.as_dict() for w in self.windows]}


def fingerprint(ids: torch.Tensor) -> str:
    """The CRC-32 of one window's token ids (as int64), eight hex digits."""
    return f"{zlib.crc32(ids.detach().to('cpu', torch.int64).contiguous().numpy().tobytes()):08x}"


def _batches(rows: torch.Tensor, batch: int) -> Iterator[torch.Tensor]:
    for start in range(0, len(rows), batch):
        yield rows[start:start + batch]


@torch.no_grad()
def agreement(model, original, rows: torch.Tensor, batch: int = 4, progress=None) -> Agreement:
    """``model`` against ``original`` on the token windows ``rows``: perplexities of both on the next tokens, the
    mean KL divergence of the model's next-token distribution from the original's, top-1 agreement, and the same
    sums per window (``progress``: a tqdm bar advanced by the windows done)."""
    per_window = []
    for ids in _batches(rows, batch):
        ids = ids.to(model.device)
        logp = F.log_softmax(model(ids).logits[:, :-1].double(), dim=-1)
        ref = F.log_softmax(original(ids).logits[:, :-1].double(), dim=-1)
        target = ids[:, 1:, None]
        nll = -logp.gather(-1, target).sum(dim=(1, 2))
        original_nll = -ref.gather(-1, target).sum(dim=(1, 2))
        kl = (ref.exp() * (ref - logp)).sum(dim=(1, 2))
        agree = (logp.argmax(-1) == ref.argmax(-1)).sum(dim=1)
        for i in range(len(ids)):
            per_window.append(Window(int(target[i].numel()), float(nll[i]), float(original_nll[i]), float(kl[i]),
                                     int(agree[i]), fingerprint(ids[i])))
        if progress is not None:
            progress.update(len(ids))
    tokens = sum(w.tokens for w in per_window)
    return Agreement(tokens, math.exp(math.fsum(w.nll for w in per_window) / tokens),
                     math.exp(math.fsum(w.original_nll for w in per_window) / tokens),
                     math.fsum(w.kl for w in per_window) / tokens, sum(w.top1 for w in per_window) / tokens,
                     tuple(per_window))
