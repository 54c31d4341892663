"""Grouped-query attention with rotary positions (Llama's, Qwen2's and Mistral's attention), as a plain torch module.

``num_heads`` query heads share ``kv_heads`` key/value heads (query head ``h`` reads group ``h // (num_heads /
kv_heads)``), and every query and key head is rotated as transformers rotates it: the pair of dimensions ``(i, i +
head_dim/2)`` by ``p theta_i`` at position ``p`` (``rotate_half`` layout), from the ``position_embeddings = (cos,
sin)`` the caller computes, each (batch, seq, head_dim). Head ``h`` thus scores

    logit_h(t, s) = scale * sum_i Re( (a_hi^T x_t) conj(b_gi^T y_s) e^(j (p_t - p_s) theta_i) ),  g = h // (H / G),

with ``a_hi``, ``b_gi`` the complex query and key vectors of band ``i`` (its two rows). The module is the source
model's attention with fewer (or merged) key/value heads: ``collab_attn.models.methods.kv_groups`` fills it.

The ``kv_cache`` hook receives the keys already rotated and the values, (batch, kv_heads, seq, head_dim) each:
``2 kv_heads head_dim`` numbers per token and layer, as transformers' own cache of a grouped model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from collab_attn.kinds.gqa.gqa_attention import GroupedQueryAttention
from collab_attn.nn.attention import AttentionArguments, grouped_attend
from collab_attn.nn.rotary import RotaryAttention, check_rotary_head_dim, given_positions, rotate_pairs

if TYPE_CHECKING:
    from typing_extensions import Unpack


class RotaryGroupedQueryAttention(RotaryAttention, GroupedQueryAttention):
    """``GroupedQueryAttention`` whose queries and keys rotate with their positions (RoPE).

    ``bias``: biases of the query, key and value projections; ``output_bias`` (default: ``bias``) that of the output
    projection (Qwen2 has q/k/v biases and no o_proj bias). ``logit_scale``: default ``1 / sqrt(head_dim)``.

    ``forward``: every rotary kind's (``collab_attn.nn.rotary.RotaryAttention``); the keys sit at the queries'
    positions (no ``key_position_embeddings``), ``key_value_states`` as long as the queries."""

    takes_key_positions = False

    def __init__(self, d_model: int, num_heads: int, kv_heads: int, **common: Unpack[AttentionArguments]):
        super().__init__(d_model, num_heads, kv_heads, **common)
        check_rotary_head_dim(self.head_dim)

    def _rotated(self, heads: torch.Tensor, position_embeddings) -> torch.Tensor:
        """Heads (B, heads, S, head_dim) rotated at the positions of ``position_embeddings`` = (cos, sin), each
        (B, S, head_dim) with band ``i`` at columns ``i`` and ``i + head_dim/2``."""
        cos, sin = given_positions(self, position_embeddings)
        if cos.shape[-1] != self.head_dim or sin.shape[-1] != self.head_dim or cos.shape[-2] != heads.shape[-2]:
            raise ValueError(
                f"position_embeddings must be (cos, sin) of shape (batch, {heads.shape[-2]} positions, head_dim "
                f"{self.head_dim}), got {tuple(cos.shape)} and {tuple(sin.shape)}"
            )
        half = self.head_dim // 2
        cos, sin = cos[..., None, :, :half].to(heads.dtype), sin[..., None, :, :half].to(heads.dtype)
        return rotate_pairs(heads, cos, sin)

    def _keys_values(self, keys_from: torch.Tensor, key_positions) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self._rotated(self._heads(self.key(keys_from), self.kv_heads), key_positions)  # as cached
        return keys, self._heads(self.value(keys_from), self.kv_heads)

    def _attend(self, query_states, position_embeddings, keys, values, mask, causal, need_weights):
        queries = self._rotated(self._heads(self.query(query_states), self.num_heads), position_embeddings)
        context, weights = grouped_attend(queries, keys, values, mask, self.scale, self._dropout(), need_weights,
                                          causal)
        return context.flatten(2), weights
