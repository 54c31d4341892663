"""``svd``: concatenated heads whose query/key head size is cut to ``k = rank / heads``: each head product's best
rank-``k`` approximation, ``sqrt(S)`` to each side. Query/key parameters per layer: ``2 d_in D~ + heads d_in``,
collaborative attention's minus its ``heads x D~`` mixing. The query bias becomes the content bias (exact). With a
value rank D_v (a multiple of the heads) each head's value-output product is cut the same way to ``D_v / heads``:
narrower value heads, fewer values cached."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from collab_attn.decomposition.truncation import truncate_head_products
from collab_attn.models.hf import Layout
from collab_attn.models.methods.base import ConversionMethod, register
from collab_attn.models.plan import LayerPlan, Plan, Request, ValuePlan, ValueWeights

NAME = "svd"


def check_svd_ranks(ranks: Sequence[int], heads: int) -> None:
    for layer, value in enumerate(ranks):
        if value % heads:
            lower, upper = max(heads, value - value % heads), value - value % heads + heads
            raise ValueError(
                f"rank {value} for layer {layer} is not a multiple of the {heads} heads: the SVD baseline gives "
                f"each head rank / heads dimensions; choose e.g. {lower} or {upper}"
            )


def narrow_values(values: ValueWeights, value_rank: int) -> ValuePlan:
    """Each head's value-output product ``Wv_h^T Wo_h^T`` cut to rank ``value_rank / heads``: value heads of that
    width and the output columns that read them (the value bias folded into the output bias)."""
    heads = values.w_value.shape[0]
    truncated = truncate_head_products(values.w_value, values.w_output, value_rank // heads)
    return ValuePlan(truncated.w_query.flatten(0, 1), truncated.w_key.flatten(0, 1).T, None, values.output_bias(),
                     truncated.relative_error)


def plan_svd(request: Request) -> Plan:
    layers = []
    value_ranks = request.value_ranks or [None] * len(request.weights)
    progress = tqdm(request.weights, desc=NAME, disable=not request.progress)
    for index, (layer, rank, value_rank) in enumerate(zip(progress, request.ranks, value_ranks)):
        start = time.perf_counter()
        truncated = truncate_head_products(layer.w_query, layer.w_key, rank // layer.heads)
        layers.append(LayerPlan(
            truncated.w_query.flatten(0, 1), truncated.w_key.flatten(0, 1), content_bias=layer.content_bias(),
            relative_error=truncated.relative_error,
            values=None if value_rank is None else narrow_values(request.values[index], value_rank),
        ))
        layers[-1].seconds = time.perf_counter() - start
    return Plan(Layout(NAME, list(request.ranks), value_ranks=request.value_ranks), layers, NAME)


SVD = register(ConversionMethod(
    NAME, "concatenated heads of query/key size rank / heads, each head product SVD-truncated",
    plan_svd, layer="concatenated", check_ranks=check_svd_ranks, cuts_values=True,
))
