"""Attention as plain torch: what every module shares (masks, the one ``forward``, the rotary skeleton, the CPU and
Triton kernels). No transformers here.

The modules themselves live with their layer kind (``collab_attn/kinds/<kind>/<kind>_attention.py``); the common
ones are named here too, imported on first use (``collab_attn.nn`` imports nothing of ``collab_attn.kinds``).
"""

import importlib

from collab_attn.nn.attention import additive_mask, cache_numbers_per_token

# the modules named here, by the module of their kind that holds them
MODULES = {
    "CollaborativeAttention": "collab_attn.kinds.collaborative.collaborative_attention",
    "MultiHeadAttention": "collab_attn.kinds.concatenated.concatenated_attention",
    "GroupedQueryAttention": "collab_attn.kinds.gqa.gqa_attention",
    "MultiQueryAttention": "collab_attn.kinds.gqa.gqa_attention",
    "LatentAttention": "collab_attn.kinds.mla.mla_attention",
    "SharedKeyAttention": "collab_attn.kinds.shared_key.shared_key_attention",
    "RotaryCollaborativeAttention": "collab_attn.kinds.rotary_collaborative.rotary_collaborative_attention",
}

__all__ = ["additive_mask", "cache_numbers_per_token", *MODULES]


def __getattr__(name: str):
    if name in MODULES:
        return getattr(importlib.import_module(MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
