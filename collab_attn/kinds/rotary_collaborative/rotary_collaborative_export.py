"""A rotary collaborative layer whose shared value has the key's width, as standard multi-query attention
(``collab_attn.serving.standard`` has the form): each head's query weight and the output map over the heads."""

from __future__ import annotations

import copy

import torch

from collab_attn.kinds.converted import StandardForm, one_shared_key, pair_bands_of
from collab_attn.kinds.forms import linear_weights


def standard_queries(layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Head ``h``'s query weight ``M_h W_q``: the layer's own head mixing (``head_queries``, linear in what it mixes)
    applied to the shared query's weight columns as if they were rotated queries."""
    weight, bias = linear_weights(layer.query)
    twin = copy.deepcopy(layer).to(device="cpu", dtype=torch.float64)  # the layer itself stays as it is
    with torch.no_grad():
        mixed = twin.head_queries(weight.cpu().T[None])[0]  # (H, d, R)
        mixed_bias = None if bias is None else twin.head_queries(bias.cpu()[None, None])[0, :, 0]  # (H, R)
    return mixed.transpose(1, 2), mixed_bias


def standard_outputs(layer) -> torch.Tensor:
    """``[W_o N_h^T]`` over the heads (``N_h = diag(n_h)`` for CP, the head's Tucker matrix otherwise): (d, H R)."""
    out, _ = linear_weights(layer.output)
    if layer.value_core is not None:
        mixing = torch.einsum("hg,gvw->hvw", *(p.detach().cpu().double() for p in (layer.value_mixing,
                                                                                   layer.value_core)))
    else:
        mixing = torch.diag_embed(layer.value_mixing.detach().cpu().double())  # (H, R, R)
    return torch.einsum("dw,hvw->dhv", out, mixing).flatten(1)


STANDARD_FORM = StandardForm(standard_queries, standard_outputs, one_shared_key, pair_bands_of)
