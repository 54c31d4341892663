"""The ``rotary-gqa`` layer kind. Grouped-query heads with rotary positions (``merge-kv``, ``drop-kv``). Importing
the package registers the kind in ``LAYER_KINDS``."""

from collab_attn.kinds.rotary_gqa.rotary_gqa_attention import RotaryGroupedQueryAttention
from collab_attn.kinds.rotary_gqa.rotary_gqa_forms import rotary_grouped_forms
from collab_attn.kinds.rotary_gqa.rotary_gqa_layer import RotaryGroupedSelfAttention

__all__ = [
    "RotaryGroupedQueryAttention",
    "RotaryGroupedSelfAttention",
    "rotary_grouped_forms",
]
