"""``key-svd`` ("thin keys"): one SVD of the stacked key projection of all heads, ``[Wk_1; ...; Wk_H] ~= U S V^T``
cut to ``rank`` directions. Every head scores against the one shared key ``Y V S^{1/2}`` of width ``rank``, and
head h's query keeps its own map into that space, ``Wq_h^T U_h S^{1/2}`` (``U_h``: head h's rows of ``U``), so the
logits are ``(X Wq_h^T + bq_h) U_h S V^T Y^T``. The values stay per head. The cache holds ``rank + heads x
head_dim`` numbers per token and layer: never below half of the original's. Exact once ``rank`` reaches the key
projection's rank (heads x head_dim here). The key bias is dropped (one constant per softmax row); the query bias
is mapped with the query. With a calibration the SVD is of the key projection whitened by its inputs' statistics
(the keys, not the logits, are fitted to the data).

On rotary-position models (Llama, Qwen2, Mistral) the thin keys are cut per rotary frequency band, so that the shared
key keeps rotating (``collab_attn.models.methods.rotary_key_svd``; the ``rotary-shared-key`` layer): exact at
``kv_heads x head_dim``, and ``value_rank`` shares the values there too."""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from collab_attn.decomposition.truncation import shared_subspace
from collab_attn.models.methods.base import ConversionMethod, LayerSizes, even_split, register, uniform_layout
from collab_attn.models.methods.rotary_key_svd import plan_rotary_key_svd, rotary_key_layout
from collab_attn.models.methods.subspace import SOLVER, calibration_summary, input_whitening
from collab_attn.models.plan import LayerPlan, Plan, Request

NAME = "key-svd"


def plan_key_svd(request: Request) -> Plan:
    if request.rotary:
        return plan_rotary_key_svd(request, NAME)
    layers = []
    progress = tqdm(request.weights, desc=NAME, disable=not request.progress)
    for index, (layer, rank) in enumerate(zip(progress, request.ranks)):
        start = time.perf_counter()
        fit = shared_subspace(layer.w_key.flatten(0, 1), rank, input_whitening(request, index, layer))
        per_head = fit.up.reshape(layer.heads, layer.head_dim, rank)  # U_h S^{1/2}
        query = torch.einsum("hdr,hdi->hri", per_head, layer.w_query).flatten(0, 1)
        state = {"query.weight": query, "key.weight": fit.down}
        if layer.b_query is not None:
            state["query.bias"] = torch.einsum("hdr,hd->hr", per_head, layer.b_query).flatten()
        layers.append(LayerPlan(state, fit.relative_error, fit.weighted_error, seconds=time.perf_counter() - start))
    return Plan(layers, {"rank": list(request.ranks)}, SOLVER, calibration=calibration_summary(request))


def _sized_layout(method: ConversionMethod, site, layers: int, sizes: LayerSizes):
    """On rotary models thin rotary keys with grouped values (``rotary_key_layout``), elsewhere a shared key of
    ``sizes.rank``."""
    return (rotary_key_layout if site.rotary else uniform_layout)(method, site, layers, sizes)


KEY_SVD = register(ConversionMethod(
    NAME, "one key of width rank shared by every head, from an SVD of the stacked key projection (thin keys)",
    plan_key_svd, layer="shared-key", calibrated=True, reports_products_error=False, rotary_layer="rotary-shared-key",
    rotary_budgets=True, sizes_within=even_split, sized_layout=_sized_layout,
))
