"""The rotary latent kind (``kv-svd`` of a rotary model: MHA2MLA's partial RoPE): its spec and converted class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from collab_attn.kinds.converted import ConvertedSelfAttention, LayerSpec, module_arguments
from collab_attn.kinds.rotary_mla.rotary_mla_attention import PartialRotaryLatentAttention, default_rope_pairs
from collab_attn.kinds.rotary_mla.rotary_mla_forms import partial_rope_forms, partial_rope_values

if TYPE_CHECKING:
    from collab_attn.models.families import AttentionSite


@dataclass(frozen=True)
class PartialRotaryLatentSpec(LayerSpec):
    """MHA2MLA's latent attention: ``rope_pairs``, the rotary pairs each key/value group keeps (None:
    ``default_rope_pairs``), and the ``bands`` they rotate with (its ``rope_bands``; None: the first ones)."""

    rope_pairs: int | None = None
    bands: list | None = None


class PartialRotaryLatentSelfAttention(ConvertedSelfAttention, PartialRotaryLatentAttention, kind="rotary-mla"):
    """MHA2MLA's latent attention on a rotary model (``collab_attn.kinds.rotary_mla``): ``rank`` = the latent width
    D_c, ``spec.rope_pairs`` = the rotary pairs each key/value group keeps (their bands are the layer's
    ``rope_bands`` buffer, saved with the weights). Takes the model's ``position_embeddings``; caches the rotated
    kept keys ``(batch, kv_heads, tokens, 2 rope_pairs)`` and the latent ``(batch, 1, tokens, rank)``. Its output
    projection always has a bias where the source has a value bias (folded into it)."""

    Spec = PartialRotaryLatentSpec
    query_key_reader = staticmethod(partial_rope_forms)
    value_reader = staticmethod(partial_rope_values)
    rotary = True
    plans_products_error = True
    bands_buffer = "rope_bands"

    @classmethod
    def build(cls, site: AttentionSite, spec: PartialRotaryLatentSpec) -> PartialRotaryLatentSelfAttention:
        rope_pairs = default_rope_pairs(site.head_dim) if spec.rope_pairs is None else spec.rope_pairs
        return cls(site.d_in, spec.heads, spec.rank, rope_pairs, rope_bands=spec.bands,
                   **module_arguments(site, kv_heads=site.kv_heads,
                                       output_bias=site.output_bias or site.bias)).attached(site)

    @classmethod
    def replaces_outer_output(cls, site: AttentionSite, spec: LayerSpec) -> bool:
        return True  # the value bias is folded into the output bias
