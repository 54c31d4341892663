"""How thin keys' logit forms are read back from their weights."""

from __future__ import annotations

from collab_attn.kinds.forms import Factor, HeadForms, own_queries
from collab_attn.kinds.shared_key.shared_key_attention import SharedKeyAttention


def shared_key_forms(layer: SharedKeyAttention) -> HeadForms:
    """Every head's own query against one shared key."""
    return HeadForms(own_queries(layer), Factor(layer.key.weight[None]))
