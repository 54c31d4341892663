"""A rotary shared-key layer whose shared value has the key's width, as standard multi-query attention
(``collab_attn.serving.standard`` has the form): each head's query weight and the output map over the heads."""

from __future__ import annotations

import torch

from collab_attn.kinds.converted import StandardForm, one_shared_key, pair_bands_of
from collab_attn.kinds.forms import linear_weights


def standard_queries(layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each head's own query weight and bias: (H, R, d), (H, R)."""
    weight, bias = linear_weights(layer.query)
    heads, width = layer.num_heads, layer.rank
    return weight.view(heads, width, -1), None if bias is None else bias.view(heads, width)


def standard_outputs(layer) -> torch.Tensor:
    """``[W_o,h U_g(h)]`` over the heads: (d, H R)."""
    out, _ = linear_weights(layer.output)
    up = layer.value_up.weight.detach().cpu().double().view(layer.kv_heads, layer.head_dim, -1)
    up = up.repeat_interleave(layer.num_heads // layer.kv_heads, dim=0)  # (H, head_dim, R)
    blocks = out.view(out.shape[0], layer.num_heads, layer.head_dim)
    return torch.einsum("dhk,hkr->dhr", blocks, up).flatten(1)


STANDARD_FORM = StandardForm(standard_queries, standard_outputs, one_shared_key, pair_bands_of)
