"""How rotary thin keys' logit forms (complex, per band) and values are read back from their weights."""

from __future__ import annotations

import torch
from torch import nn

from collab_attn.kinds.forms import BandForms, Factor, complex_forms, grouped, grouped_values
from collab_attn.kinds.rotary_shared_key.rotary_shared_key_attention import RotarySharedKeyAttention


def rotary_shared_key_forms(layer: RotarySharedKeyAttention) -> BandForms:
    """A rotary shared-key layer's forms: per band, each head's own complex query rows of the band's pairs against
    the shared key's (biases as an input column): ``M_hi = sum_{r in band i} q_hr conj(k_r)^T``."""

    def pairs(projection: nn.Linear) -> torch.Tensor:
        weight = projection.weight.double()
        if projection.bias is not None:
            weight = torch.cat([weight, projection.bias.double()[:, None]], dim=1)
        real, imag = weight.unflatten(0, (-1, 2, layer.pairs)).unbind(1)
        return torch.complex(real, imag)  # (heads or 1, R, d)

    queries, keys = pairs(layer.query), pairs(layer.key)
    forms = []
    for band in range(layer.head_dim // 2):
        index = (layer.pair_bands == band).nonzero().flatten().to(queries.device)
        forms.append(complex_forms(queries[:, index] * layer.scale, keys[:, index]))
    return BandForms(forms)


def rotary_shared_key_values(layer: RotarySharedKeyAttention) -> Factor:
    """The groups' values, expanded from one shared value where the layer has one (``value_up``)."""
    if layer.value_up is None:
        return grouped_values(layer)
    values = layer.value_up.weight.double() @ layer.value.weight.double()
    return Factor(grouped(values, layer.kv_heads, layer.num_heads))
