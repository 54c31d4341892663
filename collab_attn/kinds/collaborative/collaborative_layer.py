"""The collaborative kind (``cp``, ``tucker``): its spec and converted class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from collab_attn.kinds.collaborative.collaborative_attention import CollaborativeAttention
from collab_attn.kinds.collaborative.collaborative_forms import collaborative_forms
from collab_attn.kinds.converted import ConvertedSelfAttention, ValueCutSpec, module_arguments

if TYPE_CHECKING:
    from collab_attn.models.families import AttentionSite


@dataclass(frozen=True)
class CollaborativeSpec(ValueCutSpec):
    """Collaborative heads: the ``tucker_core_size`` of Tucker mixing (None: one mixing vector per head) and the
    ``mixing_init`` of a layer built from a config (None: block mixing where it fits)."""

    tucker_core_size: int | None = None
    mixing_init: str | None = None


class CollaborativeSelfAttention(ConvertedSelfAttention, CollaborativeAttention, kind="collaborative"):
    """Collaborative heads (shared query/key projections of width ``rank``, per-head mixing; with ``value_rank``, one
    shared value per token too) in a transformers model."""

    Spec = CollaborativeSpec
    query_key_reader = staticmethod(collaborative_forms)
    collaborative = True

    @classmethod
    def build(cls, site: AttentionSite, spec: CollaborativeSpec) -> CollaborativeSelfAttention:
        mixing_init = spec.mixing_init or ("concatenate" if spec.rank % spec.heads == 0 else "ones")
        return cls(site.d_in, spec.heads, spec.rank, tucker_core_size=spec.tucker_core_size, mixing_init=mixing_init,
                   value_rank=spec.value_rank, **module_arguments(site)).attached(site)
