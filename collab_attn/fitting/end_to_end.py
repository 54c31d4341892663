"""Fitting the converted attention layers end to end (docs/design.md, "Fitting converted layers to what the original
computes"): after a conversion (and, usually, after ``fit_to_original``'s layer-by-layer fit), the weights of every
converted attention layer together are trained so that the whole converted model gives the original's output on the
fitting tokens. Nothing else moves: the embeddings, the MLPs, the norms and the head keep the original's weights, and
the cache layout and sizes stay as the conversion left them.

The loss, averaged over the non-padding tokens of a batch: ``KL(p_original || p_converted)`` of the next-token (or
class) distributions where the model outputs ``logits``, else ``||h_converted - h_original||^2 / ||h_original||^2``
of its last hidden states. Adam, one of the given batches per step in a seeded random order, cosine decay. The loss
on all the fitting tokens (or on the first ``check_batches`` of them, or on ``held_out`` batches it does not train
on) is measured before and after; when it did not fall the weights before are put back, so an exact conversion stays
exact. Each measurement runs both models over the batches it reads: over all of them, the two cost about as much as
one pass of steps, so a fit over many fresh tokens judges itself on a part of them, or on held-out tokens: the
fitting tokens say whether the fit learned them, held-out ones whether it learned the original. With
``check_every``, that loss is also measured every that many steps, and the weights where it was lowest are kept
(early stopping). With ``anchor``, each step's loss also holds ``anchor x sum ||w - w_0||^2 / sum ||w_0||^2`` over the
trained weights, ``w_0`` those the fit starts from: a pull toward the conversion it was given (regularisation).

The original's output is computed batch by batch when a step or a measurement needs it, never held for all the
fitting tokens at once: a language model's next-token distributions take 4 bytes per token and vocabulary entry
(3.2 GB for SmolLM2's 49,152 at 16,384 tokens), so holding them capped the fit at a few passes over a small set. Each
step runs the original once more instead, and the fit takes any number of tokens.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from collab_attn.fitting.checks import check_seed_and_progress, check_source, checked_batches
from collab_attn.fitting.layer_fit import cosine_adam, forward_kwargs
from collab_attn.models.families import family_of

DEFAULT_LEARNING_RATE = 1e-4


@dataclass
class EndToEndFit:
    """What ``fit_end_to_end`` did: the loss on the checked tokens before and after (of the weights kept:
    ``loss_after <= loss_before``), the loss the trained weights reached (``fitted_loss``; kept only when lower),
    the trained parameters, the loss every few steps, and its time."""

    steps: int
    learning_rate: float
    tokens: int  # non-padding fitting tokens per pass
    check_tokens: int  # the non-padding tokens of the batches the loss before and after is measured on
    held_out: bool  # measured on batches the fit did not train on (else on the first fitting batches)
    loss: str  # "kl" (nats per token) or "relative squared error" (of the last hidden states)
    parameters: int  # trained parameters: the converted attention layers'
    loss_before: float = math.nan
    loss_after: float = math.nan
    fitted_loss: float = math.nan
    kept_fit: bool = False
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, the batch's loss)
    check_every: int | None = None  # the checked loss measured every this many steps too, its best weights kept
    checks: list[tuple[int, float]] = field(default_factory=list)  # (step, the checked loss), the last step's too
    best_step: int | None = None  # with check_every: the step whose weights ``fitted_loss`` is of
    anchor: float = 0.0  # the weight of the pull toward the starting weights in each step's loss (0: none)
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        judged = (f" (judged on {self.check_tokens:,} held out)" if self.held_out else
                  "" if self.check_tokens == self.tokens else f" (judged on {self.check_tokens:,})")
        return "\n".join([
            "| end-to-end fit | loss before | after | fit reached | kept fit | seconds |",
            "|---|---:|---:|---:|:---:|---:|",
            f"| {self.steps} steps, {self.tokens:,} tokens{judged}, {self.parameters:,} parameters ({self.loss}) | "
            f"{self.loss_before:.4f} | {self.loss_after:.4f} | {self.fitted_loss:.4f}"
            f"{'' if self.best_step is None else f' (step {self.best_step})'} | "
            f"{'yes' if self.kept_fit else 'no'} | {self.seconds:.1f} |"])


def fit_end_to_end(
    converted: nn.Module,
    original: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    steps: int,
    *,
    learning_rate: float = DEFAULT_LEARNING_RATE,
    seed: int = 0,
    check_batches: int | None = None,
    held_out: Iterable[Mapping[str, torch.Tensor]] | None = None,
    check_every: int | None = None,
    anchor: float = 0.0,
    progress: bool = True,
) -> EndToEndFit:
    """Train the converted attention layers of ``converted`` (in place, all together) so that the model's output
    matches ``original``'s on ``batches``; see the module doc. ``batches``: tokenized batches as
    ``collect_calibration`` and ``fit_to_original`` take them, one per optimizer step; ``steps``: Adam steps in all,
    ``learning_rate`` the initial rate (cosine decay to 0). Both models run in eval mode (no dropout) and are left in
    the mode they were in; ``original`` is not changed. ``check_batches``: the loss before and after, which decides
    whether the fit is kept, on the first this many batches (default: all of them); ``held_out``: on these batches
    instead (tokens the fit does not train on, batched alike). ``check_every``: that loss measured every this many
    steps (fewer than ``steps``) as well, and the weights where it was lowest kept (early stopping). ``anchor``: the
    weight of the relative squared distance from the starting weights added to each step's loss (0: none); the
    losses measured and recorded are the divergence alone."""
    if type(steps) is not int or steps < 1:
        raise ValueError(f"steps must be a positive number of optimizer steps, got {steps!r}")
    if check_batches is not None and (type(check_batches) is not int or check_batches < 1):
        raise ValueError(f"check_batches must be a positive number of batches (or None: all of them), got "
                         f"{check_batches!r}")
    if check_every is not None and (type(check_every) is not int or not 1 <= check_every < steps):
        raise ValueError(f"check_every must be a number of steps from 1 to steps - 1 = {steps - 1} (or None: the loss "
                         f"measured before and after only), got {check_every!r}")
    if not (isinstance(anchor, (int, float)) and math.isfinite(anchor) and anchor >= 0):
        raise ValueError(f"anchor must be a number >= 0 (0: no pull toward the starting weights), got {anchor!r}")
    if not (isinstance(learning_rate, (int, float)) and math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"learning_rate must be a positive number, got {learning_rate!r}")
    check_seed_and_progress(seed, progress)
    names = check_source(converted, original)
    device = next(converted.parameters()).device
    batches = checked_batches(original, batches, device)
    if check_batches is not None and check_batches > len(batches):
        raise ValueError(f"check_batches={check_batches} is more than the {len(batches)} batches given: pass at most "
                         f"{len(batches)}, or None to measure on all of them")
    if held_out is not None and check_batches is not None:
        raise ValueError("pass check_batches (the first fitting batches) or held_out (batches the fit does not train "
                         "on) to judge the fit on, not both")
    if held_out is None:
        checked = batches[:check_batches]
    else:
        try:
            checked = checked_batches(original, held_out, device)
        except ValueError as error:
            raise ValueError(f"held_out: {error}") from None
    params = _attention_parameters(converted, original, names)
    flags = {p: p.requires_grad for p in converted.parameters()}
    modes = [(m, m.training) for m in (converted, original)]
    start, cpu = time.perf_counter(), time.process_time()
    converted.eval()
    original.eval()
    try:
        for p in converted.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        what, loss_before = _mean_loss(converted, original, checked, "loss before", progress)
        fit = EndToEndFit(steps, float(learning_rate), _tokens(batches), _tokens(checked), held_out is not None,
                          "kl" if what == "logits" else "relative squared error", sum(p.numel() for p in params),
                          loss_before, check_every=check_every, anchor=float(anchor))
        saved = [p.detach().clone() for p in params]
        best = _Best(params, checked, fit, progress) if check_every else None
        with torch.enable_grad():
            _train(converted, original, params, batches, steps, learning_rate, seed, fit, progress, best,
                   saved if anchor else None)
        _, fit.fitted_loss = _mean_loss(converted, original, checked, "loss after", progress)
        if best is not None:
            best.keep_lowest()
        fit.kept_fit = fit.fitted_loss < fit.loss_before
        if not fit.kept_fit:
            with torch.no_grad():
                for param, value in zip(params, saved):
                    param.copy_(value)
        fit.loss_after = fit.fitted_loss if fit.kept_fit else fit.loss_before
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
        for model, mode in modes:
            model.train(mode)
    fit.seconds, fit.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return fit


def _attention_parameters(converted: nn.Module, original: nn.Module, names: list[str]) -> list[nn.Parameter]:
    """Every parameter of the converted attention layers, with the output projection the model keeps beside a layer
    (BERT, RoBERTa) counted as part of it."""
    family = family_of(original.config)
    modules = [converted.get_submodule(name) for name in names]
    if family.output is None:
        modules += [converted.get_submodule(family.output_projection_name(name)) for name in names]
    params = list(dict.fromkeys(p for module in modules for p in module.parameters()))
    if not params:
        raise ValueError("converted's attention layers have no parameters to fit")
    return params


def token_mask(batch: dict) -> torch.Tensor:
    """The batch's ``attention_mask``, or ones where it has none: 1 for every token a loss counts."""
    return batch.get("attention_mask", torch.ones_like(batch["input_ids"]))


def _tokens(batches: list[dict]) -> int:
    return int(sum(token_mask(b).sum() for b in batches))


def model_output(model: nn.Module, batch: dict) -> tuple[str, torch.Tensor]:
    """What the model outputs on a batch: its logits (as log-probabilities) or its last hidden states."""
    out = model(**batch, **forward_kwargs(model))
    logits = getattr(out, "logits", None)
    if logits is not None:
        return "logits", logits.float().log_softmax(-1)
    return "hidden", out.last_hidden_state.float()


def _loss(converted: nn.Module, original: nn.Module, batch: dict) -> tuple[str, torch.Tensor]:
    """What the original outputs on ``batch`` ("logits" or "hidden"), and the converted model's loss against it."""
    with torch.no_grad():
        what, reference = model_output(original, batch)
    _, output = model_output(converted, batch)
    return what, divergence(what, reference, output, token_mask(batch))


def divergence(what: str, reference: torch.Tensor, output: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The loss of ``output`` against ``reference`` (both as ``model_output`` gives them, ``what`` they are) over the
    tokens ``mask`` keeps: the mean KL per token (or per sequence, for a classifier's logits), or the relative
    squared error of hidden states."""
    mask = mask.to(output.dtype)
    if what == "logits":
        kl = (reference.exp() * (reference - output)).sum(-1)  # per token, or per sequence (a classifier's logits)
        return (kl * mask).sum() / mask.sum().clamp_min(1) if kl.shape == mask.shape else kl.mean()
    mask = mask.unsqueeze(-1)
    return ((output - reference).square() * mask).sum() / (reference.square() * mask).sum().clamp_min(1e-30)


@torch.no_grad()
def _mean_loss(converted: nn.Module, original: nn.Module, batches: list[dict], what: str,
               progress: bool) -> tuple[str, float]:
    """What the original outputs, and the loss over all ``batches`` weighted by their non-padding tokens."""
    weights = [float(token_mask(b).sum()) for b in batches]
    losses = [_loss(converted, original, b)
              for b in tqdm(batches, desc=f"end-to-end fit: {what}", unit="batch", disable=not progress)]
    return losses[0][0], sum(w * float(x) for w, (_, x) in zip(weights, losses)) / sum(weights)


class _Best:
    """Early stopping: the checked loss every ``fit.check_every`` steps, and the weights where it was lowest."""

    def __init__(self, params, checked, fit, progress):
        self.params, self.checked, self.fit, self.progress = params, checked, fit, progress
        self.state: list[torch.Tensor] | None = None

    def after_step(self, model, original, step: int) -> None:
        if step % self.fit.check_every or step == self.fit.steps:
            return
        _, loss = _mean_loss(model, original, self.checked, f"loss at step {step}", self.progress)
        self._record(step, loss)

    def keep_lowest(self) -> None:
        """After the last step (``fit.fitted_loss`` measured): the weights of the lowest checked loss put back."""
        self._record(self.fit.steps, self.fit.fitted_loss)
        if self.fit.best_step != self.fit.steps:
            with torch.no_grad():
                for param, value in zip(self.params, self.state):
                    param.copy_(value)
            self.fit.fitted_loss = min(loss for _, loss in self.fit.checks)

    def _record(self, step: int, loss: float) -> None:
        lowest = min((value for _, value in self.fit.checks), default=math.inf)
        self.fit.checks.append((step, loss))
        if loss < lowest:
            self.fit.best_step = step
            if step != self.fit.steps:
                self.state = [p.detach().clone() for p in self.params]


def _train(model, original, params, batches, steps, learning_rate, seed, fit, progress, best=None,
           start=None) -> None:
    """``steps`` Adam steps; with ``start`` (the weights the fit starts from), each step's loss also holds
    ``fit.anchor`` times the relative squared distance of ``params`` from them."""
    optimizer, schedule = cosine_adam(params, learning_rate, steps)
    scale = None if start is None else max(sum(float(w.square().sum()) for w in start), 1e-30)
    generator = torch.Generator().manual_seed(seed)
    every = max(1, steps // 20)
    order: list[int] = []
    bar = tqdm(range(steps), desc="end-to-end fit", disable=not progress)
    for step in bar:
        if not order:
            order = torch.randperm(len(batches), generator=generator).tolist()
        k = order.pop()
        _, loss = _loss(model, original, batches[k])
        optimizer.zero_grad(set_to_none=True)
        if start is None:
            loss.backward()
        else:
            drift = sum((p - w).square().sum() for p, w in zip(params, start)) / scale
            (loss + fit.anchor * drift).backward()
        optimizer.step()
        schedule.step()
        value = loss.item()
        bar.set_postfix(loss=f"{value:.4f}", refresh=False)
        if step % every == 0 or step == steps - 1:
            fit.history.append((step + 1, value))
        if best is not None:
            best.after_step(model, original, step + 1)
