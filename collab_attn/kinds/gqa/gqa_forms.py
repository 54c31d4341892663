"""How grouped-query heads' logit forms are read back from their weights."""

from __future__ import annotations

from collab_attn.kinds.forms import Factor, HeadForms, grouped, own_queries
from collab_attn.kinds.gqa.gqa_attention import GroupedQueryAttention


def grouped_forms(layer: GroupedQueryAttention) -> HeadForms:
    """Every head's own query against its group's key."""
    return HeadForms(own_queries(layer), Factor(grouped(layer.key.weight, layer.kv_heads, layer.num_heads)))
