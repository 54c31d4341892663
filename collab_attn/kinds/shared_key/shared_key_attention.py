"""Thin keys as a plain torch module.

``SharedKeyAttention``: one key of width ``rank`` per token shared by every head, each head's query projected
into that space, every head keeping its own value. Inputs and outputs as every module's
(``collab_attn.nn.attention``). The ``kv_cache`` hook gets the key (batch, 1, positions, rank) and the values
(batch, heads, positions, head_dim): ``rank + heads head_dim`` numbers per token. ``key_size``, the old name of
``rank`` (keyword and attribute), still works with a ``FutureWarning`` (``collab_attn.deprecation``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from collab_attn.deprecation import renamed_keyword, warn_renamed
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
    """Thin keys: every head scores against one shared key ``Y Wk`` of width ``rank`` (no key bias: it would
    add one constant to a whole softmax row) with its own query ``X Wq_h + bq_h`` of the same width; each head
    keeps its value head. Parameters: ``query`` (d_model -> heads x rank), ``key`` (kv_dim -> rank),
    ``value`` (kv_dim -> heads x head_dim), ``output``. The logit scale stays ``1/sqrt(head_dim)``. The cache holds
    the shared key (B, 1, S, rank) and the values (B, heads, S, head_dim)."""

    def __init__(self, d_model: int, num_heads: int, rank: int | None = None, *, key_size: int | None = None,
                 **common: Unpack[AttentionArguments]):
        rank = renamed_keyword("key_size", "rank", key_size, rank, "SharedKeyAttention")
        if rank is None:
            raise TypeError("SharedKeyAttention needs rank, the shared key's width")
        super().__init__(d_model, num_heads, **common)
        bias = self.projection_bias
        self.rank = positive_size("rank", rank)
        self.query = nn.Linear(d_model, num_heads * rank, bias=bias)
        self.key = nn.Linear(self.kv_dim, rank, bias=False)

    def _context(self, query_states, key_value_states, attention_mask, is_causal, need_weights, kv_cache):
        keys_from = query_states if key_value_states is None else key_value_states
        keys = self.key(keys_from)[:, None]  # (B, 1, S, rank)
        values = self._heads(self.value(keys_from), self.num_heads)
        if kv_cache is not None:
            keys, values = kv_cache(keys, values)
        mask = self._mask(query_states, attention_mask, is_causal, keys.shape[2])
        queries = self._heads(self.query(query_states), self.num_heads)  # (B, H, T, rank)
        if not need_weights and triton_kernels.takes_step(queries.shape[2], (queries, keys, values), mask,
                                                          self._dropout()):
            # a decoding step through the Triton kernels: one shared key, a value per head, (B, 1, H head_dim)
            context = triton_kernels.step(queries, keys[:, 0], values, mask, scale=self.scale)[:, None].flatten(2)
            return context, None
        return attend(queries, keys, values, mask, self.scale, self._dropout(), need_weights)

    @property
    def key_size(self) -> int:
        """Deprecated: ``rank``."""
        warn_renamed("key_size", "rank", "SharedKeyAttention attribute")
        return self.rank

    def cache_width(self) -> int:
        return self.rank + self.num_heads * self.head_dim
