"""The ``concatenated`` layer kind. Concatenated heads of any query/key head size (``svd``), values per head or
narrower (``value_rank``). Importing the package registers the kind in ``LAYER_KINDS``."""

from collab_attn.kinds.concatenated.concatenated_attention import MultiHeadAttention
from collab_attn.kinds.concatenated.concatenated_forms import concatenated_forms
from collab_attn.kinds.concatenated.concatenated_layer import ConcatenatedSelfAttention

__all__ = [
    "ConcatenatedSelfAttention",
    "MultiHeadAttention",
    "concatenated_forms",
]
