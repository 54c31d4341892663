"""The rotary grouped-query kind (``merge-kv``, ``drop-kv``): its converted class."""

from __future__ import annotations

from typing import TYPE_CHECKING

from collab_attn.kinds.converted import ConvertedSelfAttention, LayerSpec, kv_heads_of, module_arguments
from collab_attn.kinds.forms import grouped_values
from collab_attn.kinds.rotary_gqa.rotary_gqa_attention import RotaryGroupedQueryAttention
from collab_attn.kinds.rotary_gqa.rotary_gqa_export import STANDARD_FORM
from collab_attn.kinds.rotary_gqa.rotary_gqa_forms import rotary_grouped_forms

if TYPE_CHECKING:
    from collab_attn.models.families import AttentionSite


class RotaryGroupedSelfAttention(ConvertedSelfAttention, RotaryGroupedQueryAttention, kind="rotary-gqa"):
    """Grouped-query heads with rotary positions (``collab_attn.kinds.rotary_gqa``): the source's attention with
    ``rank / head_dim`` key/value groups (merged or kept ones) and ``spec.heads`` query heads (fewer where whole
    groups were dropped). Takes the model's ``position_embeddings``; caches ``(batch, kv_heads, tokens, head_dim)``
    rotated keys and values."""

    query_key_reader = staticmethod(rotary_grouped_forms)
    value_reader = staticmethod(grouped_values)
    rotary = True
    standard_form = STANDARD_FORM  # standard grouped-query attention already, for export

    @classmethod
    def build(cls, site: AttentionSite, spec: LayerSpec) -> RotaryGroupedSelfAttention:
        return cls(site.d_in, spec.heads, kv_heads_of(spec.heads, spec.rank, site.head_dim),
                   **module_arguments(site, output_bias=site.output_bias)).attached(site)
