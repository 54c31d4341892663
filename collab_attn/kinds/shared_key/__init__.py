"""The ``shared-key`` layer kind. Thin keys: one key shared by every head, values per head (``key-svd``). Importing
the package registers the kind in ``LAYER_KINDS``."""

from collab_attn.kinds.shared_key.shared_key_attention import SharedKeyAttention
from collab_attn.kinds.shared_key.shared_key_forms import shared_key_forms
from collab_attn.kinds.shared_key.shared_key_layer import SharedKeySelfAttention

__all__ = [
    "SharedKeyAttention",
    "SharedKeySelfAttention",
    "shared_key_forms",
]
