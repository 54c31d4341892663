"""``key-svd`` on rotary-position models (Llama, Qwen2, Mistral): thin keys per rotary frequency band, the planner
of the ``rotary-shared-key`` layer (``collab_attn.kinds.rotary_shared_key``; TransMLA's per-frequency PCA of keys).

Per band ``i``, the complex key forms ``b_gi`` of the G key/value groups (biases as one more input column) are
stacked as the columns of a d x G matrix whose ``R_i`` leading left singular vectors ``U_i`` make the shared key
``U_i^T y``: ``R_i`` complex numbers per token rotating with ``theta_i``. Head ``h`` keeps a query of its own in that
space, ``conj(c_gi) a_hi`` with ``c_gi = U_i^H b_gi`` (``collab_attn.decomposition.rotary_keys`` has the math).
``rank`` = 2 sum_i R_i, even; the pairs are split among the bands greedily by the singular values' energy (largest
remaining ``sigma^2`` of the layer first). Exact at ``rank = kv_heads x head_dim`` (``R_i = G``: the original key
cache's width), and wider shared keys are refused (they would only cache zeros). The reported error is that of the
logit forms per band (``collab_attn.kinds.forms.BandForms``), checked against the installed layer. With a
calibration the bands' SVDs are of the whitened key forms (``rotary_whitening``; ``weighted_error`` reports their
fit). A budget (``"mean:R"``, ``"energy:E"``) spreads the pairs over the bands of all layers by the squared singular
values (``collab_attn.decomposition.rotary_budget``).

Values: grouped as the source's by default (the source's value and output projections are kept). With
``value_rank=V``: one SVD of the stacked value projections of the G groups (G d_h x d) cut to ``V``
(``shared_subspace``): ``v = W_down y`` (V numbers per token, cached, no bias) for every head and ``W_up,g`` (d_h x V)
per group, applied to the context each head took from ``v``; the output projection stays, its bias gains the value
bias (attention rows sum to one). Exact at ``V = G d_h``; ``value_error`` is that of the value-output products
``Wv_g(h)^T Wo_h^T``.

Cache per token and layer: ``rank + G d_h`` numbers, or ``rank + V`` with shared values (the original's ``2 G d_h``).
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from collab_attn.decomposition.rotary_keys import key_band_svd, thin_rotary_keys
from collab_attn.decomposition.truncation import shared_subspace
from collab_attn.kinds.forms import Factor, HeadForms, original_value_forms, relative_error
from collab_attn.models.families import AttentionSite
from collab_attn.models.hf import Layout
from collab_attn.models.methods.base import LayerSizes
from collab_attn.models.methods.rotary_collab import budget_pairs, rotary_forms, rotary_whitening, with_bias_column
from collab_attn.models.methods.subspace import SOLVER, calibration_summary, input_whitening
from collab_attn.models.plan import LayerPlan, LayerWeights, Plan, Request, ValueWeights


def widest_key(layer: LayerWeights, kv_heads: int) -> int:
    """The widest useful shared key: 2 numbers per pair, at most ``min(G, d_in [+ 1])`` pairs per band (the rank of a
    band's stacked key forms), so ``G x head_dim`` where ``d_in >= G``."""
    d_in = layer.d_in + (layer.b_key is not None)
    return 2 * (layer.head_dim // 2) * min(kv_heads, d_in)


def rotary_key_layout(method, site: AttentionSite, layers: int, sizes: LayerSizes) -> Layout | None:
    """The layout of a rotary model of ``layers`` layers like ``site`` converted by ``method`` (``key-svd``) with a
    shared key of width ``sizes.rank`` and grouped values (shared values of width ``sizes.value_rank`` where it is
    set); None where a width is odd (the key's) or wider than exact (``kv_heads x head_dim``)."""
    exact = site.kv_heads * site.head_dim
    if sizes.rank % 2 or sizes.rank > exact or (sizes.value_rank or 0) > exact:
        return None
    return Layout.uniform(method.name, method.layer_for(True), layers, rank=sizes.rank, value_rank=sizes.value_rank)


def shared_value_state(values: ValueWeights, kv_heads: int, value_rank: int, whitening=None) -> tuple[dict, float]:
    """The state of shared values of width ``value_rank`` (module doc) and the relative error of the value-output
    products it gives; with ``whitening`` (a calibration's, ``input_whitening``) the SVD is fitted to the inputs."""
    heads, head_dim, _ = values.w_value.shape
    groups = values.w_value[:: heads // kv_heads]  # (G, d_h, d): given per head, read per group
    fit = shared_subspace(groups.flatten(0, 1), value_rank, whitening)
    state = values.replaced_by(fit.down, values.w_output.flatten(0, 1).T, value_bias=False)
    state["value_up.weight"] = fit.up
    installed = (fit.up @ fit.down).view(kv_heads, head_dim, -1).repeat_interleave(heads // kv_heads, dim=0)
    error = relative_error(HeadForms(Factor(installed), Factor(values.w_output)),
                           original_value_forms(values.w_value, values.w_output))
    return state, error


def key_spectrum(request: Request, index: int, layer: LayerWeights) -> torch.Tensor:
    """(bands, min(G, d)) squared singular values of each band's key forms, whitened with a calibration: what each
    pair of the band's shared key removes from the error of its keys."""
    heads, groups = layer.w_query.shape[0], layer.w_key.shape[0]
    keys = rotary_forms(layer)[1][:, :: heads // groups]
    whitening = rotary_whitening(request, index, layer)
    if whitening is not None:
        keys = keys @ whitening[1][0].to(keys.dtype)
    return key_band_svd(keys)[1].square()


def _plan_layer(request: Request, index: int, pairs: list[int] | None) -> LayerPlan:
    start = time.perf_counter()
    layer = request.weights[index]
    rank = request.ranks[index] if pairs is None else 2 * sum(pairs)
    kv_heads = layer.w_key.shape[0]
    if rank % 2:
        raise ValueError(f"rank {rank} is odd: a rotary shared key counts each of its pairs twice (real and imaginary "
                         "parts), so ranks must be even")
    widest = widest_key(layer, kv_heads)
    if rank > widest:
        raise ValueError(
            f"rank {rank} for layer {index}: a shared key holds at most {kv_heads} pairs per band (the rank of the "
            f"band's {kv_heads} key forms) in {layer.head_dim // 2} bands, {widest} numbers, which is exact (the "
            f"original key cache's width); a wider one only caches zeros: choose an even rank of at most {widest}")
    query = with_bias_column(layer.w_query, layer.b_query)
    key = with_bias_column(layer.w_key, layer.b_key)
    fit = thin_rotary_keys(query, key, rank // 2 if pairs is None else pairs, rotary_whitening(request, index, layer))
    d_in = layer.d_in
    state = {"query.weight": fit.query_weight[..., :d_in].flatten(0, 1), "key.weight": fit.key_weight[:, :d_in],
             "pair_bands": fit.pair_bands}
    if layer.b_query is not None:
        state |= {"query.bias": fit.query_weight[..., d_in].flatten(), "key.bias": fit.key_weight[:, d_in]}
    planned = LayerPlan(state, fit.relative_error, fit.weighted_error)
    if request.value_ranks is not None:
        value_rank = request.value_ranks[index]
        if value_rank > kv_heads * layer.head_dim:
            raise ValueError(
                f"value_rank {value_rank} for layer {index}: the shared value holds the values of {kv_heads} key/value "
                f"heads of {layer.head_dim}, at most {kv_heads * layer.head_dim} numbers (exact); choose a value_rank "
                f"of at most {kv_heads * layer.head_dim}")
        value_state, planned.value_error = shared_value_state(
            request.values[index], kv_heads, value_rank, input_whitening(request, index, layer, values=True))
        planned.state |= value_state
    planned.seconds = time.perf_counter() - start
    return planned


def plan_rotary_key_svd(request: Request, method: str) -> Plan:
    """The ``rotary-shared-key`` plan of every layer (module doc); ``rank`` the shared key's width, even."""
    allocation = budget_pairs(request, lambda index, layer: key_spectrum(request, index, layer))
    progress = tqdm(range(len(request.weights)), desc=f"{method} (rotary, per band)", disable=not request.progress)
    layers = [_plan_layer(request, index, allocation[index]) for index in progress]
    ranks = request.ranks or [2 * sum(pairs) for pairs in allocation]
    return Plan(layers, {"rank": list(ranks), "value_rank": request.value_ranks}, SOLVER,
                calibration=calibration_summary(request))
