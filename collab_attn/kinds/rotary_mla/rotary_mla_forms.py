"""How MHA2MLA's partial-RoPE latent attention's logit forms (per band) and values are read back from its weights."""

from __future__ import annotations

import torch
from torch import nn

from collab_attn.kinds.forms import BandForms, Factor, complex_forms, grouped, per_head
from collab_attn.kinds.rotary_mla.rotary_mla_attention import PartialRotaryLatentAttention


def partial_rope_forms(layer: PartialRotaryLatentAttention) -> BandForms:
    """A partial-RoPE latent layer's forms (the measure: ``collab_attn.models.methods.rotary_kv_svd``): per band, a
    kept band is each head's query pair against its group's key pair as complex vectors (it rotates); a dropped band
    is the static real form of the head's two query rows against the two key rows the latent gives back, compared
    as ``N + 0j``. Biases are an input column, as in the original's forms."""

    def rows(projection: nn.Linear, weight: torch.Tensor) -> torch.Tensor:
        if projection.bias is None:
            return weight
        return torch.cat([weight, projection.bias.double()[:, None]], dim=1)

    heads, groups, head_dim = layer.num_heads, layer.kv_heads, layer.head_dim
    half, group = head_dim // 2, heads // groups
    query = per_head(rows(layer.query, layer.query.weight.double()), heads)  # (H, d_h, d')
    rope = rows(layer.rope_key, layer.rope_key.weight.double())
    nope = rows(layer.nope_key, layer.nope_key.weight.double() @ layer.latent.weight.double())
    width, d_in = 2 * layer.rope_pairs, query.shape[-1]
    held = torch.cat([rope.view(groups, width, d_in), nope.view(groups, head_dim - width, d_in)], dim=1)
    order = layer.dimension_order()[..., None].expand_as(held)
    key = torch.empty_like(held).scatter_(1, order, held).repeat_interleave(group, 0)  # (H, d_h, d'), source order
    kept = torch.zeros(groups, half, dtype=torch.bool, device=query.device)
    kept.scatter_(1, layer.rope_bands.to(query.device), True)
    kept = kept.repeat_interleave(group, 0)[:, :, None, None]  # (H, bands, 1, 1)
    forms = []
    for band in range(half):
        pairs = []
        for side in (query, key):
            first, second = side[:, band], side[:, band + half]
            rotating = torch.stack([torch.complex(first, second), torch.zeros_like(first, dtype=torch.complex128)], 1)
            static = torch.stack([first, second], 1).to(torch.complex128)
            pairs.append(torch.where(kept[:, band], rotating, static))  # (H, 2, d')
        forms.append(complex_forms(pairs[0] * layer.scale, pairs[1]))
    return BandForms(forms)


def partial_rope_values(layer: PartialRotaryLatentAttention) -> Factor:
    """The groups' values from the latent."""
    values = layer.value.weight.double() @ layer.latent.weight.double()
    return Factor(grouped(values, layer.kv_heads, layer.num_heads))
