"""Concatenated multi-head attention as a plain torch module.

Concatenated heads (Vaswani et al.): head ``h`` scores ``(X Wq_h + bq_h)(Y Wk_h + bk_h)^T / sqrt(d_head)``.

``MultiHeadAttention`` is the one concatenated-heads class: its query/key head size may be smaller than its value
head size (``query_key_head_dim``: SVD-truncated heads, small-key models trained from scratch) and it may carry a
content bias instead of query/key biases (``content_bias=True``: one vector per head, what a conversion turns the
query bias into). It runs ``scaled_dot_product_attention`` without weights and a plain softmax with them. Inputs and
outputs as every module's (``collab_attn.nn.attention``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from collab_attn.nn.attention import AttentionArguments, BaseAttention, attend, logit_bias

if TYPE_CHECKING:
    from typing_extensions import Unpack


class MultiHeadAttention(BaseAttention):
    """Standard multi-head attention with concatenated heads.

    With the defaults its parameter count is ``4 d_model^2 (+ 4 d_model biases)`` whatever ``num_heads`` is, since
    each head is ``d_model / num_heads`` wide. ``query_key_head_dim`` makes each head's queries and keys narrower
    than its values (``head_dim``); the logits are scaled by ``logit_scale``, by default
    ``1 / sqrt(query_key_head_dim)`` (Vaswani et al.'s ``1 / sqrt(d_k)``). ``content_bias=True`` replaces the
    query/key biases by one content bias vector per head (what a conversion turns the query bias into; the key bias
    never changes a softmax row); ``query_key_bias`` (default: ``bias and not content_bias``) sets the query/key
    biases alone.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        query_key_head_dim: int | None = None,
        query_key_bias: bool | None = None,
        content_bias: bool = False,
        **common: Unpack[AttentionArguments],
    ):
        super().__init__(d_model, num_heads, **common)
        bias = self.projection_bias
        query_key_head_dim = self.head_dim if query_key_head_dim is None else query_key_head_dim
        if not isinstance(query_key_head_dim, int) or query_key_head_dim <= 0:
            raise ValueError(f"query_key_head_dim must be a positive integer, got {query_key_head_dim!r}")
        query_key_bias = (bias and not content_bias) if query_key_bias is None else query_key_bias
        self.query_key_head_dim = query_key_head_dim
        if common.get("logit_scale") is None:
            self.scale = 1.0 / math.sqrt(query_key_head_dim)
        self.query = nn.Linear(d_model, num_heads * query_key_head_dim, bias=query_key_bias)
        self.key = nn.Linear(self.kv_dim, num_heads * query_key_head_dim, bias=query_key_bias)
        self.content_bias = nn.Linear(self.kv_dim, num_heads, bias=False) if content_bias else None

    def _context(self, query_states, key_value_states, attention_mask, is_causal, need_weights, kv_cache):
        keys, values, mask, content = self._keys_values_mask(
            query_states, key_value_states, attention_mask, is_causal, kv_cache
        )
        queries = self._key_heads(self.query(query_states))
        bias = logit_bias(mask, content)
        return attend(queries, keys, values, bias, self.scale, self._dropout(), need_weights)

    def _key_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, H * k) -> (B, H, S, k)."""
        return x.unflatten(-1, (self.num_heads, self.query_key_head_dim)).transpose(1, 2)

    def _pack(self, keys: torch.Tensor, content: torch.Tensor | None) -> torch.Tensor:
        """What a cache stores per key: each head's key, and its content logit as one more column, (B, H, S, k[+1])."""
        return keys if content is None else torch.cat([keys, content.transpose(1, 2)[..., None]], dim=-1)

    def _unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.content_bias is None:
            return packed, None
        return packed[..., :-1], packed[..., -1].transpose(1, 2)

    def cache_width(self) -> int:
        """Each head's key and value, and its content logit where it has a content bias."""
        heads = self.num_heads
        return heads * (self.query_key_head_dim + self.head_dim) + (heads if self.content_bias is not None else 0)
