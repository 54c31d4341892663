"""The ``kept-heads`` layer kind. Some of the original heads (``prune``), as concatenated heads. Importing the
package registers the kind in ``LAYER_KINDS``."""

from collab_attn.kinds.kept_heads.kept_heads_layer import KeptHeadsSelfAttention

__all__ = [
    "KeptHeadsSelfAttention",
]
