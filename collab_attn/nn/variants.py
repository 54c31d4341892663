"""The attention variants that collaborative heads are raced against, as plain torch modules.

- ``GroupedQueryAttention`` (GQA, Ainslie et al., 2023): ``kv_heads`` key/value heads, each shared by a group of
  ``num_heads / kv_heads`` consecutive query heads (query head ``h`` reads key/value head ``h // group``).
- ``MultiQueryAttention`` (MQA, Shazeer, 2019): GQA with one key/value head.
- ``LatentAttention``: multi-head latent attention (DeepSeek-V2) without its rotary part. Keys and values are
  per-head up-projections ``W_uk``, ``W_uv`` of one shared latent ``c = Y W_dkv + b`` of width ``latent_size``.
- ``SharedKeyAttention`` ("thin keys"): one key of width ``key_size`` per token shared by every head, each head's
  query projected into that space, every head keeping its own value.

All take the inputs of ``MultiHeadAttention`` (``collab_attn.nn.attention``) and return what it returns:
``forward(query_states, key_value_states=None, attention_mask=None, is_causal=False, need_weights=False,
kv_cache=None) -> (output, weights or None)``, weights (batch, heads, tgt, src). Masks go through ``additive_mask``;
a causal mask is aligned to the last query when the cache holds earlier positions.

What each hands the ``kv_cache`` hook ``(packed_keys, values) -> (all_packed_keys, all_values)``, per layer:

- GQA / MQA: keys and values (batch, kv_heads, positions, head_dim) each: ``2 kv_heads head_dim`` numbers per token.
- MLA: the latent as the keys, (batch, 1, positions, latent_size), and an empty tensor (batch, 1, positions, 0) as the
  values (it only keeps the cache's position count in step): ``latent_size`` numbers per token.
- Shared key: the key (batch, 1, positions, key_size) and the values (batch, heads, positions, head_dim):
  ``key_size + heads head_dim`` numbers per token.

``cache_numbers_per_token(module)`` gives those numbers (for the concatenated and collaborative modules too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from collab_attn.nn import triton_kernels
from collab_attn.nn.attention import (
    AttentionArguments,
    _Attention,
    additive_mask,
    attend,
    causal_prompt,
    grouped_attend,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack


def _positive_size(name: str, size) -> int:
    """The size argument ``name`` checked: a positive integer."""
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"{name} must be a positive integer, got {size!r}")
    return size


class _SharedKeyValueAttention(_Attention):
    """What the variants share beyond ``_Attention``: splitting heads and the mask over every key attended to."""

    def _kv_heads(self, kv_heads: int | None) -> int:
        """``kv_heads`` checked: a positive divisor of the query heads (None: one per query head)."""
        kv_heads = self.num_heads if kv_heads is None else kv_heads
        if type(kv_heads) is not int or kv_heads <= 0 or self.num_heads % kv_heads:
            raise ValueError(f"kv_heads must be a positive divisor of num_heads ({self.num_heads}), got {kv_heads!r}")
        return kv_heads

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """(B, S, heads * width) -> (B, heads, S, width)."""
        return x.unflatten(-1, (heads, -1)).transpose(1, 2)

    def _mask(self, query_states, attention_mask, is_causal, src_len) -> torch.Tensor | None:
        return additive_mask(
            attention_mask, is_causal, query_states.shape[1], src_len, query_states.dtype, query_states.device
        )

    def _mask_or_causal(self, query_states, attention_mask, is_causal, src_len) -> tuple[torch.Tensor | None, bool]:
        """``(mask, False)``, or ``(None, True)`` for a causal prompt (``causal_prompt``), whose causal mask
        ``grouped_attend(..., causal=True)`` applies inside the fused kernel."""
        if causal_prompt(attention_mask, is_causal, query_states.shape[1], src_len):
            return None, True
        return self._mask(query_states, attention_mask, is_causal, src_len), False


class GroupedQueryAttention(_SharedKeyValueAttention):
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
        self.value = nn.Linear(self.kv_dim, kv_heads * self.head_dim, bias=bias)  # narrower than _Attention's

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


class LatentAttention(_SharedKeyValueAttention):
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
        self.latent_size = _positive_size("latent_size", latent_size)
        self.absorb: bool | None = None
        width = num_heads * self.head_dim
        self.query = nn.Linear(d_model, width, bias=bias)
        self.latent = nn.Linear(self.kv_dim, latent_size, bias=bias)
        self.key = nn.Linear(latent_size, width, bias=False)
        self.value = nn.Linear(latent_size, width, bias=False)  # replaces _Attention's kv_dim -> width projection

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


class SharedKeyAttention(_SharedKeyValueAttention):
    """Thin keys: every head scores against one shared key ``Y Wk`` of width ``key_size`` (no key bias: it would
    add one constant to a whole softmax row) with its own query ``X Wq_h + bq_h`` of the same width; each head
    keeps its value head. Parameters: ``query`` (d_model -> heads x key_size), ``key`` (kv_dim -> key_size),
    ``value`` (kv_dim -> heads x head_dim), ``output``. The logit scale stays ``1/sqrt(head_dim)``. The cache holds
    the shared key (B, 1, S, key_size) and the values (B, heads, S, head_dim)."""

    def __init__(self, d_model: int, num_heads: int, key_size: int, **common: Unpack[AttentionArguments]):
        super().__init__(d_model, num_heads, **common)
        bias = self.projection_bias
        self.key_size = _positive_size("key_size", key_size)
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


def cache_numbers_per_token(module: nn.Module) -> int:
    """Numbers the module hands its ``kv_cache`` hook per token (packed keys and values together), i.e. what a
    key/value cache holds per token for this layer (each module's ``cache_width``): GQA ``2 kv_heads head_dim``, MQA
    ``2 head_dim``, MLA ``latent_size``, shared key ``key_size + H head_dim``; concatenated heads ``H
    (query_key_head_dim + head_dim)`` (``+ H`` with content bias); collaborative heads ``rank + H head_dim`` (``+ H``
    with content bias), ``rank + value_rank`` (``+ H``) when they share the values too."""
    if not isinstance(module, _Attention):
        raise TypeError(f"no cache layout known for {type(module).__name__}: not an attention module of collab_attn.nn")
    return module.cache_width()
