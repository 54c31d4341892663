"""Activation-aware fitting: input statistics of every attention layer over calibration texts, and whitening.

Head ``h`` computes the logits ``x^T T_h y`` (query input ``x``, key input ``y``, ``T_h = Wq_h^T Wk_h``; the bias
terms are converted exactly). A decomposition error ``E_h`` changes them by ``x^T E_h y``, whose mean square over
inputs drawn independently from the calibration data is ``||S_q E_h S_k||_F^2`` with ``S = C^{1/2}`` for the
second-moment matrices ``C_q`` of the queries and ``C_k`` of the keys. So decomposing the whitened products
``S_q T_h S_k`` (whitened projections ``Wq_h S_q``, ``Wk_h S_k``) and mapping the shared projections back with
``S^{-1}`` minimizes the error of the logits the model actually computes rather than of the raw weights.

Two choices for the key side (``Calibration.keys``):

- ``"raw"``: ``C_k = C_q = E[x x^T]`` over tokens, the same matrix on both sides;
- ``"centered"`` (default): ``C_k = E[(y - ybar)(y - ybar)^T]`` with ``ybar`` the mean of the key inputs of the
  same sequence. A softmax row does not change when a constant is added to it, and ``x^T E_h ybar`` is such a
  constant for query ``x``: only the centered part of the key error reaches the attention weights.

``S = (C + eps * mean_eigenvalue(C) * I)^{1/2}``; ``eps`` keeps directions the calibration data never visit from
being ignored entirely (and the inverse finite).

The statistics are a ``Calibration``, the input ``reparametrize`` takes (defined with the conversion's request,
``collab_attn.models.plan``, and importable from here). Typical use::

    calibration = calibration_from_texts(model, tokenizer, texts)      # or collect_calibration(model, batches)
    reparametrize(model, rank=128, calibration=calibration)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from collab_attn.decomposition.whitening import DEFAULT_EPS
from collab_attn.fitting.passes import HookedPasses
from collab_attn.models.hf import find_attention, forward_inputs, is_collaborative
from collab_attn.models.plan import Calibration
from collab_attn.texts import DEFAULT_MAX_LENGTH

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")


# ---------------------------------------------------------------------------------------------------------------
# Statistics


class _Accumulator:
    """Forward pre-hooks that add up ``x x^T`` (raw and sequence-centered) for every attention layer: each batch's
    sum in ``dtype`` (``accumulation_dtype``), the running total in float64 on the CPU. The first batch's pass counts
    the attention calls (ALBERT calls its shared layer several times); every later pass ends at the last of them,
    before the layers and the head after it (``HookedPasses``)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None):
        _, self.found = find_attention(model)
        self.dtype = dtype
        self.mask: torch.Tensor | None = None
        self.raw: list[torch.Tensor | None] = [None] * len(self.found)
        self.centered: list[torch.Tensor | None] = [None] * len(self.found)
        self.counts = [0] * len(self.found)
        self.passes = HookedPasses(model, {i: module for i, (_, module) in enumerate(self.found)}, self._add)

    def _add(self, index: int, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        compute = self.dtype or accumulation_dtype(hidden.device)
        hidden = hidden.detach().to(compute)
        mask = torch.ones(hidden.shape[:2], device=hidden.device) if self.mask is None else self.mask
        mask = mask.to(hidden.device, compute)[..., None]  # (batch, seq, 1)
        self.counts[index] += int(mask.sum())
        mean = (hidden * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1)
        for store, x in ((self.raw, hidden * mask), (self.centered, (hidden - mean) * mask)):
            flat = x.reshape(-1, x.shape[-1])
            moment = (flat.T @ flat).to("cpu", torch.float64)
            store[index] = moment if store[index] is None else store[index] + moment

    def run(self, inputs: dict) -> None:
        """One pass of the model on ``inputs``, to the last attention call."""
        if self.passes.run(inputs):
            return
        if self.passes.stop_at is None:
            self.passes.stop_at = self.passes.calls or None  # none: a model without attention calls, refused below
        else:
            raise RuntimeError(f"the calibration passes call the attention layers {self.passes.stop_at} and then "
                               f"{self.passes.calls} times: collect_calibration cannot end a pass at its last "
                               "attention call")

    def close(self) -> None:
        self.passes.close()


def accumulation_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype each batch's statistics are computed in on ``device`` by default: float64 on the CPU, float32 on an
    accelerator (where float64 is many times slower); the batches are added up in float64 either way."""
    return torch.float64 if torch.device(device).type == "cpu" else torch.float32


@torch.no_grad()
def collect_calibration(
    model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], *, keys: str = "centered",
    eps: float = DEFAULT_EPS, dtype: torch.dtype | None = None,
) -> Calibration:
    """Run ``model`` (in eval mode, restored afterwards) on ``batches`` of tokenized inputs (dicts with
    ``input_ids``, ``attention_mask``, ...; other keys such as labels are ignored), every pass after the first only
    to its last attention layer's inputs, and return the input statistics of each self-attention layer. Padding
    tokens (``attention_mask == 0``) are left out. ``dtype``: what each batch's ``x x^T`` is computed in (None:
    ``accumulation_dtype`` of the model's device; float32 on the CPU reproduces what a GPU computes)."""
    if is_collaborative(model.config):
        raise ValueError("calibrate the original (concatenated-heads) model, before reparametrize")
    device = next(model.parameters()).device
    accumulator = _Accumulator(model, dtype)
    was_training = model.training
    model.eval()
    tokens = sequences = 0
    try:
        for batch in batches:
            taken = forward_inputs(model, batch)  # a tokenizer's extra inputs (token_type_ids beside a Llama) left out
            inputs = {k: v.to(device) for k, v in taken.items() if k in MODEL_INPUTS and v is not None}
            mask = inputs.get("attention_mask")
            if mask is None:
                mask = torch.ones_like(inputs["input_ids"])
            accumulator.mask = mask
            accumulator.run(inputs)
            tokens += int(mask.sum())
            sequences += mask.shape[0]
    finally:
        accumulator.close()
        model.train(was_training)
    if tokens == 0:
        raise ValueError("no calibration tokens: pass at least one non-empty batch")
    missing = [name for (name, _), s in zip(accumulator.found, accumulator.raw) if s is None]
    if missing:
        raise RuntimeError(f"the calibration forward passes never reached {missing}")
    # ALBERT runs its shared layer several times per sequence: normalize by what each layer actually saw
    return Calibration(
        names=[name for name, _ in accumulator.found],
        second_moments=[s / n for s, n in zip(accumulator.raw, accumulator.counts)],
        centered_moments=[s / n for s, n in zip(accumulator.centered, accumulator.counts)],
        tokens=tokens, sequences=sequences, keys=keys, eps=eps,
    )


def text_batches(tokenizer, texts: Sequence[str | tuple[str, str]], batch_size: int = 16,
                 max_length: int = DEFAULT_MAX_LENGTH) -> Iterator[dict]:
    """``texts`` (strings, or (first, second) sentence pairs) tokenized ``batch_size`` at a time, with truncation to
    ``max_length`` and padded per batch: what ``collect_calibration`` (and ``fit_to_original``) take."""
    texts = list(texts)
    for start in range(0, len(texts), batch_size):
        chunk = texts[start : start + batch_size]
        if all(isinstance(t, str) for t in chunk):
            yield tokenizer(chunk, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
            continue
        firsts, seconds = zip(*[(t, None) if isinstance(t, str) else tuple(t) for t in chunk])
        if any(s is None for s in seconds):
            raise ValueError("mix of single texts and sentence pairs in one calibration set")
        yield tokenizer(list(firsts), list(seconds), padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")


def calibration_from_texts(
    model: nn.Module,
    tokenizer,
    texts: Sequence[str | tuple[str, str]],
    *,
    batch_size: int = 16,
    max_length: int = DEFAULT_MAX_LENGTH,
    keys: str = "centered",
    eps: float = DEFAULT_EPS,
    dtype: torch.dtype | None = None,
) -> Calibration:
    """``collect_calibration`` on ``texts`` (strings, or (first, second) sentence pairs), tokenized with
    truncation to ``max_length`` and padded per batch (``text_batches``; ``dtype``: see ``collect_calibration``)."""
    texts = list(texts)
    if not texts:
        raise ValueError("no calibration texts")
    batches = text_batches(tokenizer, texts, batch_size, max_length)
    calibration = collect_calibration(model, batches, keys=keys, eps=eps, dtype=dtype)
    calibration.metadata.update(texts=len(texts), max_length=max_length)
    return calibration


# ---------------------------------------------------------------------------------------------------------------
# Measuring the effect on the logits


@torch.no_grad()
def attention_inputs(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The hidden states entering each self-attention layer for one batch: a list of (batch, seq, d_in)."""
    _, found = find_attention(model)
    captured: list[torch.Tensor] = []
    handles = [
        module.register_forward_pre_hook(
            lambda m, args, kwargs: captured.append((args[0] if args else kwargs["hidden_states"]).detach()),
            with_kwargs=True,
        )
        for _, module in found
    ]
    was_training = model.training
    try:
        model.eval()(**{k: v for k, v in forward_inputs(model, batch).items() if k in MODEL_INPUTS})
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return captured


@torch.no_grad()
def logit_errors(
    w_query: torch.Tensor,
    w_key: torch.Tensor,
    b_query: torch.Tensor | None,
    approx_products: torch.Tensor,
    hidden: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, float]:
    """How far approximate head products move one layer's attention, on that layer's real inputs.

    ``w_query``/``w_key`` (heads, head_dim, d_in), ``b_query`` (heads, head_dim) or None, ``approx_products``
    (heads, d_in, d_in) the approximation of ``Wq_h^T Wk_h`` (``HeadDecomposition.head_products()``), ``hidden``
    (batch, seq, d_in) the layer's inputs and ``mask`` (batch, seq) 1 for tokens. Returns

    - ``logits``: relative error of the bilinear logits ``x^T Wq_h^T Wk_h y`` over token pairs;
    - ``centered_logits``: the same after subtracting each row's mean over keys (what a softmax sees);
    - ``attention_tv``: mean total-variation distance between the attention rows of the original and the
      approximated layer (logit scale ``1/sqrt(head_dim)``, content bias included; the key bias does not matter).
    """
    heads, head_dim, _ = w_query.shape
    x = hidden.to(torch.float64)
    keep = mask.to(torch.bool)
    pair = (keep[:, None, :, None] & keep[:, None, None, :]).to(torch.float64)  # (B, 1, T, S)
    queries = torch.einsum("btd,had->bhta", x, w_query.to(torch.float64))
    keys = torch.einsum("btd,had->bhta", x, w_key.to(torch.float64))
    exact = queries @ keys.transpose(-1, -2)
    approx = torch.einsum("btd,hde,bse->bhts", x, approx_products.to(torch.float64), x)
    n_keys = keep.sum(1).clamp_min(1).to(torch.float64)[:, None, None, None]

    def centered(logits):
        return (logits - (logits * pair).sum(-1, keepdim=True) / n_keys) * pair

    def rel(a, b):
        return float(((a - b) * pair).norm() / (b * pair).norm())

    content = 0.0
    if b_query is not None:
        content = torch.einsum("bsd,had,ha->bhs", x, w_key.to(torch.float64), b_query.to(torch.float64))[:, :, None]
    blocked = torch.where(keep, 0.0, float("-inf")).to(torch.float64)[:, None, None, :]
    probs = [((logits + content) / head_dim**0.5 + blocked).softmax(-1) for logits in (exact, approx)]
    rows = keep[:, None, :].expand(-1, heads, -1)
    tv = 0.5 * (probs[0] - probs[1]).abs().sum(-1)[rows].mean()
    return {"logits": rel(approx, exact), "centered_logits": rel(centered(approx), centered(exact)),
            "attention_tv": float(tv)}
