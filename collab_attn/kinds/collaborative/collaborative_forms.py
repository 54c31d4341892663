"""How collaborative heads' logit forms are read back from their weights."""

from __future__ import annotations

from collab_attn.kinds.collaborative.collaborative_attention import CollaborativeAttention
from collab_attn.kinds.forms import Factor, HeadForms


def collaborative_forms(layer: CollaborativeAttention) -> HeadForms:
    """Shared query/key projections, each head's CP mixing vector (or Tucker mixing matrix) on the query side."""
    mixing = layer.mixing if layer.mixing_core is None else layer.mixing_matrices()
    return HeadForms(Factor(layer.query.weight[None] * layer.scale, mixing), Factor(layer.key.weight[None]))
