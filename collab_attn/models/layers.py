"""The attention modules behind the call contract of a transformers 5.x self-attention module.

A converted layer is collaborative (``CollaborativeSelfAttention``: ``cp``, ``tucker``), concatenated heads
(``ConcatenatedSelfAttention``: ``svd``, ``prune``) or one of the variants (``SharedKeySelfAttention``: ``key-svd``;
``LatentSelfAttention``: ``kv-svd`` and, with ``GroupedSelfAttention``, models trained from scratch). All take
``(hidden_states, attention_mask, **kwargs)`` and return ``(output, attention_weights)``, with weights when
``output_attentions=True`` is passed down or when the model
records attention maps with its output hooks (transformers 5.x: ``output_attentions`` as a call argument or in the
config), as an eager transformers attention module does.
``output_dropout`` adds GPT-2's dropout after the output projection, and ``residual_norm_eps`` ALBERT's dropout,
residual connection and LayerNorm, both inside those families' attention modules.

Key/value cache (decoders): a ``DynamicCache`` (or the self-attention half of an ``EncoderDecoderCache``) holds, per
layer and token, what ``_pack`` makes of the new keys: for collaborative heads one shared key of width D~ plus one
content-bias logit per head, ``(batch, 1, tokens, D~ + heads)``, and the per-head values ``(batch, heads, tokens,
head_dim)``; for concatenated heads each head's key (and content logit). New tokens attend to the cache and
themselves, with the causal mask aligned to the last query. A full ``StaticCache`` holds the same layout in buffers
of ``max_cache_len`` positions allocated on first use (fixed shapes: ``torch.compile(fullgraph=True)`` traces a
decoding step once). Every keyword a transformers 5.x model passes down is either honoured or refused: nothing is
silently ignored.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache, StaticLayer
from transformers.utils.output_capturing import _active_collector  # what the output hooks collect into

from collab_attn.nn.attention import CollaborativeAttention, MultiHeadAttention
from collab_attn.nn.variants import GroupedQueryAttention, LatentAttention, SharedKeyAttention

# Every name under which transformers 5.x hands a self-attention module its key/value cache: models pass it as
# ``past_key_values`` up to 5.23 and as ``cache`` from 5.24 on; ``past_key_value`` and ``layer_past`` are older
# spellings that callers may still use. The same object under two names is one cache (``_pop_caches``).
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past")
# Keywords that would change what attention computes and that these layers do not implement: packed sequences
# (flash-attention varlen), head masks, sliding windows, attention sinks, rotary position embeddings. Given, they
# raise. Others pass through untouched because attention has nothing to do with them (the model already acted on
# use_cache, position_ids, cache_position; num_items_in_batch is for the loss).
REFUSED_KEYWORDS = (
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "head_mask", "encoder_attention_mask",
    "sliding_window", "s_aux", "sinks", "position_embeddings",
)


def attention_maps_recorded() -> bool:
    """Whether the running model forward records attention maps: transformers 5.x models no longer pass
    ``output_attentions`` down to their attention modules; they hook the modules' second output and collect it
    while ``output_attentions`` (argument or config) is on."""
    collected = _active_collector.get()
    return collected is not None and "attentions" in collected


def _pop_caches(kwargs: dict) -> dict:
    """Pop every cache keyword from ``kwargs``; return ``{name: cache}`` with one entry per distinct cache object
    (under the first of ``CACHE_KEYWORDS`` that holds it): the same cache under two names is one cache."""
    caches = {}
    for name in CACHE_KEYWORDS:
        cache = kwargs.pop(name, None)
        if cache is not None and not any(cache is seen for seen in caches.values()):
            caches[name] = cache
    return caches


class ConvertedSelfAttention(nn.Module):
    """What both converted layers add to their attention module: the transformers call contract."""

    def _init_contract(
        self,
        d_model: int,
        is_causal: bool,
        layer_idx: int | None,
        output_dropout: float | None,
        residual_norm_eps: float | None,
    ):
        self.is_causal = is_causal
        self.layer_idx = layer_idx
        self.output_dropout = None if output_dropout is None else nn.Dropout(output_dropout)
        self.LayerNorm = None if residual_norm_eps is None else nn.LayerNorm(d_model, eps=residual_norm_eps)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, **kwargs):
        if encoder_hidden_states is not None:
            raise NotImplementedError(
                f"{type(self).__name__} converts self-attention only; cross-attention (encoder_hidden_states) is "
                "not supported"
            )
        caches = _pop_caches(kwargs)
        need_weights = bool(kwargs.pop("output_attentions", False)) or attention_maps_recorded()
        refused = sorted(k for k in REFUSED_KEYWORDS if kwargs.get(k) is not None)
        if refused or len(caches) > 1:
            raise TypeError(
                f"{type(self).__name__} cannot honour "
                + (f"the keyword(s) {refused}" if refused else f"two caches at once ({' and '.join(caches)} are "
                   "different objects; a model whose forward takes past_key_values, as before transformers 5.24, "
                   "makes its own cache and passes an unknown cache= argument down beside it)")
                + "; it takes hidden_states, attention_mask, one key/value cache and output_attentions"
            )
        kv_cache = None
        if caches:
            kv_cache, static = self._cache_update(*caches.values())
            if static is not None and attention_mask is None:
                attention_mask = _static_causal_mask(static, hidden_states.shape[1], hidden_states.device)
        output, weights = super().forward(
            hidden_states,
            attention_mask=attention_mask,
            is_causal=self.is_causal and attention_mask is None,
            need_weights=need_weights,
            kv_cache=kv_cache,
        )
        if self.output_dropout is not None:
            output = self.output_dropout(output)
        if self.LayerNorm is not None:
            output = self.LayerNorm(hidden_states + output)
        return output, weights

    def _cache_update(self, cache):
        """The ``kv_cache`` hook of the attention module (append this call's keys and values to ``cache``), and the
        cache's ``StaticLayer`` for this layer when the cache is static (else None).

        A dynamic layer grows with the keys it is given. A static layer (``StaticCache``, ``generate(...,
        cache_implementation="static")``) preallocates ``max_cache_len`` positions; transformers would shape its
        values like its keys (one head count for both), so this layer allocates them on first use with their own
        shapes (``_allocate_static``): collaborative heads keep one packed shared key per position and per-head
        values, narrow concatenated heads keys narrower than their values. Sliding-window, quantized and other
        layer kinds are refused."""
        if isinstance(cache, EncoderDecoderCache):
            cache = cache.self_attention_cache
        if self.layer_idx is None:
            raise ValueError(f"{type(self).__name__} was built without a layer_idx and cannot use a cache")
        layers = getattr(cache, "layers", [])
        layer = layers[self.layer_idx] if self.layer_idx < len(layers) else None
        dynamic = isinstance(cache, DynamicCache) and (
            type(layer) is DynamicLayer if layer is not None else cache.layer_class_to_replicate is DynamicLayer
        )
        if dynamic:
            return (lambda keys, values: cache.update(keys, values, self.layer_idx)), None
        if type(layer) is StaticLayer:
            def update(keys, values):
                if not layer.is_initialized:
                    _allocate_static(layer, keys, values)
                return cache.update(keys, values, self.layer_idx)

            return update, layer
        raise NotImplementedError(
            f"a {type(cache).__name__} ({type(layer).__name__ if layer is not None else 'no layer'}) cannot hold "
            "collaborative keys: sliding-window and quantized cache layers keep heads x head_dim per token. Use "
            "a DynamicCache (the default) or a full static cache (generate(..., cache_implementation='static'))"
        )


def _allocate_static(layer: StaticLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Let transformers initialize ``layer`` for ``keys`` (its dtype, device and bookkeeping, which differ between
    releases), then give the values their own buffer, (batch, heads, max_cache_len, head_dim): transformers takes
    the values' head count from the keys, which a shared key (one per position) does not have."""
    layer.lazy_initialization(keys, values)
    layer.values = values.new_zeros(values.shape[0], values.shape[1], layer.max_cache_len, values.shape[-1])
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(layer.values)  # a fixed address: compiled steps and CUDA graphs keep it


def _static_causal_mask(layer: StaticLayer, new_tokens: int, device: torch.device) -> torch.Tensor:
    """(1, 1, new, max_cache_len) booleans for ``new_tokens`` queries written after the ``cumulative_length``
    positions a static layer holds: query i sees the keys up to its own position, never the unwritten ones. Used
    when the model passes no mask (transformers skips it where sdpa's ``is_causal`` would do)."""
    filled = layer.cumulative_length.to(device).reshape(()) if layer.is_initialized else 0
    positions = torch.arange(layer.max_cache_len, device=device)
    last_seen = filled + torch.arange(new_tokens, device=device)
    return (positions[None, :] <= last_seen[:, None])[None, None]


class CollaborativeSelfAttention(ConvertedSelfAttention, CollaborativeAttention):
    """Collaborative heads (shared query/key projections of width ``rank``, per-head mixing; with ``value_rank``, one
    shared value per token too) in a transformers model."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rank: int,
        *,
        head_dim: int,
        dropout: float,
        bias: bool,
        output_projection: bool,
        tucker_core_size: int | None = None,
        mixing_init: str | None = None,
        logit_scale: float | None = None,
        value_rank: int | None = None,
        is_causal: bool = False,
        layer_idx: int | None = None,
        output_dropout: float | None = None,
        residual_norm_eps: float | None = None,
    ):
        CollaborativeAttention.__init__(
            self, d_model, num_heads, rank, head_dim=head_dim, dropout=dropout, bias=bias,
            output_projection=output_projection, tucker_core_size=tucker_core_size, logit_scale=logit_scale,
            mixing_init=mixing_init or ("concatenate" if rank % num_heads == 0 else "ones"), value_rank=value_rank,
        )
        self._init_contract(d_model, is_causal, layer_idx, output_dropout, residual_norm_eps)


class ConcatenatedSelfAttention(ConvertedSelfAttention, MultiHeadAttention):
    """Concatenated heads of any query/key head size (SVD-truncated heads) and any head count (pruned heads) in a
    transformers model. The logit scale stays the original model's ``logit_scale``."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        query_key_head_dim: int,
        *,
        head_dim: int,
        dropout: float,
        bias: bool,
        query_key_bias: bool,
        content_bias: bool,
        logit_scale: float,
        output_projection: bool,
        is_causal: bool = False,
        layer_idx: int | None = None,
        output_dropout: float | None = None,
        residual_norm_eps: float | None = None,
    ):
        MultiHeadAttention.__init__(
            self, d_model, num_heads, head_dim=head_dim, query_key_head_dim=query_key_head_dim, dropout=dropout,
            bias=bias, query_key_bias=query_key_bias, content_bias=content_bias, logit_scale=logit_scale,
            output_projection=output_projection,
        )
        self._init_contract(d_model, is_causal, layer_idx, output_dropout, residual_norm_eps)


class _VariantSelfAttention(ConvertedSelfAttention):
    """A variant of ``collab_attn.nn.variants`` (grouped-query, latent or shared-key heads) in a transformers model:
    the variant's module built with ``size`` (its kv heads, latent width or key width), the original model's logit
    scale, the call contract."""

    def __init__(self, d_model: int, num_heads: int, size: int, *, head_dim: int, dropout: float, bias: bool,
                 output_projection: bool, is_causal: bool = False, layer_idx: int | None = None,
                 output_dropout: float | None = None, residual_norm_eps: float | None = None,
                 logit_scale: float | None = None):
        variant = next(base for base in type(self).__mro__
                       if base in (GroupedQueryAttention, LatentAttention, SharedKeyAttention))
        variant.__init__(self, d_model, num_heads, size, head_dim=head_dim, dropout=dropout, bias=bias,
                         output_projection=output_projection)
        self.scale = self.scale if logit_scale is None else logit_scale
        self._init_contract(d_model, is_causal, layer_idx, output_dropout, residual_norm_eps)


class GroupedSelfAttention(_VariantSelfAttention, GroupedQueryAttention):
    """Grouped-query heads (``size`` = kv_heads key/value heads; one is multi-query attention). Caches ``(batch,
    kv_heads, tokens, head_dim)`` keys and values."""


class LatentSelfAttention(_VariantSelfAttention, LatentAttention):
    """Multi-head latent attention without rotary positions (``size`` = the latent width). Caches one latent per
    token (``(batch, 1, tokens, latent_size)``, and an empty values tensor that keeps the position count)."""


class SharedKeySelfAttention(_VariantSelfAttention, SharedKeyAttention):
    """Thin keys (``size`` = the shared key's width): caches ``(batch, 1, tokens, size)`` keys and ``(batch, heads,
    tokens, head_dim)`` values."""
