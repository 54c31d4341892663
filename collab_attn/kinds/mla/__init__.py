"""The ``mla`` layer kind. Multi-head latent attention without rotary positions (``kv-svd``). Importing the package
registers the kind in ``LAYER_KINDS``."""

from collab_attn.kinds.mla.mla_attention import LatentAttention
from collab_attn.kinds.mla.mla_forms import latent_forms, latent_values
from collab_attn.kinds.mla.mla_layer import LatentSelfAttention

__all__ = [
    "LatentAttention",
    "LatentSelfAttention",
    "latent_forms",
    "latent_values",
]
