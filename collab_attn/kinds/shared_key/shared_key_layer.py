"""The shared-key kind (``key-svd``: thin keys): its converted class."""

from __future__ import annotations

from collab_attn.kinds.converted import VariantSelfAttention
from collab_attn.kinds.shared_key.shared_key_attention import SharedKeyAttention
from collab_attn.kinds.shared_key.shared_key_forms import shared_key_forms


class SharedKeySelfAttention(VariantSelfAttention, SharedKeyAttention, kind="shared-key"):
    """Thin keys (``rank`` = the shared key's width): caches ``(batch, 1, tokens, size)`` keys and ``(batch, heads,
    tokens, head_dim)`` values."""

    query_key_reader = staticmethod(shared_key_forms)
