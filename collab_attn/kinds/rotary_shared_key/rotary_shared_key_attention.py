"""Thin keys that keep rotary positions (RoPE) exactly: one shared key per token of ``R`` complex pairs, each rotating
with its frequency band, and a query of its own per head, as a plain torch module.

Rotary models rotate each pair ``(i, i + d_h/2)`` of a head's query and key by ``p theta_i`` at position ``p``
(transformers' ``rotate_half`` layout); as one complex number per pair, the rotation is a multiplication by
``e^(j p theta_i)``. Here every head scores against the same key pairs ``k_r(y)`` (pair ``r`` rotating with band
``b_r``, ``pair_bands``), each with its own query pairs ``q_hr(x)``:

    logit_h(t, s) = scale * Re( sum_r  q_hr(x_t) e^(j p_t theta_(b_r))  conj( k_r(y_s) e^(j p_s theta_(b_r)) ) ).

(``collab_attn.models.methods.rotary_key_svd`` fills it from an SVD of each band's key forms: the thin keys of
``SharedKeyAttention`` made rotary.)

Layout (what a conversion writes): R pairs per layer, rank = 2R numbers.

- ``query``: ``nn.Linear(d, heads * 2R)``; head ``h``'s 2R outputs are ``[real parts of its R pairs ; imaginary
  parts]``. ``key``: ``nn.Linear(d, 2R)``, the same layout; both with biases where the source has them (a key bias
  rotates with the key: it does not cancel in the softmax).
- ``pair_bands`` (persistent buffer, (R,) int64): the band ``0 .. head_dim/2 - 1`` each pair rotates with.
- values: grouped like the source (``value``: d -> kv_heads * head_dim, head ``h`` reads group ``h // (heads /
  kv_heads)``), or shared (``value_rank`` D_v: ``value``: d -> D_v without bias, one value per token for every head,
  and ``value_up``: D_v -> kv_heads * head_dim without bias, which gives group ``g``'s value ``W_up,g v`` of the
  context each head took from the shared value, after attention); ``output``: heads * head_dim -> d.

Positions come from the caller as transformers computes them: ``position_embeddings = (cos, sin)``, each (batch,
seq, head_dim), band ``i`` at column ``i`` (and again at ``i + head_dim/2``), rope scaling already folded in. The
cache (``kv_cache`` hook, as in ``collab_attn.nn.attention``) receives the shared keys already rotated, (batch, 1,
seq, 2R), and the values, (batch, kv_heads, seq, head_dim) or shared (batch, 1, seq, D_v): ``2R + kv_heads
head_dim`` (or ``2R + D_v``) numbers per token and layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from collab_attn.nn.attention import AttentionArguments
from collab_attn.nn.rotary import SharedPairsAttention, attend_shared_pairs

if TYPE_CHECKING:
    from typing_extensions import Unpack


class RotarySharedKeyAttention(SharedPairsAttention):
    """Every head scores against one shared key of ``pairs`` rotary pairs with a query of its own (the module
    docstring has the computation and the layout).

    ``kv_heads`` (default ``num_heads``): value groups, as the source's key/value heads; ``value_rank``: one shared
    value of that width for every head (None: grouped values). ``pair_bands`` (default ``arange(pairs) % (head_dim /
    2)``). ``bias``: biases of the query, key and (grouped) value projections; ``output_bias`` (default ``bias``)
    that of the output projection. ``logit_scale``: default ``1 / sqrt(head_dim)``.

    ``forward``: every rotary kind's (``collab_attn.nn.rotary.RotaryAttention``), keys at
    ``key_position_embeddings`` where given.
    """

    takes_kv_dim = False  # reads keys and values at d_model's width

    def __init__(self, d_model: int, num_heads: int, pairs: int, *, kv_heads: int | None = None,
                 pair_bands: torch.Tensor | list[int] | None = None, value_rank: int | None = None,
                 **common: Unpack[AttentionArguments]):
        super().__init__(d_model, num_heads, pairs, kv_heads, **common)
        bias = self.projection_bias
        if value_rank is not None and (type(value_rank) is not int or value_rank <= 0):
            raise ValueError(f"value_rank must be a positive integer or None, got {value_rank!r}")
        self.value_rank = value_rank
        self.query = nn.Linear(d_model, num_heads * 2 * pairs, bias=bias)
        self.key = nn.Linear(d_model, 2 * pairs, bias=bias)
        grouped = self.kv_heads * self.head_dim
        if value_rank is None:
            self.value = nn.Linear(d_model, grouped, bias=bias)  # replaces BaseAttention's heads x head_dim one
            self.value_up = None
        else:
            self.value = nn.Linear(d_model, value_rank, bias=False)
            self.value_up = nn.Linear(value_rank, grouped, bias=False)
        self._register_pair_bands(pair_bands, pairs)

    def _attend(self, query_states, position_embeddings, keys, values, mask, causal, need_weights):
        shared_values = self.value_rank is not None
        queries = self._rotated(self._heads(self.query(query_states), self.num_heads), position_embeddings)
        context, weights = attend_shared_pairs(queries, keys, values, mask, self.scale, self._dropout(),
                                               need_weights, shared_values, causal)
        if shared_values:  # (B, T, H, D_v) -> each head's group value (B, T, H, head_dim)
            up = self.value_up.weight.view(self.kv_heads, self.head_dim, -1)
            up = up.repeat_interleave(self.num_heads // self.kv_heads, dim=0)  # (H, head_dim, D_v)
            context = torch.einsum("bthv,hdv->bthd", context, up.to(context.dtype))
        return context.flatten(2), weights
