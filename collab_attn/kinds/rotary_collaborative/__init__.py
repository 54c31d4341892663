"""The ``rotary-collaborative`` layer kind. Collaborative heads that keep rotary positions exactly (``cp``,
``tucker`` of a rotary model). Importing the package registers the kind in ``LAYER_KINDS``."""

from collab_attn.kinds.rotary_collaborative.rotary_collaborative_attention import RotaryCollaborativeAttention
from collab_attn.kinds.rotary_collaborative.rotary_collaborative_forms import rotary_collaborative_forms
from collab_attn.kinds.rotary_collaborative.rotary_collaborative_layer import (
    RotaryCollaborativeSelfAttention,
    RotaryCollaborativeSpec,
)

__all__ = [
    "RotaryCollaborativeAttention",
    "RotaryCollaborativeSelfAttention",
    "RotaryCollaborativeSpec",
    "rotary_collaborative_forms",
]
