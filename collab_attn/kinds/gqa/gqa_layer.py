"""The grouped-query kind (``gqa``; one key/value head is multi-query attention): its converted class."""

from __future__ import annotations

from typing import TYPE_CHECKING

from collab_attn.kinds.converted import LayerSpec, VariantSelfAttention, kv_heads_of
from collab_attn.kinds.forms import grouped_values
from collab_attn.kinds.gqa.gqa_attention import GroupedQueryAttention
from collab_attn.kinds.gqa.gqa_forms import grouped_forms

if TYPE_CHECKING:
    from collab_attn.models.families import AttentionSite


class GroupedSelfAttention(VariantSelfAttention, GroupedQueryAttention, kind="gqa"):
    """Grouped-query heads (``rank`` = the key width kv_heads x head_dim; one key/value head is multi-query
    attention). Caches ``(batch, kv_heads, tokens, head_dim)`` keys and values."""

    query_key_reader = staticmethod(grouped_forms)
    value_reader = staticmethod(grouped_values)

    @classmethod
    def _size(cls, site: AttentionSite, spec: LayerSpec) -> int:
        return kv_heads_of(spec.heads, spec.rank, site.head_dim)
