"""Grouped-query attention as a plain torch module.

- ``GroupedQueryAttention`` (GQA, Ainslie et al., 2023): ``kv_heads`` key/value heads, each shared by a group of
  ``num_heads / kv_heads`` consecutive query heads (query head ``h`` reads key/value head ``h // group``).
- ``MultiQueryAttention`` (MQA, Shazeer, 2019): GQA with one key/value head.

Inputs and outputs as every module's (``collab_attn.nn.attention``). The ``kv_cache`` hook gets keys and values
(batch, kv_heads, positions, head_dim) each: ``2 kv_heads head_dim`` numbers per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from collab_attn.nn.attention import (
    AttentionArguments,
    SharedKeyValueAttention,
    grouped_attend,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack


class GroupedQueryAttention(SharedKeyValueAttention):
    """Grouped-query attention: ``num_heads`` query heads, ``kv_heads`` key/value heads of ``head_dim`` each.

    ``kv_heads = num_heads`` is ``MultiHeadAttention`` (same parameter names and layout); ``kv_heads = 1`` is
    multi-query attention. ``bias`` gives the query, key, value and output projections biases. The cache holds
    keys and values (B, kv_heads, S, head_dim)."""

    def __init__(self, d_model: int, num_heads: int, kv_heads: int, **common: Unpack[AttentionArguments]):
        super().__init__(d_model, num_heads, **common)
        bias = self.projection_bias
        self.kv_heads = self._kv_heads(kv_heads)
        self.query = nn.Linear(d_model, num_heads * self.head_dim, bias=bias)
        self.key = nn.Linear(self.kv_dim, kv_heads * self.head_dim, bias=bias)
        self.value = nn.Linear(self.kv_dim, kv_heads * self.head_dim, bias=bias)  # narrower than BaseAttention's

    def _context(self, query_states, key_value_states, attention_mask, is_causal, need_weights, kv_cache):
        keys_from = query_states if key_value_states is None else key_value_states
        keys = self._heads(self.key(keys_from), self.kv_heads)  # (B, G, S, head_dim)
        values = self._heads(self.value(keys_from), self.kv_heads)
        if kv_cache is not None:
            keys, values = kv_cache(keys, values)
        mask, causal = self._mask_or_causal(query_states, attention_mask, is_causal, keys.shape[2])
        queries = self._heads(self.query(query_states), self.num_heads)
        context, weights = grouped_attend(queries, keys, values, mask, self.scale, self._dropout(), need_weights,
                                          causal)
        return context.flatten(2), weights

    def cache_width(self) -> int:
        return 2 * self.kv_heads * self.head_dim


class MultiQueryAttention(GroupedQueryAttention):
    """Multi-query attention: every query head shares one key head and one value head (``kv_heads = 1``)."""

    def __init__(self, d_model: int, num_heads: int, **common: Unpack[AttentionArguments]):
        super().__init__(d_model, num_heads, 1, **common)
