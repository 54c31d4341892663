"""Multi-head latent attention (DeepSeek-V2) without its rotary part, as a plain torch module.

``LatentAttention``: keys and values are per-head up-projections ``W_uk``, ``W_uv`` of one shared latent ``c = Y W_dkv
+ b`` of width ``latent_size``. Inputs and outputs as every module's (``collab_attn.nn.attention``). The ``kv_cache``
hook gets the latent as the keys, (batch, 1, positions, latent_size), and an empty tensor (batch, 1, positions, 0) as
the values (it only keeps the cache's position count in step): ``latent_size`` numbers per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from collab_attn.nn import triton_kernels
from collab_attn.nn.attention import (
    AttentionArguments,
    SharedKeyValueAttention,
    grouped_attend,
    positive_size,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack


class LatentAttention(SharedKeyValueAttention):
    """Multi-head latent attention without rotary positions (DeepSeek-V2's MLA, no RoPE part, no latent norm).

    Parameters: ``query`` (d_model -> heads x head_dim), ``latent`` = ``W_dkv`` (kv_dim -> ``latent_size``), ``key``
    = ``W_uk`` and ``value`` = ``W_uv`` (latent_size -> heads x head_dim each), ``output``. ``bias`` gives the query,
    latent and output projections biases; the up-projections have none: a key bias adds one constant to a whole
    softmax row, and a value bias adds a constant to the context (the weights sum to one), which the output bias
    covers.

    Two exact forms of one function:
    - plain: keys ``c W_uk_h^T`` and values ``c W_uv_h^T`` per head, then ordinary multi-head attention;
    - absorbed: ``W_uk`` goes into the query, ``q_h W_uk_h`` (latent_size wide), which scores against the latent
      itself, and every head attends over the latent (one key/value head, as in MQA); ``W_uv_h`` is applied to
      each head's weighted latent afterwards, before the output projection. No per-head key or value is formed.
    ``absorb`` (a plain attribute, not saved with the weights) picks the form: ``None`` (default) absorbs when a
    ``kv_cache`` is given (decoding) and runs the plain form otherwise and for a causal prompt into an empty cache
    (a prefill: per-head scores are ``head_dim`` wide, absorbed ones ``latent_size``, as DeepSeek-V2 serves it),
    ``True`` / ``False`` force one.

    The cache holds the latent alone: packed keys (B, 1, S, latent_size) and empty values (B, 1, S, 0)."""

    def __init__(self, d_model: int, num_heads: int, latent_size: int, **common: Unpack[AttentionArguments]):
        super().__init__(d_model, num_heads, **common)
        bias = self.projection_bias
        self.latent_size = positive_size("latent_size", latent_size)
        self.absorb: bool | None = None
        width = num_heads * self.head_dim
        self.query = nn.Linear(d_model, width, bias=bias)
        self.latent = nn.Linear(self.kv_dim, latent_size, bias=bias)
        self.key = nn.Linear(latent_size, width, bias=False)
        self.value = nn.Linear(latent_size, width, bias=False)  # replaces BaseAttention's kv_dim -> width projection

    def _context(self, query_states, key_value_states, attention_mask, is_causal, need_weights, kv_cache):
        keys_from = query_states if key_value_states is None else key_value_states
        latent = self.latent(keys_from)[:, None]  # (B, 1, S, latent_size)
        if kv_cache is not None:
            latent, _ = kv_cache(latent, latent.new_empty(*latent.shape[:3], 0))
        mask, causal = self._mask_or_causal(query_states, attention_mask, is_causal, latent.shape[2])
        queries = self._heads(self.query(query_states), self.num_heads)  # (B, H, T, head_dim)
        # by default absorbed when decoding from a cache; a prompt scores per head (head_dim, not latent_size, wide)
        absorb = (kv_cache is not None and not causal) if self.absorb is None else self.absorb
        if absorb:
            w_key, w_value = self._up_projections()
            queries = torch.einsum("bhtd,hdc->bhtc", queries, w_key)  # (B, H, T, latent_size)
            if not need_weights and triton_kernels.takes_step(queries.shape[2], (queries, latent), mask,
                                                              self._dropout()):
                # a decoding step through the Triton kernels: the latent as the shared key and value
                context = triton_kernels.step(queries, latent[:, 0], latent[:, 0], mask, scale=self.scale,
                                              shared_values=True)[:, None]
                weights = None
            else:
                context, weights = grouped_attend(
                    queries, latent, latent, mask, self.scale, self._dropout(), need_weights, causal
                )  # context (B, T, H, latent_size)
            context = torch.einsum("bthc,hdc->bthd", context, w_value)
        else:
            keys = self._heads(self.key(latent[:, 0]), self.num_heads)
            values = self._heads(self.value(latent[:, 0]), self.num_heads)
            context, weights = grouped_attend(queries, keys, values, mask, self.scale, self._dropout(), need_weights,
                                              causal)
        return context.flatten(2), weights

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_uk`` and ``W_uv`` per head, (heads, head_dim, latent_size) each."""
        shape = (self.num_heads, self.head_dim, self.latent_size)
        return self.key.weight.view(shape), self.value.weight.view(shape)

    def cache_width(self) -> int:
        return self.latent_size
