"""How rotary collaborative heads' logit forms are read back from their weights: complex forms per band."""

from __future__ import annotations

import torch
from torch import nn

from collab_attn.kinds.forms import BandForms, complex_forms
from collab_attn.kinds.rotary_collaborative.rotary_collaborative_attention import RotaryCollaborativeAttention


def rotary_collaborative_forms(layer: RotaryCollaborativeAttention) -> BandForms:
    """A rotary collaborative layer's forms: per band, its pairs' shared query and key (biases as an input column)
    mixed by each head's complex numbers."""

    def pairs(projection: nn.Linear) -> torch.Tensor:
        weight = projection.weight.double()
        if projection.bias is not None:
            weight = torch.cat([weight, projection.bias.double()[:, None]], dim=1)
        real, imag = weight.chunk(2)
        return torch.complex(real, imag)  # (R, d)

    queries, keys = pairs(layer.query), pairs(layer.key)
    if layer.mixing_core is not None:  # Tucker: head h's query for pair s is sum_r C_h[r, s] q_r
        mixing = torch.complex(*(part.double() for part in layer.mixing_matrices()))  # (heads, R, R)
    else:
        mixing = torch.diag_embed(torch.complex(*layer.mixing.double().chunk(2, dim=1)))  # CP: diagonal
    forms = []
    for band in range(layer.head_dim // 2):
        index = (layer.pair_bands == band).nonzero().flatten()
        left = torch.einsum("hrs,rd->hsd", mixing[:, index][:, :, index], queries[index]) * layer.scale
        forms.append(complex_forms(left, keys[index][None]))
    return BandForms(forms)
