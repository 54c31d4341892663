"""The ``collaborative`` layer kind. Collaborative heads (``cp``, ``tucker``): shared query/key projections of width
``rank`` mixed per head, values per head or shared (``value_rank``). Importing the package registers the kind in
``LAYER_KINDS``."""

from collab_attn.kinds.collaborative.collaborative_attention import (
    CollaborativeAttention,
    init_head_mixing,
    share_values,
)
from collab_attn.kinds.collaborative.collaborative_forms import collaborative_forms
from collab_attn.kinds.collaborative.collaborative_layer import CollaborativeSelfAttention, CollaborativeSpec

__all__ = [
    "CollaborativeAttention",
    "CollaborativeSelfAttention",
    "CollaborativeSpec",
    "collaborative_forms",
    "init_head_mixing",
    "share_values",
]
