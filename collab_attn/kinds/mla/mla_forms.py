"""How latent attention's logit forms and values are read back from its weights."""

from __future__ import annotations

import torch
from torch import nn

from collab_attn.kinds.forms import Factor, HeadForms, own_queries, per_head
from collab_attn.kinds.mla.mla_attention import LatentAttention


def latent_forms(layer: LatentAttention) -> HeadForms:
    """Every head's own query against its key up-projection of the shared latent."""
    return HeadForms(own_queries(layer), Factor(_latent_rows(layer, layer.key)))


def latent_values(layer: LatentAttention) -> Factor:
    """Each head's value up-projection of the shared latent."""
    return Factor(_latent_rows(layer, layer.value))


def _latent_rows(layer: LatentAttention, up: nn.Linear) -> torch.Tensor:
    """Head h's up-projection applied to the latent's down-projection, (heads, head_dim, d_in)."""
    return per_head(up.weight.double() @ layer.latent.weight.double(), layer.num_heads)
