"""The kept-heads kind (``prune``): some of the original heads, as concatenated heads with their
query/key biases; read back as concatenated heads are."""

from __future__ import annotations

from collab_attn.kinds.concatenated import ConcatenatedSelfAttention
from collab_attn.kinds.converted import LayerSpec


class KeptHeadsSelfAttention(ConcatenatedSelfAttention, kind="kept-heads"):
    """Some of the original heads (pruning), with their query/key biases, values and output columns."""

    Spec = LayerSpec
    content_bias_kind = False
