"""The rotary collaborative kind (``cp`` and ``tucker`` of a rotary model): its spec and converted class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from collab_attn.kinds.collaborative import CollaborativeSpec
from collab_attn.kinds.converted import ConvertedSelfAttention, module_arguments, rotary_pairs
from collab_attn.kinds.forms import grouped_values
from collab_attn.kinds.rotary_collaborative.rotary_collaborative_attention import RotaryCollaborativeAttention
from collab_attn.kinds.rotary_collaborative.rotary_collaborative_export import STANDARD_FORM
from collab_attn.kinds.rotary_collaborative.rotary_collaborative_forms import rotary_collaborative_forms

if TYPE_CHECKING:
    from collab_attn.models.families import AttentionSite


@dataclass(frozen=True)
class RotaryCollaborativeSpec(CollaborativeSpec):
    """Rotary collaborative heads: besides a collaborative layer's sizes, the ``bands`` its pairs rotate with (its
    ``pair_bands``; None: the layer's default)."""

    bands: list | None = None


class RotaryCollaborativeSelfAttention(ConvertedSelfAttention, RotaryCollaborativeAttention,
                                       kind="rotary-collaborative"):
    """Collaborative heads that keep rotary positions exactly (``collab_attn.nn.rotary``): ``rank`` = 2 x the shared
    query/key pairs, each rotating with its band; grouped values as the source's key/value heads, or shared
    (``value_rank``). Takes the model's ``position_embeddings`` and caches the rotated shared keys."""

    Spec = RotaryCollaborativeSpec
    query_key_reader = staticmethod(rotary_collaborative_forms)
    value_reader = staticmethod(grouped_values)
    collaborative = True
    rotary = True
    bands_buffer = "pair_bands"
    standard_form = STANDARD_FORM  # multi-query attention in disguise, for export

    @classmethod
    def build(cls, site: AttentionSite, spec: RotaryCollaborativeSpec) -> RotaryCollaborativeSelfAttention:
        pairs = rotary_pairs(spec, "a rotary layer's rank")
        block = pairs % spec.heads == 0 and spec.tucker_core_size in (None, spec.heads)
        # shared values fold the value bias into the output bias: Qwen2's output projection gains one
        output_bias = site.output_bias or (spec.value_rank is not None and site.bias)
        return cls(site.d_in, spec.heads, pairs, value_rank=spec.value_rank, tucker_core_size=spec.tucker_core_size,
                   pair_bands=spec.bands, mixing_init=spec.mixing_init or ("concatenate" if block else "ones"),
                   **module_arguments(site, kv_heads=site.kv_heads, output_bias=output_bias)).attached(site)
