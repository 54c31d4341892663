"""Sizes of every conversion method at a budget of key/value-cache bytes or of attention parameters, read from the
converted layers themselves (built on the meta device), not by hand.

``conversion_sizes(config, method)`` lists every ``rank`` a method's rank rule allows for a model of ``config`` (any
supported family), with an equal ``value_rank`` where the method cuts the values too, and the costs of the converted
model: the bytes per token its key/value cache would hold as a decoder (bf16, all layers:
``collab_attn.nn.cache_numbers_per_token`` of each converted layer) and its attention parameters (the
converted self-attention layers and, where the family keeps it beside them, the output projection).
``conversion_at`` picks the largest one within a fraction of the original's cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import transformers

from collab_attn.models.hf import LAYER_KINDS, AttentionSite, attention_sites, build_layer
from collab_attn.models.methods.base import LayerSizes
from collab_attn.nn.attention import cache_numbers_per_token

COSTS = ("cache_bytes", "attention_params")
DTYPE_BYTES = 2  # the cache is counted in bf16


@dataclass(frozen=True)
class ConversionSize:
    """A conversion at one size: the method's ``rank``, its ``value_rank`` (None: the heads keep their values), and
    the converted model's cache bytes per token and attention parameters."""

    rank: int
    value_rank: int | None
    cache_bytes: int
    attention_params: int


@dataclass(frozen=True)
class _Skeleton:
    """A model of ``config`` on the meta device: its first attention site and its number of layers."""

    site: AttentionSite
    layers: int

    @classmethod
    def of(cls, config) -> _Skeleton:
        with torch.device("meta"):
            model = transformers.AutoModel.from_config(config)
        _, sites = attention_sites(model)
        return cls(sites[0], len(sites))

    def outer_output(self, width: int | None = None) -> int:
        """Parameters of the output projection beside the attention module (BERT, RoBERTa; 0 elsewhere), reading
        ``width`` inputs (None: the original's)."""
        if self.site.output_inside:
            return 0
        projection = self.site.output
        bias = 0 if projection.bias is None else projection.out_features
        return projection.out_features * (width or projection.in_features) + bias


def _meta_layer(site: AttentionSite, spec):
    """The converted layer ``spec`` shapes for ``site``, on the meta device: its sizes without its weights' cost."""
    with torch.device("meta"):
        return build_layer(site, spec)


def converted_layout(config, method, sizes: LayerSizes, skeleton: _Skeleton | None = None):
    """The layout of ``config``'s model converted by ``method`` at ``sizes``, as the method lays itself out
    (``ConversionMethod.layout_at``; None where it cannot take them)."""
    skeleton = skeleton or _Skeleton.of(config)
    return method.layout_at(skeleton.site, skeleton.layers, sizes)


def original_size(config, skeleton: _Skeleton | None = None) -> ConversionSize:
    """The original model's costs (``rank``: heads x head_dim; the cache holds kv_heads x head_dim keys and
    values, fewer than heads x head_dim where they are grouped)."""
    skeleton = skeleton or _Skeleton.of(config)
    width = skeleton.site.width
    cached = 2 * skeleton.site.kv_heads * skeleton.site.head_dim
    params = sum(p.numel() for p in skeleton.site.module.parameters()) + skeleton.outer_output()
    return ConversionSize(width, None, skeleton.layers * cached * DTYPE_BYTES, skeleton.layers * params)


def caches_less(config, method, ranks: Sequence[int], value_ranks: Sequence[int | None]) -> bool:
    """Whether ``config``'s model converted by ``method`` at these ranks per layer caches fewer bytes per token than
    the original (False where the method cannot take them)."""
    skeleton = _Skeleton.of(config)
    converted = cache_bytes_at(config, method, ranks, value_ranks, skeleton)
    return converted is not None and converted < original_size(config, skeleton).cache_bytes


def cache_bytes_at(config, method, ranks: Sequence[int], value_ranks: Sequence[int | None],
                   skeleton: _Skeleton | None = None) -> int | None:
    """The cache bytes per token of ``config``'s model converted by ``method`` at one rank and value rank per layer
    (None where the method cannot take them)."""
    skeleton = skeleton or _Skeleton.of(config)
    layouts, total = {}, 0
    for layer, sizes in enumerate(zip(ranks, value_ranks)):
        if sizes not in layouts:
            layouts[sizes] = converted_layout(config, method, LayerSizes(*sizes), skeleton)
        if layouts[sizes] is None:
            return None
        total += cache_numbers_per_token(_meta_layer(skeleton.site, layouts[sizes].specs(skeleton.site.heads)[layer]))
    return DTYPE_BYTES * total


def conversion_sizes(config, method, **fixed) -> list[ConversionSize]:
    """Every size a conversion method (``collab_attn.models.methods``) takes for a model of ``config``: each rank its
    rank rule allows, with an equal value rank where the method cuts the values too. ``fixed``: the other sizes
    (``LayerSizes``), the same at every rank: ``rope_pairs=r``, the rotary pairs a partial-RoPE conversion (``kv-svd``
    of a rotary model) keeps per key/value group (unset: its default; its cache holds ``2 rope_pairs kv_heads +
    rank`` per token)."""
    skeleton = _Skeleton.of(config)
    site = skeleton.site
    per_spec = {}  # one converted layer per distinct shape: (cache numbers per token, attention parameters)
    found = []
    for rank in range(1, site.width + 1):
        if method.check_ranks is not None:
            try:
                method.check_ranks([rank], site.heads)
            except ValueError:
                continue
        sizes = LayerSizes(rank, rank if method.cuts_values else None, **fixed)
        layout = converted_layout(config, method, sizes, skeleton)
        if layout is None:  # a size the method cannot take (a latent too wide, not whole key/value groups, ...)
            continue
        specs = layout.specs(site.heads)
        for spec in set(specs) - set(per_spec):
            layer = _meta_layer(site, spec)
            replaced = LAYER_KINDS[spec.kind].replaces_outer_output(site, spec)
            outer = skeleton.outer_output(layer.value.out_features if replaced else None)
            per_spec[spec] = (cache_numbers_per_token(layer), sum(p.numel() for p in layer.parameters()) + outer)
        found.append(ConversionSize(rank, sizes.value_rank, DTYPE_BYTES * sum(per_spec[s][0] for s in specs),
                                    sum(per_spec[s][1] for s in specs)))
    return found


def conversion_at(sizes: Sequence[ConversionSize], original: ConversionSize, fraction: float,
                  cost: str = "cache_bytes") -> ConversionSize | None:
    """Of a method's ``sizes``, the one with the largest ``cost`` (``COSTS``) within ``fraction`` of the original's
    (the largest rank among equals: pruning's rank only sets how many heads fit), or None when none fits (key-only
    methods keep every value: never below half the cache; pruning keeps a head per layer)."""
    if cost not in COSTS:
        raise ValueError(f"unknown cost {cost!r}; choose one of {COSTS}")
    fitting = [s for s in sizes if getattr(s, cost) <= fraction * getattr(original, cost)]
    return max(fitting, key=lambda s: (getattr(s, cost), s.rank)) if fitting else None
