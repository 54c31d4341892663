"""The layer kinds: one package per kind, each holding its converted class and spec (``<kind>_layer.py``), the
readers of its products (``<kind>_forms.py``) and, where it has one, its standard form for export
(``<kind>_export.py``). What they share: the converted-layer base, ``LayerSpec`` and the registry ``LAYER_KINDS``
(``converted.py``), the forms types and shared readers (``forms.py``).

Importing a kind's package registers it; importing this package imports every kind, in the order tables list them.
The kinds import nothing of ``collab_attn.models`` (which builds the layers from the registry) or above it.
"""

import importlib
import pkgutil

from collab_attn.kinds.converted import (
    CACHE_KEYWORDS,
    LAYER_KINDS,
    REFUSED_KEYWORDS,
    SIZES,
    ConvertedSelfAttention,
    LayerSpec,
    Size,
    ValueCutSpec,
    VariantSelfAttention,
    attention_maps_recorded,
    cache_keyword,
    kv_heads_of,
    module_arguments,
    rotary_pairs,
)

# every kind's package, in the order of registration (the order tables list the kinds); a folder added beside them
# registers after them
ORDER = (
    "collaborative",
    "concatenated",
    "kept_heads",
    "gqa",
    "mla",
    "shared_key",
    "rotary_collaborative",
    "rotary_shared_key",
    "rotary_gqa",
    "rotary_mla",
    "rotary_tpa",
)
KIND_PACKAGES = ORDER + tuple(sorted(found.name for found in pkgutil.iter_modules(__path__)
                                     if found.ispkg and found.name not in ORDER))
for _package in KIND_PACKAGES:
    importlib.import_module(f"collab_attn.kinds.{_package}")

from collab_attn.kinds.collaborative import *  # noqa: E402, F403
from collab_attn.kinds.concatenated import *  # noqa: E402, F403
from collab_attn.kinds.gqa import *  # noqa: E402, F403
from collab_attn.kinds.kept_heads import *  # noqa: E402, F403
from collab_attn.kinds.mla import *  # noqa: E402, F403
from collab_attn.kinds.rotary_collaborative import *  # noqa: E402, F403
from collab_attn.kinds.rotary_gqa import *  # noqa: E402, F403
from collab_attn.kinds.rotary_mla import *  # noqa: E402, F403
from collab_attn.kinds.rotary_shared_key import *  # noqa: E402, F403
from collab_attn.kinds.rotary_tpa import *  # noqa: E402, F403
from collab_attn.kinds.shared_key import *  # noqa: E402, F403

__all__ = [
    "CACHE_KEYWORDS",
    "LAYER_KINDS",
    "REFUSED_KEYWORDS",
    "SIZES",
    "ConvertedSelfAttention",
    "LayerSpec",
    "Size",
    "ValueCutSpec",
    "VariantSelfAttention",
    "attention_maps_recorded",
    "cache_keyword",
    "kv_heads_of",
    "module_arguments",
    "rotary_pairs",
    "KIND_PACKAGES",
]
for _package in KIND_PACKAGES:
    __all__ += getattr(importlib.import_module(f"collab_attn.kinds.{_package}"), "__all__", [])
