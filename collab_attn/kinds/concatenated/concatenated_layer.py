"""The concatenated kind (``svd``: heads of any query/key head size): its converted class."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from collab_attn.kinds.concatenated.concatenated_attention import MultiHeadAttention
from collab_attn.kinds.concatenated.concatenated_forms import concatenated_forms
from collab_attn.kinds.converted import ConvertedSelfAttention, LayerSpec, ValueCutSpec, module_arguments

if TYPE_CHECKING:
    from collab_attn.models.families import AttentionSite


class ConcatenatedSelfAttention(ConvertedSelfAttention, MultiHeadAttention, kind="concatenated"):
    """Concatenated heads of any query/key head size (SVD-truncated heads; ``rank`` = heads x query/key head size)
    and, with a ``value_rank``, narrower value heads, in a transformers model. The query bias is folded into the
    content bias. The logit scale stays the original model's ``logit_scale``."""

    Spec = ValueCutSpec
    query_key_reader = staticmethod(concatenated_forms)
    content_bias_kind: ClassVar[bool] = True  # the query bias became the content bias (else: query/key biases kept)

    @classmethod
    def build(cls, site: AttentionSite, spec: LayerSpec) -> ConcatenatedSelfAttention:
        common = module_arguments(site)
        if spec.values_cut():  # narrow value heads
            common["head_dim"] = spec.value_rank // spec.heads
        return cls(site.d_in, spec.heads, query_key_head_dim=spec.rank // spec.heads,
                   query_key_bias=site.bias and not cls.content_bias_kind,
                   content_bias=site.bias and cls.content_bias_kind, **common).attached(site)
