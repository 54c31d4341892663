"""The conversion methods, one module each, registered by name in ``METHODS`` (see ``base.ConversionMethod``).

Adding a method: a module here that builds a ``ConversionMethod`` (its options dataclass, the layer kind it builds,
what it needs, its planner) and calls ``register``, its import below, a ``configs/collab/<name>.yaml`` whose keys are
``method``, ``rank`` and the settings ``collab_attn.models.settings`` derives from the method, and its tests.
"""

# registration order is the order tables and choices list the methods in
from collab_attn.models.methods import cp, tucker, svd, prune, key_svd, kv_svd  # noqa: F401, I001  (register the methods)
from collab_attn.models.methods import kv_groups  # noqa: F401, I001  (registers merge-kv and drop-kv)
from collab_attn.models.methods.base import (
    METHODS, MIXINGS, ConversionMethod, LayerSizes, NoOptions, get_method, register,
)
from collab_attn.models.methods.decomposition import DecompositionOptions
from collab_attn.models.methods.prune import heads_to_keep
from collab_attn.models.methods.svd import check_svd_ranks

PAPER_METHOD = cp.NAME  # the paper's method: what reparametrize and the accounting do unless told otherwise

__all__ = [
    "METHODS", "MIXINGS", "PAPER_METHOD", "ConversionMethod", "DecompositionOptions", "LayerSizes", "NoOptions",
    "check_svd_ranks", "get_method", "heads_to_keep", "register",
]
