"""The ``rotary-tpa`` layer kind. Tensor product attention with rotary positions (trained from scratch). Importing
the package registers the kind in ``LAYER_KINDS``."""

from collab_attn.kinds.rotary_tpa.rotary_tpa_attention import TensorProductAttention, rotate_dims
from collab_attn.kinds.rotary_tpa.rotary_tpa_layer import TensorProductSelfAttention, TensorProductSpec

__all__ = [
    "TensorProductAttention",
    "TensorProductSelfAttention",
    "TensorProductSpec",
    "rotate_dims",
]
