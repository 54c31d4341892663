"""The maths of the conversion: CP / Tucker of the stacked head products (implicit ALS and tensorly), whitening for
activation-aware fits, SVD truncation of single heads, rank selection. torch and tensorly only, no transformers."""

from collab_attn.decomposition.decompose import HeadDecomposition, decompose_heads

__all__ = ["HeadDecomposition", "decompose_heads"]
