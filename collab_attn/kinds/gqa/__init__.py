"""The ``gqa`` layer kind. Grouped-query heads (GQA; one key/value head: MQA). Importing the package registers the
kind in ``LAYER_KINDS``."""

from collab_attn.kinds.gqa.gqa_attention import GroupedQueryAttention, MultiQueryAttention
from collab_attn.kinds.gqa.gqa_forms import grouped_forms
from collab_attn.kinds.gqa.gqa_layer import GroupedSelfAttention

__all__ = [
    "GroupedQueryAttention",
    "GroupedSelfAttention",
    "MultiQueryAttention",
    "grouped_forms",
]
