"""Collaborative heads on rotary-position models (Llama, Qwen2, Mistral): the planner ``cp`` and ``tucker`` use
there (Tucker: ``collab_attn.decomposition.rotary_tucker``, a complex matrix per head and band instead of CP's
numbers, values shared by a Tucker decomposition as on any model).

Per frequency band, each head's logit form is one complex rank-1 matrix ``a_hi conj(b_gi)^T`` (its query and key
pair as complex vectors; a bias is one more input column). A complex CP of each band's stacked head forms
(``collab_attn.decomposition.rotary_cp``) gives shared query/key pairs that rotate with the band's angle and a complex
mixing number per head and pair: the rotation is kept exactly, whatever the number of pairs. ``rank`` is the shared
width in numbers, 2 x the pairs; at heads x head_dim every head keeps its own pairs (exact). Below it, the pairs are
spread over the bands by their energy (``allocate_pairs``). The values stay grouped as the source's, or are shared
(``value_rank``) as on any model: values carry no rotation.

With a calibration the pairs are allocated and fitted on the whitened forms (``rotary_whitening``): the error that is
minimized is that of the logits on inputs like the calibration's. A budget (``"mean:R"``, ``"energy:E"``) spreads the
pairs over the bands of all layers (``collab_attn.decomposition.rotary_budget``).
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from collab_attn.decomposition.rotary_budget import allocate_budget, shared_pairs
from collab_attn.decomposition.rotary_cp import (
    allocate_pairs,
    band_forms,
    band_spectra,
    rotary_decomposition,
    whiten_forms,
)
from collab_attn.decomposition.rotary_tucker import rotary_tucker
from collab_attn.decomposition.whitening import whitening_pair
from collab_attn.models.methods.decomposition import DecompositionOptions, shared_values
from collab_attn.models.methods.subspace import calibration_summary
from collab_attn.models.plan import LayerPlan, LayerWeights, Plan, Request


def with_bias_column(weights: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(heads, head_dim, d_in) weights with the bias as one more input column (inputs get a constant 1)."""
    return weights if bias is None else torch.cat([weights, bias[..., None]], dim=-1)


def rotary_whitening(request: Request, index: int, layer: LayerWeights):
    """``((S, S^-1), (S, S^-1))`` of layer ``index``'s inputs for the rotary key fits, or None without a calibration.
    Both sides use the raw second moments: the centered key statistic of the non-rotary fits relies on a key's mean
    shifting a whole softmax row by one constant, which the rotation breaks (the shift turns with ``p - s``). A bias
    input column (a constant 1) is whitened by 1."""
    if request.calibration is None:
        return None
    raw = request.calibration.covariance(index)[0]
    side = whitening_pair((raw, raw), layer.d_in, request.calibration.eps)[0]
    if layer.b_query is not None:
        side = tuple(torch.block_diag(matrix, torch.ones(1, 1, dtype=matrix.dtype)) for matrix in side)
    return side, side


def rotary_forms(layer: LayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Per band and head the complex query and key vectors of the layer's logit forms (``band_forms``), biases
    appended as an input column: (bands, heads, d_in [+ 1]) each."""
    return band_forms(with_bias_column(layer.w_query, layer.b_query), with_bias_column(layer.w_key, layer.b_key))


def seen_forms(layer: LayerWeights, whitening) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's band forms (``rotary_forms``) as the fit sees them: whitened with a calibration's ``whitening``
    (``rotary_whitening``; None: as they are)."""
    forms = rotary_forms(layer)
    return forms if whitening is None else whiten_forms(*forms, whitening)


def budget_pairs(request: Request, spectrum) -> list[list[int] | None]:
    """Pairs per band of every layer: from the request's budget (``allocate_budget`` on ``spectrum(index, layer)``,
    each layer's (bands, k) spectrum), or None per layer where the request gives ranks. With ``bands="shared"`` one
    split for every layer (``shared_pairs``): the same pairs per band, so the same ``pair_bands`` in every layer."""
    if request.bands == "shared":
        width = request.ranks[0] if request.ranks is not None else int(request.budget.value)
        split = shared_pairs([spectrum(index, layer) for index, layer in enumerate(request.weights)], width // 2)
        return [list(split) for _ in request.weights]
    if request.ranks is not None:
        return [None] * len(request.weights)
    return allocate_budget([spectrum(index, layer) for index, layer in enumerate(request.weights)], request.budget)


def plan_rotary(request: Request, method: str) -> Plan:
    """``cp`` (complex CP per band) or ``tucker`` (complex Tucker per band, one core slice per head) on a rotary
    model."""
    options: DecompositionOptions = request.options
    tucker = method == "tucker"
    if (options.solver, options.init) != ("implicit", "svd"):
        raise ValueError(f"solver={options.solver!r}, init={options.init!r} do not apply to rotary models: their "
                         f"bands are fitted by a complex {'HOOI' if tucker else 'ALS'} started from SVDs "
                         "(solver='implicit', init='svd')")
    heads = request.weights[0].heads
    if tucker and options.tucker_core_size not in (None, heads):
        raise ValueError(f"tucker_core_size={options.tucker_core_size}: on rotary models the Tucker fit gives every "
                         f"head its own core slice (tucker_core_size = heads = {heads}); leave it out")
    allocation = budget_pairs(
        request, lambda index, layer: band_spectra(*seen_forms(layer, rotary_whitening(request, index, layer))))
    ranks = request.ranks or [2 * sum(pairs) for pairs in allocation]
    layers = []
    progress = tqdm(request.weights, desc=f"reparametrize ({method}, rotary, {request.budget or f'rank {ranks[0]}'})",
                    disable=not request.progress)
    for index, (layer, rank) in enumerate(zip(progress, ranks)):
        start = time.perf_counter()
        query = with_bias_column(layer.w_query, layer.b_query)
        key = with_bias_column(layer.w_key, layer.b_key)
        bands = layer.head_dim // 2
        whitening = rotary_whitening(request, index, layer)
        pairs = allocation[index]
        if pairs is None and rank == layer.heads * layer.head_dim:
            pairs = [layer.heads] * bands  # every head keeps its own pair in every band: exact
        elif pairs is None:
            pairs = allocate_pairs(*seen_forms(layer, whitening), rank // 2)  # the whitening computed once
        if all(count == layer.heads for count in pairs):
            whitening = None  # nothing is cut: the inputs cannot matter
        if tucker:
            fit = rotary_tucker(query, key, pairs, n_iter_max=options.n_iter_max, tol=options.tol,
                                whitening=whitening)
        else:
            fit = rotary_decomposition(query, key, pairs, n_iter_max=options.n_iter_max, tol=options.tol,
                                       seed=request.seed, whitening=whitening)
        state = {"query.weight": fit.query_weight[:, :layer.d_in], "key.weight": fit.key_weight[:, :layer.d_in],
                 "mixing": fit.mixing, "pair_bands": fit.pair_bands}
        if tucker:
            state["mixing_core"] = fit.core
        if layer.b_query is not None:
            state |= {"query.bias": fit.query_weight[:, layer.d_in], "key.bias": fit.key_weight[:, layer.d_in]}
        exact_but_calibrated = whitening is None and request.calibration is not None
        planned = LayerPlan(state, fit.relative_error, 0.0 if exact_but_calibrated else fit.weighted_error)
        if request.value_ranks is not None:
            covariance = None if request.calibration is None else request.calibration.covariance(index)
            value_state, planned.value_error = shared_values(
                request.values[index], request.value_ranks[index], request, covariance, method,
                heads if tucker else None)
            planned.state |= value_state
        planned.seconds = time.perf_counter() - start
        layers.append(planned)
    sizes = {"rank": list(ranks), "tucker_core_size": [heads if tucker else None] * len(ranks),
             "value_rank": request.value_ranks}
    return Plan(layers, sizes, "complex-hooi" if tucker else "complex-als", calibration=calibration_summary(request))
