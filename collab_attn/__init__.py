"""collab-attn: collaborative multi-head attention (Cordonnier, Loukas & Jaggi, 2020).

Importing the package registers the collaborative BERT-family models with the transformers Auto classes.
"""

from collab_attn import hf as _hf  # noqa: F401  (registers the Auto classes)
from collab_attn.attention import CollaborativeAttention, MultiHeadAttention
from collab_attn.decompose import HeadDecomposition, decompose_heads
from collab_attn.reparam import ReparamReport, reparametrize

__all__ = [
    "CollaborativeAttention",
    "MultiHeadAttention",
    "HeadDecomposition",
    "decompose_heads",
    "ReparamReport",
    "reparametrize",
]
