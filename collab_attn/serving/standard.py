"""A converted rotary layer in the standard form: grouped-query attention, with one key/value head of head size R
where the conversion shares one key.

A ``rotary-shared-key`` layer (``key-svd``) or a ``rotary-collaborative`` one (``cp``, ``tucker``) whose shared value
has the key's width R (``value_rank == rank``) computes, for head ``h``,

    out = sum_h  O_h  softmax_s( scale * <M_h q(x_t), k(y_s)> (rotated) )  v(y_s)

with one shared rotated key ``k`` (R numbers: R/2 pairs, ``[real parts ; imaginary parts]``), one shared value ``v``
(R numbers), a query of R numbers per head (``M_h q``: the shared query times the head's complex mixing, or the
head's own query for ``key-svd``) and a per-head output map ``O_h`` (d x R). That is a standard rotary attention
layer with ``num_key_value_heads = 1`` and ``head_dim = R``:

- ``q_proj``: head ``h``'s query rows, times ``scale * sqrt(R)``: the standard ``1/sqrt(R)`` then gives ``scale``;
- ``k_proj``: the shared key; ``v_proj``: the shared value;
- ``o_proj``: ``[O_1 ... O_H]`` (``key-svd``: each head's output block times its group's ``value_up``; ``cp`` and
  ``tucker``: the output projection times each head's value mixing);
- dimension ``i`` and ``i + R/2`` form pair ``i`` (transformers' ``rotate_half`` layout, the layer's own), rotating
  at its band's frequency (``collab_attn.serving.rope``).

A ``rotary-gqa`` layer (``merge-kv``, ``drop-kv``) is grouped-query attention already: G key/value heads of the
source's head size, query head ``h`` reading group ``h // (H / G)``, pair ``i`` at band ``i``; its projections are
the standard ones as they are.

Each kind reads its own queries, output map, shape and bands (its class's ``standard_form``, in
``collab_attn/kinds/<kind>/<kind>_export.py``; the collaborative one by the layer's own ``head_queries``), not
re-derived, so the form is exact to float64 rounding.

Free scales (``balance_scales``): a real factor per pair between key and queries, and per value dimension between
value and output, changes nothing in exact arithmetic. They decide what a half-precision cache rounds: each cached
coordinate is scaled to the same root mean square on calibration inputs, so no coordinate sits near float16's
smallest normal numbers or its largest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from collab_attn.kinds import LAYER_KINDS
from collab_attn.kinds.forms import linear_weights


@dataclass
class StandardLayer:
    """One layer in the standard form (module doc), float64, with H query heads and G key/value heads of size R:
    ``query`` (H, R, d), ``query_bias`` (H, R) or None, ``key`` (G R, d), ``key_bias`` (G R,) or None, ``value``
    (G R, d), ``value_bias`` (G R,) or None, ``output`` (d, H R), ``output_bias`` (d,) or None, ``bands`` (R/2,) the
    band each pair rotates with."""

    query: torch.Tensor
    query_bias: torch.Tensor | None
    key: torch.Tensor
    key_bias: torch.Tensor | None
    value: torch.Tensor
    value_bias: torch.Tensor | None
    output: torch.Tensor
    output_bias: torch.Tensor | None
    bands: torch.Tensor

    @property
    def head_dim(self) -> int:
        return self.query.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.key.shape[0] // self.head_dim

    @property
    def heads(self) -> int:
        return self.query.shape[0]

    def scaled(self, key_scale: torch.Tensor, value_scale: torch.Tensor) -> StandardLayer:
        """The same layer with pair ``r`` of key head ``g`` times ``key_scale[g, r]`` (both of its numbers) and the
        pair ``r`` of the queries that read ``g`` divided by it; value dimension ``v`` of head ``g`` times
        ``value_scale[g, v]`` and the output's column ``v`` of the heads that read ``g`` divided by it (both (G, R/2)
        and (G, R)). Exact in exact arithmetic (module doc)."""
        k = torch.cat([key_scale, key_scale], dim=-1).to(self.key.dtype)  # (G, R)
        v = value_scale.to(self.value.dtype)
        group = self.heads // self.kv_heads
        k_heads, v_heads = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # (H, R)

        def times(tensor, factor):
            return None if tensor is None else tensor * factor

        output = (self.output.view(self.output.shape[0], self.heads, -1) / v_heads).flatten(1)
        return StandardLayer(self.query / k_heads[..., None], times(self.query_bias, 1 / k_heads),
                             self.key * k.flatten()[:, None], times(self.key_bias, k.flatten()),
                             self.value * v.flatten()[:, None], times(self.value_bias, v.flatten()), output,
                             self.output_bias, self.bands)


def exportable_kinds() -> tuple[str, ...]:
    """The layer kinds that have a standard form: those whose class gives its ``standard_form``
    (``collab_attn.kinds``)."""
    return tuple(kind for kind, cls in LAYER_KINDS.items() if cls.standard_form is not None)


def refusal(layer, index: int) -> str | None:
    """Why layer ``index`` has no standard form, or None when it has one."""
    kind = getattr(layer, "kind", None)
    if getattr(layer, "standard_form", None) is None:
        return (f"layer {index} is {kind or type(layer).__name__!r}: only key-svd, cp and tucker conversions of a "
                "rotary model (multi-query attention in disguise) and merge-kv and drop-kv ones (grouped-query "
                "attention) have a standard form (kinds " + ", ".join(exportable_kinds()) + ")")
    if layer.cuts_values and layer.value_rank != layer.rank:
        width = "per-head values" if layer.value_rank is None else f"value_rank {layer.value_rank}"
        return (f"layer {index} has {width} beside a shared key of {layer.rank}: a standard layer's values have its "
                f"keys' width; convert with value_rank equal to rank ({layer.rank})")
    if getattr(layer, "output", None) is None:
        return f"layer {index} has no output projection of its own to absorb the values' up-projection"
    return None


def standard_layer(layer) -> StandardLayer:
    """The standard form (module doc) of a converted layer that has one (``refusal`` is None)."""
    form = layer.standard_form  # the kind's own reading (collab_attn.kinds.<kind>)
    query, query_bias = form.queries(layer)
    factor = layer.scale * math.sqrt(query.shape[1])  # standard attention divides by sqrt(R); the layer: times scale
    key, key_bias = linear_weights(layer.key)
    value, value_bias = linear_weights(layer.value)
    output = form.outputs(layer)
    output_bias = None if layer.output.bias is None else layer.output.bias.detach().cpu().double()
    return StandardLayer(query * factor, None if query_bias is None else query_bias * factor, key, key_bias, value,
                         value_bias, output, output_bias, form.bands(layer).detach().cpu().clone())


def cached_scales(layer: StandardLayer, inputs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key/value head, per pair and per value dimension ((G, R/2) and (G, R)), the factor that gives each cached
    coordinate a root mean square of 1 over ``inputs`` (N, d), the layer's inputs on calibration text (None: unit
    inputs, by the weights' row norms)."""
    def rms(weight, bias):
        if inputs is None:
            spread = weight.norm(dim=1)
        else:
            spread = (inputs.double() @ weight.T + (0 if bias is None else bias)).square().mean(0).sqrt()
        return spread.clamp_min(1e-30)

    key = rms(layer.key, layer.key_bias).view(layer.kv_heads, 2, layer.head_dim // 2)  # [real parts ; imaginary]
    key_pairs = (key.square().mean(1)).sqrt()
    return 1 / key_pairs, 1 / rms(layer.value, layer.value_bias).view(layer.kv_heads, layer.head_dim)


def balance_scales(layer: StandardLayer, inputs: torch.Tensor | None = None) -> StandardLayer:
    """``layer`` with its free scales chosen so that every cached coordinate has a root mean square of 1 on ``inputs``
    (``cached_scales``): exact in float32, and what a float16 or bfloat16 cache rounds is relative to each
    coordinate's own size."""
    return layer.scaled(*cached_scales(layer, inputs))
