"""The rotary shared-key kind (``key-svd`` of a rotary model: thin keys per band): its spec and converted class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from collab_attn.kinds.converted import ConvertedSelfAttention, ValueCutSpec, module_arguments, rotary_pairs
from collab_attn.kinds.rotary_shared_key.rotary_shared_key_attention import RotarySharedKeyAttention
from collab_attn.kinds.rotary_shared_key.rotary_shared_key_export import STANDARD_FORM
from collab_attn.kinds.rotary_shared_key.rotary_shared_key_forms import (
    rotary_shared_key_forms,
    rotary_shared_key_values,
)

if TYPE_CHECKING:
    from collab_attn.models.families import AttentionSite


@dataclass(frozen=True)
class RotarySharedKeySpec(ValueCutSpec):
    """A rotary shared key: ``bands``, the bands its pairs rotate with (its ``pair_bands``; None: the default)."""

    bands: list | None = None


class RotarySharedKeySelfAttention(ConvertedSelfAttention, RotarySharedKeyAttention, kind="rotary-shared-key"):
    """Thin keys that keep rotary positions exactly (``collab_attn.kinds.rotary_shared_key``; ``key-svd`` of a rotary
    model): ``rank`` = 2 x the shared key's pairs, each rotating with its band, every head with a query of its own;
    grouped values as the source's key/value heads, or one shared value of width ``value_rank``. Takes the model's
    ``position_embeddings``; caches the rotated shared key ``(batch, 1, tokens, rank)`` and the values."""

    Spec = RotarySharedKeySpec
    query_key_reader = staticmethod(rotary_shared_key_forms)
    value_reader = staticmethod(rotary_shared_key_values)
    rotary = True
    plans_products_error = True  # key-svd's other plans report the error of the keys; this one the logit forms'
    bands_buffer = "pair_bands"
    standard_form = STANDARD_FORM  # multi-query attention in disguise, for export

    @classmethod
    def build(cls, site: AttentionSite, spec: RotarySharedKeySpec) -> RotarySharedKeySelfAttention:
        pairs = rotary_pairs(spec, "a rotary shared key's width")
        # shared values fold the value bias into the output bias: Qwen2's output projection gains one
        output_bias = site.output_bias or (spec.value_rank is not None and site.bias)
        return cls(site.d_in, spec.heads, pairs, value_rank=spec.value_rank, pair_bands=spec.bands,
                   **module_arguments(site, kv_heads=site.kv_heads, output_bias=output_bias)).attached(site)
