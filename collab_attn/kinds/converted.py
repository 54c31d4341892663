"""What every converted layer shares: attention modules behind the call contract of a transformers 5.x
self-attention module.

A layer kind is one class, registered by name in ``LAYER_KINDS`` when its package under ``collab_attn/kinds/`` is
imported: collaborative (``CollaborativeSelfAttention``:
``cp``, ``tucker``), concatenated heads (``ConcatenatedSelfAttention``: ``svd``; ``KeptHeadsSelfAttention``:
``prune``) or one of the variants (``SharedKeySelfAttention``: ``key-svd``; ``LatentSelfAttention``: ``kv-svd``
and, with ``GroupedSelfAttention``, models trained from scratch). Each builds itself for one attention site from a
``LayerSpec`` (``build``) and says whether it needs a new output projection where the model keeps it beside the
attention module (``replaces_outer_output``). What a conversion must give it is its own ``state_dict``: a planner
hands over the tensors by those names (``collab_attn.models.plan``), loaded strictly. All take
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

import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    EncoderDecoderCache,
    StaticLayer,
    StaticSlidingWindowLayer,
)
from transformers.utils.output_capturing import _active_collector  # what the output hooks collect into

from collab_attn.kinds.forms import head_values

if TYPE_CHECKING:  # the sites are read above this room (collab_attn.models.families); a layer only reads their fields
    from collab_attn.models.families import AttentionSite


# Every name under which transformers 5.x hands a self-attention module its key/value cache: models pass it as
# ``past_key_values`` up to 5.23 and as ``cache`` from 5.24 on; ``past_key_value`` and ``layer_past`` are older
# spellings that callers may still use. The same object under two names is one cache (``_pop_caches``).
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past")


# Keywords that would change what attention computes and that these layers do not implement: packed sequences
# (flash-attention varlen), head masks, sliding windows, attention sinks, rotary position embeddings (but in rotary
# layers, which take them). Given, they raise. Others pass through untouched because attention has nothing to do with
# them (the model already acted on use_cache, position_ids, cache_position; num_items_in_batch is for the loss).
REFUSED_KEYWORDS = (
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "head_mask", "encoder_attention_mask",
    "sliding_window", "s_aux", "sinks", "position_embeddings",
)


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward takes its key/value cache by: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before (one of ``CACHE_KEYWORDS``)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


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


@dataclass(frozen=True)
class Size:
    """How a converted model's config records one size: its field, and whether once per layer (a list) or once per
    model."""

    config: str
    type: object
    per_layer: bool = True


# Every size a layer kind may take, by its one name (a field of the kind's spec; a key of a plan's and a layout's
# sizes; docs/extending.md has the table), and the config field that records it. A kind with a new size adds it here.
SIZES = {
    "heads": Size("collab_heads", list[int] | None),
    "rank": Size("collab_ranks", list[int] | None),
    "value_rank": Size("collab_value_ranks", list[int] | None),
    "tucker_core_size": Size("collab_tucker_core_size", int | None, per_layer=False),
    "mixing_init": Size("collab_mixing_init", str | None, per_layer=False),
    "rope_pairs": Size("collab_rope_pairs", list[int] | None),
    "bands": Size("collab_bands", list | None),
    "query_rank": Size("collab_query_ranks", list[int] | None),
}


@dataclass(frozen=True)
class LayerSpec:
    """The shape of one converted layer: its ``kind`` (a key of ``LAYER_KINDS``), ``heads`` and ``rank``, the
    query/key width D~ (shared by collaborative heads, heads x query/key head size of concatenated ones, the shared
    key's or the latent's width, kv_heads x head_dim of grouped heads). A kind with more sizes declares them in a
    subclass beside its class (its ``Spec``), each under its one name in ``SIZES``."""

    kind: str
    heads: int
    rank: int

    @classmethod
    def size_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "kind")

    def values_cut(self) -> bool:
        """Whether the layer's values are narrower than its heads' (a ``value_rank``)."""
        return False


@dataclass(frozen=True)
class ValueCutSpec(LayerSpec):
    """A layer whose values may be cut: ``value_rank``, the values' width D_v (one shared value, or heads x narrow
    value heads; None: every head keeps its values)."""

    value_rank: int | None = None

    def values_cut(self) -> bool:
        return self.value_rank is not None


@dataclass(frozen=True)
class StandardForm:
    """How a kind's layer reads as a standard rotary attention layer (``collab_attn.serving.standard``), each a
    function of the layer: ``queries``, each head's query weight (H, R, d) and bias (H, R) or None, before the logit
    scale; ``outputs``, the output map over the heads (d, H R); ``shape``, (query heads, key/value heads, head size
    R); ``bands``, the source band each of the R/2 pairs rotates with."""

    queries: Callable
    outputs: Callable
    shape: Callable
    bands: Callable


def one_shared_key(layer) -> tuple[int, int, int]:
    """``StandardForm.shape`` of a layer with one shared key of width ``rank`` (and a shared value as wide)."""
    return layer.num_heads, 1, layer.rank


def pair_bands_of(layer) -> torch.Tensor:
    """``StandardForm.bands`` of a layer that keeps its pairs' bands in its ``pair_bands`` buffer."""
    return layer.pair_bands


LAYER_KINDS: dict[str, type[ConvertedSelfAttention]] = {}


def module_arguments(site: AttentionSite, **extra) -> dict:
    """The keywords of the attention module (``collab_attn.nn``) that every converted layer takes from the site it
    replaces, and ``extra`` ones (a rotary module's key/value heads and output bias)."""
    return dict(head_dim=site.head_dim, dropout=site.dropout, bias=site.bias, output_projection=site.output_inside,
                logit_scale=site.logit_scale, **extra)


class ConvertedSelfAttention(nn.Module):
    """What every converted layer adds to its attention module (``collab_attn.nn``): the transformers call contract
    (``attach``), and its place in ``LAYER_KINDS`` (a subclass names its kind: ``class X(ConvertedSelfAttention, ...,
    kind="name")``) with its sizes (``Spec``). Built as its attention module is, then attached to a site."""

    kind: ClassVar[str]
    Spec: ClassVar[type[LayerSpec]] = LayerSpec  # its sizes
    collaborative: ClassVar[bool] = False  # shared query/key projections with per-head mixing
    cuts_values: ClassVar[bool] = False  # takes a ``value_rank`` (set from its ``Spec``)
    rotary: ClassVar[bool] = False  # takes the model's rotary ``position_embeddings`` (refused by the others)
    # its plans' relative_error is always the query/key products error, checked against the installed layer even
    # where the method's other plans report another error (kv-svd on rotary models: the per-band forms)
    plans_products_error: ClassVar[bool] = False
    # the buffer holding the rotary bands its pairs rotate with: part of its shape, recorded in the model's config
    # (its spec's ``bands``) so that a model built from the config is this layer, weights aside
    bands_buffer: ClassVar[str | None] = None
    # how its products are read back from its weights (its package's ``<kind>_forms.py``, or the shared readers of
    # ``collab_attn.kinds.forms``): the logit forms of its heads (``layer -> HeadForms | BandForms``) and its heads'
    # value rows (``layer -> Factor``; shared values are read alike for every kind); None: no reader (a kind no
    # conversion builds)
    query_key_reader: ClassVar[Callable | None] = None
    value_reader: ClassVar[Callable | None] = staticmethod(head_values)
    # its standard form for export (``collab_attn.serving.standard``; its package's ``<kind>_export.py``), where
    # its layer is a standard rotary attention layer in disguise; None: no standard form
    standard_form: ClassVar[StandardForm | None] = None

    def __init_subclass__(cls, kind: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if kind is not None:
            if kind in LAYER_KINDS:
                raise ValueError(f"a layer kind named {kind!r} is registered already ({LAYER_KINDS[kind].__name__})")
            unnamed = [name for name in cls.Spec.size_names() if name not in SIZES]
            if unnamed:
                raise ValueError(f"layer kind {kind!r} (its spec): the sizes {unnamed} have no config field; add "
                                 "them to collab_attn.kinds.converted.SIZES")
            cls.kind = kind
            cls.cuts_values = "value_rank" in cls.Spec.size_names()
            LAYER_KINDS[kind] = cls

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # the attention module's own arguments
        self.attach()

    def attach(self, *, is_causal: bool = False, layer_idx: int | None = None, output_dropout: float | None = None,
               residual_norm_eps: float | None = None, sliding_window: int | None = None) -> ConvertedSelfAttention:
        """The call contract of the module it replaces: causal or not, its place in the cache (``layer_idx``),
        GPT-2's dropout after the output projection (``output_dropout``), ALBERT's residual LayerNorm
        (``residual_norm_eps``) and, where the model masks a sliding window, its width (only then may the cache hold
        a sliding-window layer, which drops the positions before the window)."""
        self.is_causal, self.layer_idx, self.sliding_window = is_causal, layer_idx, sliding_window
        self.output_dropout = None if output_dropout is None else nn.Dropout(output_dropout)
        self.LayerNorm = None if residual_norm_eps is None else nn.LayerNorm(self.d_model, eps=residual_norm_eps)
        return self

    def attached(self, site: AttentionSite) -> ConvertedSelfAttention:
        """Attached to ``site`` (``attach``), on its device and in its dtype."""
        return self.attach(is_causal=site.is_causal, layer_idx=site.layer_idx, output_dropout=site.output_dropout,
                           residual_norm_eps=site.residual_norm_eps,
                           sliding_window=site.sliding_window).to(site.weight)

    @classmethod
    def build(cls, site: AttentionSite, spec: LayerSpec) -> ConvertedSelfAttention:
        """An empty layer of this kind shaped by ``spec`` to replace the module at ``site`` (its device and dtype)."""
        raise NotImplementedError

    @classmethod
    def replaces_outer_output(cls, site: AttentionSite, spec: LayerSpec) -> bool:
        """Whether, where the model keeps the output projection beside the attention module, the layer needs a new
        one: it reads another width (fewer heads, cut values) or another bias."""
        return spec.heads != site.heads or spec.values_cut()

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, **kwargs):
        if encoder_hidden_states is not None:
            raise NotImplementedError(
                f"{type(self).__name__} converts self-attention only; cross-attention (encoder_hidden_states) is "
                "not supported"
            )
        caches = _pop_caches(kwargs)
        rotary_positions = kwargs.pop("position_embeddings", None) if self.rotary else None
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
        if attention_mask is not None and not torch.is_tensor(attention_mask):
            raise TypeError(
                f"{type(self).__name__} takes the tensor masks of transformers' eager and sdpa attention, got a "
                f"{type(attention_mask).__name__}: call model.set_attn_implementation('sdpa')"
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
            **({"position_embeddings": rotary_positions} if self.rotary else {}),
        )
        if self.output_dropout is not None:
            output = self.output_dropout(output)
        if self.LayerNorm is not None:
            output = self.LayerNorm(hidden_states + output)
        return output, weights

    def _cache_update(self, cache):
        """The ``kv_cache`` hook of the attention module (append this call's keys and values to ``cache``), and the
        cache's ``StaticLayer`` for this layer when the cache is static (else None).

        A dynamic layer grows with the keys it is given; a dynamic sliding-window layer (a model with
        ``sliding_window``) keeps only the last ``sliding_window - 1`` positions and returns them with the new ones,
        for the mask the model made for that window. A static layer (``StaticCache``, ``generate(...,
        cache_implementation="static")``) preallocates ``max_cache_len`` positions (a sliding one, the window's);
        transformers would shape its values like its keys (one head count for both), so this layer allocates them on
        first use with their own shapes (``_allocate_static``): collaborative heads keep one packed shared key per
        position and per-head values, narrow concatenated heads keys narrower than their values. Every one of these
        layers only moves positions along the sequence axis, so they hold any of the converted layouts. Quantized,
        offloaded and other layer kinds are refused."""
        if isinstance(cache, EncoderDecoderCache):
            cache = cache.self_attention_cache
        if self.layer_idx is None:
            raise ValueError(f"{type(self).__name__} was built without a layer_idx and cannot use a cache")
        layers = getattr(cache, "layers", [])
        layer = layers[self.layer_idx] if self.layer_idx < len(layers) else None
        dynamic = isinstance(cache, DynamicCache) and (
            type(layer) in DYNAMIC_LAYERS if layer is not None else cache.layer_class_to_replicate is DynamicLayer
        )
        if getattr(layer, "is_sliding", False) and self.sliding_window is None:
            raise NotImplementedError(
                f"layer {self.layer_idx} attends to every position, but its cache layer ({type(layer).__name__}) "
                "keeps only a sliding window of them: build the cache from this model's config (DynamicCache("
                "config=model.config), or let generate make it), or use a full DynamicCache or StaticCache"
            )
        if dynamic:
            return (lambda keys, values: cache.update(keys, values, self.layer_idx)), None
        if type(layer) in STATIC_LAYERS:
            def update(keys, values):
                if not layer.is_initialized:
                    _allocate_static(layer, keys, values)
                return cache.update(keys, values, self.layer_idx)

            return update, layer
        raise NotImplementedError(
            f"a {type(cache).__name__} ({type(layer).__name__ if layer is not None else 'no layer'}) cannot hold "
            "collaborative keys: quantized, offloaded and other cache layers keep heads x head_dim per token. Use "
            "a DynamicCache (the default) or a static cache (generate(..., cache_implementation='static'))"
        )


class VariantSelfAttention(ConvertedSelfAttention):
    """A variant (grouped-query, latent or shared-key heads: ``collab_attn.kinds.gqa``, ``.mla``, ``.shared_key``) in a
    transformers model: the variant's module built for ``rank`` (the shared key's or the latent's width; grouped heads:
    kv heads), the original model's logit scale, the call contract."""

    @classmethod
    def _size(cls, site: AttentionSite, spec: LayerSpec) -> int:
        """The variant module's third argument."""
        return spec.rank

    @classmethod
    def build(cls, site: AttentionSite, spec: LayerSpec) -> VariantSelfAttention:
        return cls(site.d_in, spec.heads, cls._size(site, spec), **module_arguments(site)).attached(site)


# The cache layers a converted layer writes into: they move positions along the sequence axis (dim -2) only.
DYNAMIC_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


STATIC_LAYERS = (StaticLayer, StaticSlidingWindowLayer)


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


def kv_heads_of(heads: int, rank: int, head_dim: int) -> int:
    """The key/value heads of grouped-query heads whose key width is ``rank``."""
    if rank < head_dim or rank % head_dim or heads % (rank // head_dim):
        raise ValueError(f"grouped-query heads need a key width kv_heads x head_dim ({head_dim}) with kv_heads "
                         f"dividing {heads} heads, got {rank}")
    return rank // head_dim


def rotary_pairs(spec: LayerSpec, what: str) -> int:
    """The rotary pairs of a width that counts each pair twice (real and imaginary parts)."""
    if spec.rank % 2:
        raise ValueError(f"{what} counts its pairs twice (real and imaginary parts): the rank must be even, got "
                         f"{spec.rank}")
    return spec.rank // 2
