"""The ``rotary-mla`` layer kind. MHA2MLA's latent attention with partial RoPE (``kv-svd`` of a rotary model).
Importing the package registers the kind in ``LAYER_KINDS``."""

from collab_attn.kinds.rotary_mla.rotary_mla_attention import (
    PartialRotaryLatentAttention,
    default_rope_pairs,
    dimension_order,
)
from collab_attn.kinds.rotary_mla.rotary_mla_forms import partial_rope_forms, partial_rope_values
from collab_attn.kinds.rotary_mla.rotary_mla_layer import PartialRotaryLatentSelfAttention, PartialRotaryLatentSpec

__all__ = [
    "PartialRotaryLatentAttention",
    "PartialRotaryLatentSelfAttention",
    "PartialRotaryLatentSpec",
    "default_rope_pairs",
    "dimension_order",
    "partial_rope_forms",
    "partial_rope_values",
]
