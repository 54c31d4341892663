"""Head importance (Michel, Levy & Neubig, 2019): how much the task loss depends on each head, from task data.

``head_importance`` gives the scores ``method="prune"`` of ``reparametrize`` ranks heads by; ``head_gates`` multiplies
each head's context output by a gate inside the model (0 switches a head off).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from collab_attn.models.hf import find_attention

DEFAULT_SAMPLES = 256  # labelled examples the importance is averaged over
DEFAULT_BATCH_SIZE = 32


@contextmanager
def head_gates(model: nn.Module, gates: list):
    """Multiply head ``h`` of attention layer ``l``'s context output by ``gates[l][..., h]`` inside the block.

    ``gates[l]`` is a (heads,) tensor, or (batch, heads) for one gate per example; the list is read at every
    forward, so its entries may be swapped between batches. Gate 0 switches a head off, 1 leaves it alone.
    """
    family, found = find_attention(model)
    if len(gates) != len(found):
        raise ValueError(f"got {len(gates)} gates for {len(found)} attention layers")
    handles = []

    def gate_heads(index: int, heads: int, projection: nn.Module, args: tuple) -> tuple:
        context, *rest = args  # (batch, tokens, heads * head_dim)
        gate = gates[index].to(context.dtype)
        gate = gate.reshape(-1, 1, heads, 1) if gate.dim() == 2 else gate.reshape(1, 1, heads, 1)
        return (context.unflatten(-1, (heads, -1)) * gate).flatten(-2), *rest

    try:
        for index, (name, module) in enumerate(found):
            projection = family.output_projection(model, name)
            hook = partial(gate_heads, index, family.num_heads(module))
            handles.append(projection.register_forward_pre_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class HeadImportance:
    """Head importance scores of one model: per attention layer, one score per head."""

    scores: list[torch.Tensor]  # normalized per layer by the L2 norm (what pruning ranks)
    raw: list[torch.Tensor]  # mean over examples of |dL/d xi_h|
    samples: int
    seed: int
    seconds: float


def head_importance(
    model: nn.Module,
    dataset,
    collator,
    *,
    samples: int = DEFAULT_SAMPLES,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
) -> HeadImportance:
    """Michel et al.'s head importance: the mean over ``samples`` examples of ``|dL/d xi_h|``.

    ``dataset``: tokenized task examples with ``labels`` (e.g. the pipeline's ``data["train"]``), of which
    ``samples`` are drawn without replacement with ``seed``; ``collator`` pads a list of them into a batch
    (``transformers.DataCollatorWithPadding``). ``L`` is the model's own loss, so ``model`` is a fine-tuned task
    model. Each example has its own gates (a (batch, heads) gate per layer), so one backward pass per batch
    gives every example's gradient, and the result does not depend on ``batch_size``. Dropout is off meanwhile.
    """
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"importance samples must be a positive integer, got {samples!r}")
    if len(dataset) == 0 or "labels" not in dataset[0]:
        raise ValueError("head importance needs task examples with labels (the task loss is differentiated)")
    start = time.perf_counter()
    family, found = find_attention(model)
    heads = [family.num_heads(module) for _, module in found]
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(dataset), generator=generator)[:samples].tolist()
    totals = [torch.zeros(h, dtype=torch.float64) for h in heads]
    gates: list = [None] * len(found)
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad(), head_gates(model, gates):
            for begin in range(0, len(order), batch_size):
                batch = collator([dataset[i] for i in order[begin : begin + batch_size]])
                batch = {key: value.to(device) for key, value in batch.items()}
                size = batch["labels"].shape[0]
                gates[:] = [torch.ones(size, h, device=device, requires_grad=True) for h in heads]
                loss = model(**batch).loss * size  # the model's mean loss -> the sum of per-example losses
                grads = torch.autograd.grad(loss, gates, allow_unused=True)
                for total, grad in zip(totals, grads):
                    if grad is not None:
                        total += grad.detach().abs().sum(0).double().cpu()
    finally:
        model.train(was_training)
    raw = [(total / len(order)).float() for total in totals]
    scores = [r / r.norm() if r.norm() > 0 else r for r in raw]
    return HeadImportance(scores, raw, len(order), seed, time.perf_counter() - start)
