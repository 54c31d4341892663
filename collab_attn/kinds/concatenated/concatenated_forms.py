"""How concatenated heads' logit forms are read back from their weights."""

from __future__ import annotations

from collab_attn.kinds.concatenated.concatenated_attention import MultiHeadAttention
from collab_attn.kinds.forms import Factor, HeadForms, own_queries, per_head


def concatenated_forms(layer: MultiHeadAttention) -> HeadForms:
    """Every head's own query and key."""
    return HeadForms(own_queries(layer), Factor(per_head(layer.key.weight, layer.num_heads)))
