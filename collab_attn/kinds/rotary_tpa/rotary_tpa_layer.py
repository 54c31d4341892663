"""The tensor product kind (``rotary-tpa``, trained from scratch): its spec and converted class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from collab_attn.kinds.converted import ConvertedSelfAttention, LayerSpec, ValueCutSpec, module_arguments
from collab_attn.kinds.rotary_tpa.rotary_tpa_attention import TensorProductAttention

if TYPE_CHECKING:
    from collab_attn.models.families import AttentionSite


@dataclass(frozen=True)
class TensorProductSpec(ValueCutSpec):
    """Tensor product attention: ``rank`` the keys' rank, ``value_rank`` the values' (None: the keys'),
    ``query_rank`` the queries' (None: dense queries)."""

    query_rank: int | None = None


class TensorProductSelfAttention(ConvertedSelfAttention, TensorProductAttention, kind="rotary-tpa"):
    """Tensor product attention with rotary positions (``collab_attn.kinds.rotary_tpa``), for models trained from
    scratch: sizes as its ``TensorProductSpec``. Takes the model's ``position_embeddings``; caches the key factors
    ``(batch, 1, tokens, rank (heads + head_dim))``, the rotated dimension factors among them, and the value factors
    alike."""

    Spec = TensorProductSpec
    value_reader = None  # no conversion builds it: its products are never compared
    rotary = True

    @classmethod
    def build(cls, site: AttentionSite, spec: TensorProductSpec) -> TensorProductSelfAttention:
        return cls(site.d_in, spec.heads, spec.rank, value_rank=spec.value_rank, query_rank=spec.query_rank,
                   **module_arguments(site, output_bias=site.output_bias)).attached(site)

    @classmethod
    def replaces_outer_output(cls, site: AttentionSite, spec: LayerSpec) -> bool:
        return spec.heads != site.heads  # the values keep every head's width: value_rank is their rank
