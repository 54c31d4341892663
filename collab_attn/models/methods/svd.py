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
from collab_attn.models.methods.base import ConversionMethod, register
from collab_attn.models.plan import LayerPlan, Plan, Request, ValueWeights

NAME = "svd"


def check_svd_ranks(ranks: Sequence[int], heads: int) -> None:
    for layer, value in enumerate(ranks):
        if value % heads:
            lower, upper = max(heads, value - value % heads), value - value % heads + heads
            raise ValueError(
                f"rank {value} for layer {layer} is not a multiple of the {heads} heads: the SVD baseline gives "
                f"each head rank / heads dimensions; choose e.g. {lower} or {upper}"
            )


def narrow_values(values: ValueWeights, value_rank: int) -> tuple[dict, float]:
    """Each head's value-output product ``Wv_h^T Wo_h^T`` cut to rank ``value_rank / heads``: value heads of that
    width and the output columns that read them (the value bias folded into the output bias). Returns the layer's
    value-side state and the relative error of the cut products."""
    heads = values.w_value.shape[0]
    truncated = truncate_head_products(values.w_value, values.w_output, value_rank // heads)
    state = values.replaced_by(truncated.w_query.flatten(0, 1), truncated.w_key.flatten(0, 1).T)
    return state, truncated.relative_error


def plan_svd(request: Request) -> Plan:
    layers = []
    value_ranks = request.value_ranks or [None] * len(request.weights)
    progress = tqdm(request.weights, desc=NAME, disable=not request.progress)
    for index, (layer, rank, value_rank) in enumerate(zip(progress, request.ranks, value_ranks)):
        start = time.perf_counter()
        truncated = truncate_head_products(layer.w_query, layer.w_key, rank // layer.heads)
        state = {"query.weight": truncated.w_query.flatten(0, 1), "key.weight": truncated.w_key.flatten(0, 1),
                 **layer.content_bias_state()}
        planned = LayerPlan(state, truncated.relative_error)
        if value_rank is not None:
            value_state, planned.value_error = narrow_values(request.values[index], value_rank)
            planned.state |= value_state
        planned.seconds = time.perf_counter() - start
        layers.append(planned)
    return Plan(layers, {"rank": list(request.ranks), "value_rank": request.value_ranks}, NAME)


SVD = register(ConversionMethod(
    NAME, "concatenated heads of query/key size rank / heads, each head product SVD-truncated",
    plan_svd, layer="concatenated", check_ranks=check_svd_ranks, cuts_values=True,
))
