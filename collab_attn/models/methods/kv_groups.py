"""``merge-kv`` and ``drop-kv``: conversions that act on whole key/value groups, on any family, rotary or not.

A source layer has H query heads and K key/value heads (K < H where they are grouped, K = H for multi-head
attention); query head ``h`` reads group ``h // (H / K)``. The converted layer keeps G groups of ``head_dim`` keys
and values, ``rank = G x head_dim`` (the ``gqa`` kind's key width), and caches ``2 G head_dim`` numbers per token and
layer (keys and values, rotated keys on rotary models). Both are exact at G = K.

- ``merge-kv`` (the conversion of GQA uptraining, Ainslie et al., 2023): new group ``j`` mean-pools the K / G
  consecutive source groups ``j K/G .. (j+1) K/G - 1``: its key and value projections, weights and biases, are
  their means. G must divide K, so that query head ``h`` reads group ``h // (H / G)``, the pool of the group it read
  before. The queries and the output projection are unchanged. Reports the relative error of the logit forms and
  of the value-output maps against the original's.
- ``drop-kv`` (pruning whole groups): keep the G groups (1 <= G <= K) with the largest logit energy, drop the others
  with their query heads and those heads' output columns. Needs no task data: the energy of group ``g`` is that of
  its query/key products, ``E_g = sum_{h reads g} ||Wq_h^T Wk_g||_F^2 = sum_h <Wq_h Wq_h^T, Wk_g Wk_g^T>`` (head_dim x
  head_dim Gram matrices). On rotary models a head's products are its per-band complex forms ``a_hi conj(b_gi)^T``
  (``collab_attn.kinds.forms``; a bias is one more input column), so ``E_g = sum_{h reads g} sum_i |a_hi|^2
  |b_gi|^2``: twice the logit form's energy averaged over relative positions (for incommensurate frequencies). It is
  the measure every conversion's error is taken in, so the reported ``relative_error`` is sqrt(energy fraction
  removed), as ``prune`` reports. The report's pruning record lists per layer the kept groups and every group's
  energy.

Layer kinds: ``gqa`` (merge-kv) and ``kept-heads`` (drop-kv) without rotary positions, ``rotary-gqa`` (both) with
them.
"""

from __future__ import annotations

import time

import torch

from collab_attn.kinds.forms import band_forms_of, original_forms, original_value_forms, relative_error
from collab_attn.models.families import AttentionSite
from collab_attn.models.hf import Layout
from collab_attn.models.methods.base import CacheSizes, ConversionMethod, LayerSizes, register
from collab_attn.models.methods.rotary_collab import rotary_forms
from collab_attn.models.plan import LayerPlan, LayerWeights, Plan, Pruning, Request, ValueWeights

MERGE, DROP = "merge-kv", "drop-kv"
GROUP_METHODS = (MERGE, DROP)


def group_counts(method: str, kv_heads: int) -> list[int]:
    """The numbers of groups G a layer with ``kv_heads`` key/value heads converts to: the divisors of ``kv_heads``
    (merge-kv), or 1 .. ``kv_heads`` (drop-kv)."""
    return [g for g in range(1, kv_heads + 1) if method == DROP or kv_heads % g == 0]


def groups_at(method: str, rank: int, kv_heads: int, head_dim: int, name: str = "") -> int:
    """G for ``rank`` = G x head_dim; a clear error listing the valid ranks otherwise."""
    valid = group_counts(method, kv_heads)
    if rank % head_dim == 0 and rank // head_dim in valid:
        return rank // head_dim
    rule = "dividing" if method == MERGE else "at most"
    raise ValueError(
        f"{name + ': ' if name else ''}method={method!r} keeps G whole key/value groups, rank = G x head_dim "
        f"({head_dim}) with G {rule} the source's {kv_heads} key/value heads: rank one of "
        f"{[g * head_dim for g in valid]} (G = {valid}); got rank {rank}"
    )


def group_layout(method: ConversionMethod, site: AttentionSite, layers: int, sizes: LayerSizes) -> Layout | None:
    """The layout of a model whose every layer is like ``site``, converted by ``method`` at ``sizes.rank`` (None
    where the rank is not G x head_dim with a valid G): what ``collab_attn.models.sizing`` builds to cost it."""
    try:
        groups = groups_at(method.name, sizes.rank, site.kv_heads, site.head_dim)
    except ValueError:
        return None
    heads = None if method.name == MERGE else [groups * (site.heads // site.kv_heads)] * layers
    return Layout(method.name, method.layer_for(site.rotary), {"rank": [sizes.rank] * layers, "heads": heads})


def logit_forms(layer: LayerWeights, rotary: bool):
    """Every query head's logit form against its group's key, as ``collab_attn.kinds.forms`` measures a layer
    (the logit scale left out: the relative errors do not depend on it)."""
    if rotary:
        return band_forms_of(*rotary_forms(layer), 1.0)
    return original_forms(layer.w_query, layer.w_key.repeat_interleave(layer.heads // layer.w_key.shape[0], 0), 1.0)


def source_values(values: ValueWeights, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The source's value projection per group, (kv_heads, head_dim, d_in), and its bias (kv_heads, head_dim):
    ``ValueWeights`` repeats them for every query head of a group."""
    heads, head_dim = values.w_value.shape[:2]
    bias = None if values.b_value is None else values.b_value.reshape(heads, head_dim)
    every = heads // kv_heads
    return values.w_value[::every], None if bias is None else bias[::every]


def _state(query, query_bias, key, key_bias, value, value_bias) -> dict:
    """A grouped layer's query, key and value projections by its state-dict names (the output projection is kept
    from the original: all its columns, or those of the kept heads)."""
    state = {"query.weight": query.flatten(0, 1), "key.weight": key.flatten(0, 1), "value.weight": value.flatten(0, 1)}
    for name, bias in (("query.bias", query_bias), ("key.bias", key_bias), ("value.bias", value_bias)):
        if bias is not None:
            state[name] = bias.flatten()
    return state


def _mean_over_groups(tensor: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """(K, ...) -> (G, ...): the mean of each run of K / G consecutive groups."""
    return None if tensor is None else tensor.reshape(groups, -1, *tensor.shape[1:]).mean(1)


def plan_merge_kv(request: Request) -> Plan:
    """Per layer, G = rank / head_dim groups, each the mean of K / G consecutive source groups (keys and values,
    weights and biases); the queries as they are, the output projection left to the original."""
    layers = []
    for layer, values, rank in zip(request.weights, request.values, request.ranks):
        start = time.perf_counter()
        kv_heads = layer.w_key.shape[0]
        groups = groups_at(MERGE, rank, kv_heads, layer.head_dim, layer.name)
        key, key_bias = _mean_over_groups(layer.w_key, groups), _mean_over_groups(layer.b_key, groups)
        value, value_bias = (_mean_over_groups(t, groups) for t in source_values(values, kv_heads))
        merged = LayerWeights(layer.name, layer.w_query, key, layer.b_query, key_bias)
        value_maps = original_value_forms(value.repeat_interleave(layer.heads // groups, 0), values.w_output)
        layers.append(LayerPlan(
            _state(layer.w_query, layer.b_query, key, key_bias, value, value_bias),
            relative_error(logit_forms(merged, request.rotary), logit_forms(layer, request.rotary)),
            value_error=relative_error(value_maps, original_value_forms(values.w_value, values.w_output)),
            seconds=time.perf_counter() - start,
        ))
    return Plan(layers, {"rank": list(request.ranks)}, "mean-pooling")


def _rows(tensor: torch.Tensor | None, rows: list[int]) -> torch.Tensor | None:
    return None if tensor is None else tensor[rows]


def _removed_fraction(energy: torch.Tensor, kept: list[int]) -> float:
    """sqrt(energy fraction of the heads not ``kept``): the relative error of dropping them."""
    removed = energy.sum() - energy[kept].sum()
    return float((removed.clamp_min(0) / energy.sum().clamp_min(1e-300)).sqrt())


def plan_drop_kv(request: Request) -> Plan:
    """Per layer, the G = rank / head_dim groups of largest energy with their query heads (the output columns of
    those heads are left to the original). The plan's pruning record holds per layer the kept groups (in place of
    heads: a group is what is pruned), every group's energy, and the query/key parameters kept."""
    layers, kept_groups, energies, query_key_params = [], [], [], 0
    for layer, values, rank in zip(request.weights, request.values, request.ranks):
        start = time.perf_counter()
        kv_heads = layer.w_key.shape[0]
        every = layer.heads // kv_heads  # query heads per group
        if every > 1 and not request.rotary:
            raise ValueError(f"{layer.name}: method={DROP!r} builds kept-heads layers without rotary positions, which "
                             "need a key/value head per query head; this source groups them")
        groups = groups_at(DROP, rank, kv_heads, layer.head_dim, layer.name)
        head_energy = logit_forms(layer, request.rotary).head_norms_sq()
        group_energy = head_energy.reshape(kv_heads, every).sum(1)
        kept = sorted(group_energy.argsort(descending=True, stable=True)[:groups].tolist())
        heads = [g * every + j for g in kept for j in range(every)]
        value, value_bias = source_values(values, kv_heads)
        state = _state(layer.w_query[heads], _rows(layer.b_query, heads), layer.w_key[kept], _rows(layer.b_key, kept),
                       value[kept], _rows(value_bias, kept))
        value_energy = original_value_forms(values.w_value, values.w_output).head_norms_sq()
        layers.append(LayerPlan(
            state, _removed_fraction(head_energy, heads), value_error=_removed_fraction(value_energy, heads),
            kept_heads=heads, seconds=time.perf_counter() - start,
        ))
        kept_groups.append(kept)
        energies.append(group_energy.tolist())
        query_key_params += sum(t.numel() for name, t in state.items() if name.startswith(("query.", "key.")))
    return Plan(layers, {"rank": list(request.ranks), "heads": [len(p.kept_heads) for p in layers]}, "logit-energy",
                pruning=Pruning(kept_groups, energies, query_key_params))


def _group_sizes(merging: bool):
    def sizes(budget: int, kv_heads: int, head_dim: int, rope_pairs: int) -> CacheSizes | None:
        """The most whole key/value groups (of 2 x head_dim numbers) within the budget; merging needs a number that
        divides the source's groups (each merged group the mean of whole source groups)."""
        groups = [g for g in range(1, budget // (2 * head_dim) + 1) if not merging or kv_heads % g == 0]
        return CacheSizes(groups[-1] * head_dim) if groups else None

    return sizes


MERGE_KV = register(ConversionMethod(
    MERGE, "grouped-query attention: G key/value groups, each the mean of whole source groups (GQA's conversion)",
    plan_merge_kv, layer="gqa", reads_values=True, rotary_layer="rotary-gqa", sizes_within=_group_sizes(True),
    sized_layout=group_layout,
))
DROP_KV = register(ConversionMethod(
    DROP, "the G key/value groups of largest query/key energy, with their query heads; the others dropped",
    plan_drop_kv, layer="kept-heads", reads_values=True, rotary_layer="rotary-gqa",
    sizes_within=_group_sizes(False), sized_layout=group_layout,
))
