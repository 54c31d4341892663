"""A short distillation of a converted language model from its original: the student (the converted model, every
weight trainable) learns the original's next-token distributions on the fitting text of both domains
(``collab_attn.pretrained.heldout.texts(..., "fit")``), never on the evaluation text. Loss: the KL divergence from the
original's distribution at temperature 1 (``distillation.DistillationTrainer`` with ``alpha=0``: the teacher alone,
no labels), through the library's one training path (``training.train``: AdamW, linear decay after warm-up,
resumable checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from collab_attn.distillation import DistillationTrainer, DistillSettings
from collab_attn.pretrained.heldout import DOMAINS, FIT_DOMAINS, OWN_TEXTS, texts
from collab_attn.texts import windows
from collab_attn.training import TrainingRun, train

TEACHER_ONLY = DistillSettings(alpha=0.0, temperature=1.0)


def fit_windows(tokenizer, glue_dir, shakespeare, length: int, tokens: int,
                domains: tuple[str, ...] = DOMAINS) -> torch.Tensor:
    """Windows of ``length`` tokens from the fitting text of ``domains`` (``FIT_DOMAINS``; default the race's two),
    as many from each, ``tokens`` in all (rounded up to whole windows of every domain), interleaved so that every
    batch sees each domain."""
    unknown = [d for d in domains if d not in FIT_DOMAINS]
    if not domains or unknown:
        raise ValueError(f"fitting domains {list(domains)}: choose among {', '.join(FIT_DOMAINS)}")
    per_domain = -(-tokens // (len(domains) * length))
    parts = [windows(tokenizer, texts(domain, "fit", glue_dir, shakespeare), length, per_domain) for domain in domains]
    return torch.stack(parts, dim=1).flatten(0, 1)


def text_windows(tokenizer, glue_dir, shakespeare, length: int, tokens: int, texts: tuple[str, ...],
                 own: Callable[[int, str], torch.Tensor] | None = None) -> torch.Tensor:
    """Windows of ``length`` tokens from ``texts`` (fit domains, ``FIT_DOMAINS``, and ``OWN_TEXTS``), as many from
    each, ``tokens`` in all (rounded up to whole windows of every text), interleaved in the order of ``texts``.
    ``own(n, text)`` gives ``n`` windows of the original's own samples of ``text`` (one of ``OWN_TEXTS``)."""
    if not texts:
        raise ValueError(f"no fitting texts named: choose among {', '.join((*OWN_TEXTS, *FIT_DOMAINS))}")
    count = -(-tokens // (len(texts) * length))  # windows per text
    domains = tuple(t for t in texts if t not in OWN_TEXTS)
    parts = {}
    if domains:
        rows = fit_windows(tokenizer, glue_dir, shakespeare, length, count * len(domains) * length, domains)
        parts = dict(zip(domains, rows.view(count, len(domains), length).unbind(1)))
    for text in texts:
        if text in OWN_TEXTS:
            if own is None:
                raise ValueError(f"the fitting texts {list(texts)} name {text!r}: pass own, what gives the "
                                 "original's own samples")
            parts[text] = own(count, text)
    return torch.stack([parts[t] for t in texts], dim=1).flatten(0, 1)


class _Windows(torch.utils.data.Dataset):
    """Each window with its next-token targets (the last position has none: -100)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        ids = self.rows[index]
        return {"input_ids": ids, "labels": torch.cat([ids[1:], ids.new_full((1,), -100)])}


@dataclass
class Distillation:
    """What a race run records of its distillation: the fitting tokens and windows read, the training time and the
    logged history."""

    tokens: int
    windows: int
    seconds: float
    history: list[dict]

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        losses = [r["loss"] for r in self.history if "loss" in r]
        last = f", last logged loss {losses[-1]:.4f}" if losses else ""
        return f"distilled on {self.tokens:,} fitting tokens ({self.windows} windows) in {self.seconds:.0f} s{last}"


def distill(student, teacher, rows: torch.Tensor, checkpoints: Path, batch: int = 4, learning_rate: float = 1e-4,
            seed: int = 0, checkpoint_every: int | None = 25, passes: int = 1) -> TrainingRun:
    """``passes`` passes over ``rows`` (one optimizer step per ``batch`` windows, shuffled anew each pass): the student
    learns the teacher's next-token distributions. Resumes from ``checkpoints`` when an earlier call was
    interrupted."""
    if type(passes) is not int or passes < 1:
        raise ValueError(f"passes={passes!r}: distil at least one pass over the fitting text")
    steps = -(-len(rows) * passes // batch)
    if steps < 1:
        raise ValueError("distillation needs at least one window of fitting text")
    recipe = {"max_steps": steps, "per_device_train_batch_size": batch, "learning_rate": learning_rate,
              "warmup_steps": max(1, steps // 20), "lr_scheduler_type": "linear", "weight_decay": 0.0,
              "logging_steps": max(1, steps // 20), "disable_tqdm": False}
    student.train()
    run = train(student, _Windows(rows), None, recipe, seed, checkpoints, checkpoint_every,
                trainer_class=DistillationTrainer, teacher=teacher, distill=TEACHER_ONLY, regression=False)
    student.eval()
    return run


def own_fit_windows(original, tokenizer, length: int, tokens: int, folder: Path | None = None,
                    seed: int = 0, text: str = "own") -> torch.Tensor:
    """``tokens`` fitting tokens (rounded up to whole windows of ``length``) of ``original``'s own samples
    (``collab_attn.own_text.own_windows``, sampled as ``OWN_TEXTS[text]`` says, seeded by ``seed``). With
    ``folder``, kept there as ``<text>-len<length>-seed<seed>.pt`` and reused: a longer request samples again from
    the start (the same samples first), so a shorter one is always the start of a longer one."""
    from collab_attn.files import replacing
    from collab_attn.own_text import own_windows

    count = -(-tokens // length)
    path = None if folder is None else Path(folder) / f"{text}-len{length}-seed{seed}.pt"
    if path is not None and path.is_file():
        kept = torch.load(path)
        if len(kept) >= count:
            return kept[:count]
    rows = own_windows(original, tokenizer, length, count, seed=seed, text=text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as temporary:
            torch.save(rows, temporary)
    return rows
