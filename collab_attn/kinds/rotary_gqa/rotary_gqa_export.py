"""A rotary grouped-query layer (``merge-kv``, ``drop-kv``) is standard grouped-query attention already
(``collab_attn.serving.standard``): its own query and output projections, ``kv_heads`` key/value heads of the
source's head size, pair ``i`` of every head rotating with the source's band ``i``."""

from __future__ import annotations

import torch

from collab_attn.kinds.converted import StandardForm
from collab_attn.kinds.forms import linear_weights


def standard_queries(layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each head's query weight and bias: (H, head_dim, d), (H, head_dim)."""
    weight, bias = linear_weights(layer.query)
    heads, width = layer.num_heads, layer.head_dim
    return weight.view(heads, width, -1), None if bias is None else bias.view(heads, width)


def standard_outputs(layer) -> torch.Tensor:
    """The output projection: (d, H head_dim)."""
    return linear_weights(layer.output)[0]


def standard_shape(layer) -> tuple[int, int, int]:
    """Query heads, key/value heads and head size of the standard layer."""
    return layer.num_heads, layer.kv_heads, layer.head_dim


def standard_bands(layer) -> torch.Tensor:
    """The source band each pair rotates with: pair ``i`` with band ``i``, as in the source."""
    return torch.arange(layer.head_dim // 2)


STANDARD_FORM = StandardForm(standard_queries, standard_outputs, standard_shape, standard_bands)
