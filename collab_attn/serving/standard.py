"""A converted rotary layer in the standard form: multi-query attention with one key/value head of head size R.

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

Everything here is read from the layer by its own computation (``head_queries`` on the query weights), not
re-derived, so the form is exact to float64 rounding.

Free scales (``balance_scales``): a real factor per pair between key and queries, and per value dimension between
value and output, changes nothing in exact arithmetic. They decide what a half-precision cache rounds: each cached
coordinate is scaled to the same root mean square on calibration inputs, so no coordinate sits near float16's
smallest normal numbers or its largest.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

EXPORTABLE_KINDS = ("rotary-shared-key", "rotary-collaborative")


@dataclass
class StandardLayer:
    """One layer in the standard form (module doc), float64: ``query`` (H, R, d), ``query_bias`` (H, R) or None,
    ``key`` (R, d), ``key_bias`` (R,) or None, ``value`` (R, d), ``value_bias`` (R,) or None, ``output`` (d, H R),
    ``output_bias`` (d,) or None, ``bands`` (R/2,) the band each pair rotates with."""

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
        return self.key.shape[0]

    @property
    def heads(self) -> int:
        return self.query.shape[0]

    def scaled(self, key_scale: torch.Tensor, value_scale: torch.Tensor) -> StandardLayer:
        """The same layer with pair ``r`` of the key times ``key_scale[r]`` (both of its numbers) and the queries'
        pair ``r`` divided by it; value dimension ``v`` times ``value_scale[v]`` and the output's column ``v`` of
        every head divided by it. Exact in exact arithmetic (module doc)."""
        k = torch.cat([key_scale, key_scale]).to(self.key.dtype)
        v = value_scale.to(self.value.dtype)

        def times(tensor, factor):
            return None if tensor is None else tensor * factor

        output = (self.output.view(self.output.shape[0], self.heads, -1) / v).flatten(1)
        return StandardLayer(self.query / k[:, None], times(self.query_bias, 1 / k), self.key * k[:, None],
                             times(self.key_bias, k), self.value * v[:, None], times(self.value_bias, v), output,
                             self.output_bias, self.bands)


def _linear(module: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = module.weight.detach().cpu().double()
    return weight, None if module.bias is None else module.bias.detach().cpu().double()


def _shared_key_queries(layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight, bias = _linear(layer.query)
    heads, width = layer.num_heads, layer.rank
    return weight.view(heads, width, -1), None if bias is None else bias.view(heads, width)


def _collaborative_queries(layer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Head ``h``'s query weight ``M_h W_q``: the layer's own head mixing (``head_queries``, linear in what it mixes)
    applied to the shared query's weight columns as if they were rotated queries."""
    weight, bias = _linear(layer.query)
    twin = copy.deepcopy(layer).to(device="cpu", dtype=torch.float64)  # the layer itself stays as it is
    with torch.no_grad():
        mixed = twin.head_queries(weight.cpu().T[None])[0]  # (H, d, R)
        mixed_bias = None if bias is None else twin.head_queries(bias.cpu()[None, None])[0, :, 0]  # (H, R)
    return mixed.transpose(1, 2), mixed_bias


def _shared_key_outputs(layer) -> torch.Tensor:
    """``[W_o,h U_g(h)]`` over the heads: (d, H R)."""
    out, _ = _linear(layer.output)
    up = layer.value_up.weight.detach().cpu().double().view(layer.kv_heads, layer.head_dim, -1)
    up = up.repeat_interleave(layer.num_heads // layer.kv_heads, dim=0)  # (H, head_dim, R)
    blocks = out.view(out.shape[0], layer.num_heads, layer.head_dim)
    return torch.einsum("dhk,hkr->dhr", blocks, up).flatten(1)


def _collaborative_outputs(layer) -> torch.Tensor:
    """``[W_o N_h^T]`` over the heads (``N_h = diag(n_h)`` for CP, the head's Tucker matrix otherwise): (d, H R)."""
    out, _ = _linear(layer.output)
    if layer.value_core is not None:
        mixing = torch.einsum("hg,gvw->hvw", *(p.detach().cpu().double() for p in (layer.value_mixing,
                                                                                   layer.value_core)))
    else:
        mixing = torch.diag_embed(layer.value_mixing.detach().cpu().double())  # (H, R, R)
    return torch.einsum("dw,hvw->dhv", out, mixing).flatten(1)


def refusal(layer, index: int) -> str | None:
    """Why layer ``index`` has no standard form, or None when it has one."""
    kind = getattr(layer, "kind", None)
    if kind not in EXPORTABLE_KINDS:
        return (f"layer {index} is {kind or type(layer).__name__!r}: only key-svd, cp and tucker conversions of a "
                "rotary model are multi-query attention in disguise (kinds " + ", ".join(EXPORTABLE_KINDS) + ")")
    if layer.value_rank != layer.rank:
        width = "per-head values" if layer.value_rank is None else f"value_rank {layer.value_rank}"
        return (f"layer {index} has {width} beside a shared key of {layer.rank}: a standard layer's values have its "
                f"keys' width; convert with value_rank equal to rank ({layer.rank})")
    if getattr(layer, "output", None) is None:
        return f"layer {index} has no output projection of its own to absorb the values' up-projection"
    return None


def standard_layer(layer) -> StandardLayer:
    """The standard form (module doc) of a converted layer that has one (``refusal`` is None)."""
    collaborative = layer.kind == "rotary-collaborative"
    query, query_bias = (_collaborative_queries if collaborative else _shared_key_queries)(layer)
    factor = layer.scale * math.sqrt(layer.rank)  # standard attention divides by sqrt(R); the layer multiplies by scale
    key, key_bias = _linear(layer.key)
    value, value_bias = _linear(layer.value)
    output = (_collaborative_outputs if collaborative else _shared_key_outputs)(layer)
    output_bias = None if layer.output.bias is None else layer.output.bias.detach().cpu().double()
    return StandardLayer(query * factor, None if query_bias is None else query_bias * factor, key, key_bias, value,
                         value_bias, output, output_bias, layer.pair_bands.detach().cpu().clone())


def cached_scales(layer: StandardLayer, inputs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair and per value dimension, the factor that gives each cached coordinate a root mean square of 1 over
    ``inputs`` (N, d), the layer's inputs on calibration text (None: unit inputs, by the weights' row norms)."""
    def rms(weight, bias):
        if inputs is None:
            spread = weight.norm(dim=1)
        else:
            spread = (inputs.double() @ weight.T + (0 if bias is None else bias)).square().mean(0).sqrt()
        return spread.clamp_min(1e-30)

    key = rms(layer.key, layer.key_bias)
    pairs = layer.head_dim // 2
    key_pairs = ((key[:pairs].square() + key[pairs:].square()) / 2).sqrt()
    return 1 / key_pairs, 1 / rms(layer.value, layer.value_bias)


def balance_scales(layer: StandardLayer, inputs: torch.Tensor | None = None) -> StandardLayer:
    """``layer`` with its free scales chosen so that every cached coordinate has a root mean square of 1 on ``inputs``
    (``cached_scales``): exact in float32, and what a float16 or bfloat16 cache rounds is relative to each
    coordinate's own size."""
    return layer.scaled(*cached_scales(layer, inputs))
