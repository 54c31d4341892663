"""Thin keys as a plain torch module.

``SharedKeyAttention``: one key of width ``key_size`` per token shared by every head, each head's query projected
into that space, every head keeping its own value. Inputs and outputs as every module's
(``collab_attn.nn.attention``). The ``kv_cache`` hook gets the key (batch, 1, positions, key_size) and the values
(batch, heads, positions, head_dim): ``key_size + heads head_dim`` numbers per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from collab_attn.nn import triton_kernels
from collab_attn.nn.attention import (
    AttentionArguments,
    SharedKeyValueAttention,
    attend,
    positive_size,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack


class SharedKeyAttention(SharedKeyValueAttention):
    """Thin keys: every head scores against one shared key ``Y Wk`` of width ``key_size`` (no key bias: it would
    add one constant to a whole softmax row) with its own query ``X Wq_h + bq_h`` of the same width; each head
    keeps its value head. Parameters: ``query`` (d_model -> heads x key_size), ``key`` (kv_dim -> key_size),
    ``value`` (kv_dim -> heads x head_dim), ``output``. The logit scale stays ``1/sqrt(head_dim)``. The cache holds
    the shared key (B, 1, S, key_size) and the values (B, heads, S, head_dim)."""

    def __init__(self, d_model: int, num_heads: int, key_size: int, **common: Unpack[AttentionArguments]):
        super().__init__(d_model, num_heads, **common)
        bias = self.projection_bias
        self.key_size = positive_size("key_size", key_size)
        self.query = nn.Linear(d_model, num_heads * key_size, bias=bias)
        self.key = nn.Linear(self.kv_dim, key_size, bias=False)

    def _context(self, query_states, key_value_states, attention_mask, is_causal, need_weights, kv_cache):
        keys_from = query_states if key_value_states is None else key_value_states
        keys = self.key(keys_from)[:, None]  # (B, 1, S, key_size)
        values = self._heads(self.value(keys_from), self.num_heads)
        if kv_cache is not None:
            keys, values = kv_cache(keys, values)
        mask = self._mask(query_states, attention_mask, is_causal, keys.shape[2])
        queries = self._heads(self.query(query_states), self.num_heads)  # (B, H, T, key_size)
        if not need_weights and triton_kernels.takes_step(queries.shape[2], (queries, keys, values), mask,
                                                          self._dropout()):
            # a decoding step through the Triton kernels: one shared key, a value per head, (B, 1, H head_dim)
            context = triton_kernels.step(queries, keys[:, 0], values, mask, scale=self.scale)[:, None].flatten(2)
            return context, None
        return attend(queries, keys, values, mask, self.scale, self._dropout(), need_weights)

    def cache_width(self) -> int:
        return self.key_size + self.num_heads * self.head_dim
