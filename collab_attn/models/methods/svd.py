"""``svd``: concatenated heads whose query/key head size is cut to ``k = rank / heads``: each head product's best
rank-``k`` approximation, ``sqrt(S)`` to each side. Query/key parameters per layer: ``2 d_in D~ + heads d_in``,
collaborative attention's minus its ``heads x D~`` mixing. The query bias becomes the content bias (exact)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from collab_attn.decomposition.truncation import truncate_head_products
from collab_attn.models.hf import Layout
from collab_attn.models.methods.base import ConversionMethod, register
from collab_attn.models.plan import LayerPlan, Plan, Request

NAME = "svd"


def check_svd_ranks(ranks: Sequence[int], heads: int) -> None:
    for layer, value in enumerate(ranks):
        if value % heads:
            lower, upper = max(heads, value - value % heads), value - value % heads + heads
            raise ValueError(
                f"rank {value} for layer {layer} is not a multiple of the {heads} heads: the SVD baseline gives "
                f"each head rank / heads query/key dimensions; choose e.g. {lower} or {upper}"
            )


def plan_svd(request: Request) -> Plan:
    layers = []
    for layer, rank in zip(tqdm(request.weights, desc=NAME, disable=not request.progress), request.ranks):
        start = time.perf_counter()
        truncated = truncate_head_products(layer.w_query, layer.w_key, rank // layer.heads)
        layers.append(LayerPlan(
            truncated.w_query.flatten(0, 1), truncated.w_key.flatten(0, 1), content_bias=layer.content_bias(),
            relative_error=truncated.relative_error, seconds=time.perf_counter() - start,
        ))
    return Plan(Layout(NAME, list(request.ranks)), layers, NAME)


SVD = register(ConversionMethod(
    NAME, "concatenated heads of query/key size rank / heads, each head product SVD-truncated",
    plan_svd, layer="concatenated", check_ranks=check_svd_ranks,
))
