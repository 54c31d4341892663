"""Attention modules as plain torch: concatenated and collaborative heads, masks. No transformers here."""

from collab_attn.nn.attention import CollaborativeAttention, MultiHeadAttention, additive_mask

__all__ = ["CollaborativeAttention", "MultiHeadAttention", "additive_mask"]

from collab_attn.nn.variants import (  # noqa: E402
    GroupedQueryAttention,
    LatentAttention,
    MultiQueryAttention,
    cache_numbers_per_token,
)

__all__ += ["GroupedQueryAttention", "LatentAttention", "MultiQueryAttention", "cache_numbers_per_token"]

from collab_attn.nn.rotary import RotaryCollaborativeAttention  # noqa: E402

__all__ += ["RotaryCollaborativeAttention"]
