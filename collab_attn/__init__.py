"""collab-attn: collaborative multi-head attention (Cordonnier, Loukas & Jaggi, 2020).

Importing the package registers the converted models (encoders and decoders) and the from-scratch classifier with the
transformers Auto classes.
"""

from collab_attn.decomposition.decompose import HeadDecomposition, decompose_heads
from collab_attn.fitting.allocation import Allocation, allocate_cache
from collab_attn.fitting.end_to_end import EndToEndFit, fit_end_to_end
from collab_attn.fitting.layer_fit import FitReport, fit_to_original
from collab_attn.fitting.sensitivity import Sensitivity, layer_sensitivity
from collab_attn.kinds.collaborative.collaborative_attention import CollaborativeAttention
from collab_attn.kinds.concatenated.concatenated_attention import MultiHeadAttention
from collab_attn.models import hf as _hf  # noqa: F401  (registers the Auto classes)
from collab_attn.models import scratch_classifier as _scratch_classifier  # noqa: F401  (registers the classifier)
from collab_attn.models.conversion import ReparamReport, reparametrize
from collab_attn.serving import export

__all__ = [
    "CollaborativeAttention",
    "MultiHeadAttention",
    "HeadDecomposition",
    "decompose_heads",
    "ReparamReport",
    "reparametrize",
    "FitReport",
    "fit_to_original",
    "EndToEndFit",
    "fit_end_to_end",
    "Sensitivity",
    "layer_sensitivity",
    "Allocation",
    "allocate_cache",
    "export",
]
