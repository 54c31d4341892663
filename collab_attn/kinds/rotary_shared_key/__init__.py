"""The ``rotary-shared-key`` layer kind. Thin keys that keep rotary positions exactly (``key-svd`` of a rotary
model). Importing the package registers the kind in ``LAYER_KINDS``."""

from collab_attn.kinds.rotary_shared_key.rotary_shared_key_attention import RotarySharedKeyAttention
from collab_attn.kinds.rotary_shared_key.rotary_shared_key_forms import (
    rotary_shared_key_forms,
    rotary_shared_key_values,
)
from collab_attn.kinds.rotary_shared_key.rotary_shared_key_layer import (
    RotarySharedKeySelfAttention,
    RotarySharedKeySpec,
)

__all__ = [
    "RotarySharedKeyAttention",
    "RotarySharedKeySelfAttention",
    "RotarySharedKeySpec",
    "rotary_shared_key_forms",
    "rotary_shared_key_values",
]
