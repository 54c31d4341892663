"""How rotary grouped-query heads' logit forms are read back from their weights: complex forms per band."""

from __future__ import annotations

import torch
from torch import nn

from collab_attn.decomposition.rotary_cp import band_forms
from collab_attn.kinds.forms import BandForms, band_forms_of, per_head
from collab_attn.kinds.rotary_gqa.rotary_gqa_attention import RotaryGroupedQueryAttention


def rotary_grouped_forms(layer: RotaryGroupedQueryAttention) -> BandForms:
    """A rotary grouped-query layer's forms: per band, each query head's complex query vector against its group's
    complex key vector (biases as an input column), as an original rotary layer's."""

    def heads_of(projection: nn.Linear, heads: int) -> torch.Tensor:
        weight = projection.weight.double()
        if projection.bias is not None:
            weight = torch.cat([weight, projection.bias.double()[:, None]], dim=1)
        return per_head(weight, heads)

    query, key = heads_of(layer.query, layer.num_heads), heads_of(layer.key, layer.kv_heads)
    return band_forms_of(*band_forms(query, key), layer.scale)
