"""``prune``: head pruning by importance (Michel, Levy & Neubig, 2019). The least important heads over all layers are
removed (never a layer's last) until the kept query/key parameters fit in collaborative attention's at ``rank``; the
scores come from ``collab_attn.models.importance.head_importance`` on labelled task data. The kept heads keep their
query/key biases, values and output columns."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from collab_attn.decomposition.rank_selection import query_key_params
from collab_attn.models.hf import Layout
from collab_attn.models.importance import HeadImportance
from collab_attn.models.methods.base import ConversionMethod, LayerSizes, register
from collab_attn.models.plan import LayerPlan, LayerWeights, Plan, Pruning, Request

NAME = "prune"


def heads_to_keep(scores: Sequence[torch.Tensor], count: int) -> list[list[int]]:
    """The ``count`` most important heads over all layers, at least one per layer (each layer's best first)."""
    ranked = sorted(
        ((-float(score), layer, head) for layer, row in enumerate(scores) for head, score in enumerate(row))
    )
    keep: list[set[int]] = [set() for _ in scores]
    for _, layer, head in ranked:  # each layer's best head first ...
        if not keep[layer]:
            keep[layer].add(head)
    kept = len(scores)
    for _, layer, head in ranked:  # ... then the best of the rest, over all layers
        if kept >= count:
            break
        if head not in keep[layer]:
            keep[layer].add(head)
            kept += 1
    return [sorted(heads) for heads in keep]


def kept_head_count(ranks: Sequence[int], heads: Sequence[int], head_dim: int, d_in: int,
                    bias: bool) -> tuple[int, int]:
    """The query/key parameter budget of collaborative attention at ``ranks`` (per layer) and how many whole heads
    (``2 head_dim (d_in + bias)`` parameters each) fit in it."""
    budget = sum(query_key_params(r, d_in, h, bias=bias) for r, h in zip(ranks, heads))
    return budget, budget // (2 * head_dim * (d_in + int(bias)))


def _head_energy(layer: LayerWeights) -> torch.Tensor:
    """||Wq_h^T Wk_h||_F^2 per head, from the head_dim x head_dim Gram matrices."""
    w_query, w_key = layer.w_query.double(), layer.w_key.double()
    return (w_query @ w_query.transpose(1, 2) * (w_key @ w_key.transpose(1, 2))).sum((1, 2))


def plan_prune(request: Request) -> Plan:
    """Keep the most important heads within collaborative attention's query/key parameters at ``rank``: per layer
    ``2 d_in D~ + heads D~ + heads d_in`` (``query_key_params``); a concatenated head costs ``2 head_dim (d_in + 1)``.
    Report: per layer the query/key size kept (kept heads x head_dim) and as ``relative_error`` the relative error of
    the stacked head products with the pruned ones zeroed, sqrt(energy fraction removed)."""
    importance = request.importance
    if importance is None:
        raise ValueError(f"method={NAME!r} needs importance= (collab_attn.models.importance.head_importance on task "
                         "data with labels, or one score tensor per layer)")
    scores = list(importance.scores if isinstance(importance, HeadImportance) else importance)
    heads = [layer.heads for layer in request.weights]
    if [len(s) for s in scores] != heads:
        raise ValueError(f"importance has {[len(s) for s in scores]} scores per layer; the model has {heads} heads")
    first = request.weights[0]
    budget, count = kept_head_count(request.ranks, heads, first.head_dim, first.d_in, first.b_query is not None)
    keep = heads_to_keep(scores, count)
    shared = importance.seconds / len(heads) if isinstance(importance, HeadImportance) else 0.0
    layers = []
    for layer, kept in zip(request.weights, keep):
        start = time.perf_counter()
        energy = _head_energy(layer)
        removed = energy.sum() - energy[kept].sum()
        select = torch.tensor(kept)
        state = {"query.weight": layer.w_query[select].flatten(0, 1), "key.weight": layer.w_key[select].flatten(0, 1)}
        for name, bias in (("query.bias", layer.b_query), ("key.bias", layer.b_key)):
            if bias is not None:
                state[name] = bias[select].flatten()
        layers.append(LayerPlan(
            state, relative_error=float((removed.clamp_min(0) / energy.sum().clamp_min(1e-300)).sqrt()),
            kept_heads=kept, seconds=shared + time.perf_counter() - start,
        ))
    pruning = Pruning(keep, [s.tolist() for s in scores], budget)
    sizes = {"rank": [len(k) * first.head_dim for k in keep], "heads": [len(k) for k in keep]}
    return Plan(layers, sizes, "importance", pruning=pruning)


def kept_heads_layout(method: ConversionMethod, site, layers: int, sizes: LayerSizes) -> Layout:
    """As many whole heads as fit in the query/key parameters of rank ``sizes.rank`` in every layer, spread evenly
    over the layers (the costs depend on their number only), at least one per layer."""
    _, count = kept_head_count([sizes.rank] * layers, [site.heads] * layers, site.head_dim, site.d_in, bias=site.bias)
    count = min(max(count, layers), site.heads * layers)
    kept = [count // layers + (layer < count % layers) for layer in range(layers)]
    values = None if sizes.value_rank is None else [sizes.value_rank] * layers
    return Layout(method.name, method.layer, {"rank": [h * site.head_dim for h in kept], "heads": kept,
                                              "value_rank": values})  # refused: heads keep their values


PRUNE = register(ConversionMethod(
    NAME, "head pruning by importance within collaborative attention's query/key parameters at the same rank",
    plan_prune, layer="kept-heads", needs_importance=True, sized_layout=kept_heads_layout,
))
