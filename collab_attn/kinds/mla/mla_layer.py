"""The latent kind (``mla``: multi-head latent attention without rotary positions; ``kv-svd``): its converted
class."""

from __future__ import annotations

from typing import TYPE_CHECKING

from collab_attn.kinds.converted import LayerSpec, VariantSelfAttention
from collab_attn.kinds.mla.mla_attention import LatentAttention
from collab_attn.kinds.mla.mla_forms import latent_forms, latent_values

if TYPE_CHECKING:
    from collab_attn.models.families import AttentionSite


class LatentSelfAttention(VariantSelfAttention, LatentAttention, kind="mla"):
    """Multi-head latent attention without rotary positions (``rank`` = the latent width). Caches one latent per
    token (``(batch, 1, tokens, latent_size)``, and an empty values tensor that keeps the position count). Always
    has an output projection of its own: the value bias it drops is folded into that projection's bias."""

    query_key_reader = staticmethod(latent_forms)
    value_reader = staticmethod(latent_values)

    @classmethod
    def replaces_outer_output(cls, site: AttentionSite, spec: LayerSpec) -> bool:
        return True
