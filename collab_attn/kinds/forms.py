"""What an attention layer computes, read back from its own weights: per head, the bilinear form of its logits and
the linear map from its inputs to the model's output.

Head ``h`` of any layer scores ``x^T T_h y + c_h^T y`` (the logit scale included; terms that depend on the query
alone are left out, they never change a softmax row) and adds ``P_h Y V_h`` to the output (``V_h``: d_in x d_out).
``T_h = A_h^T B_h`` and ``V_h = C_h^T D_h`` come as factors (``HeadForms``) of the original module or of any
converted layer (collaborative, concatenated, shared-key, latent, grouped-query), so that two layers are compared
exactly without forming the d_in x d_in matrices: ``conversion`` measures every converted layer this way and checks
the result against the error its planner claims, and the tests compare each head with the fit it came from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Factor:
    """One side of every head's product, as rows: head ``h``'s rows are ``mix_h^T base_h``.

    ``base``: (1 or heads, p, d) rows shared by every head or per head; ``mix``: None (the base rows themselves),
    (heads, p) per-head row scales (a CP mixing vector) or (heads, p, r) per-head matrices (a Tucker mixing)."""

    base: torch.Tensor
    mix: torch.Tensor | None = None

    def __post_init__(self):
        self.base = self.base.detach().double()
        self.mix = None if self.mix is None else self.mix.detach().double().to(self.base.device)

    @property
    def heads(self) -> int:
        return self.base.shape[0] if self.mix is None else self.mix.shape[0]

    def to(self, device: torch.device) -> Factor:
        return Factor(self.base.to(device), None if self.mix is None else self.mix.to(device))

    def select(self, heads: list[int]) -> Factor:
        base = self.base if self.base.shape[0] == 1 else self.base[heads]
        return Factor(base, None if self.mix is None else self.mix[heads])

    def rows(self) -> torch.Tensor:
        """Every head's rows, (heads, r, d)."""
        if self.mix is None:
            return self.base.expand(self.heads, *self.base.shape[1:])
        if self.mix.dim() == 2:
            return self.mix[:, :, None] * self.base
        return self.mix.transpose(1, 2) @ self.base


def gram(a: Factor, b: Factor) -> torch.Tensor:
    """``rows_h(a) rows_h(b)^T`` for every head, (heads, r_a, r_b), from one product of the bases."""
    products = a.base @ b.base.transpose(-1, -2)  # (1 or heads, p_a, p_b)
    for side, factor in ((0, a), (1, b)):
        if factor.mix is None:
            continue
        if factor.mix.dim() == 2:
            products = products * (factor.mix[:, :, None] if side == 0 else factor.mix[:, None, :])
        else:
            products = (factor.mix.transpose(1, 2) @ products if side == 0 else products @ factor.mix)
    return products.expand(max(a.heads, b.heads), *products.shape[1:])


@dataclass
class HeadForms:
    """Per-head products ``T_h = rows_h(left)^T rows_h(right)``: (d_in, d_out) each, never formed unless asked."""

    left: Factor
    right: Factor

    @property
    def heads(self) -> int:
        return max(self.left.heads, self.right.heads)

    @property
    def device(self) -> torch.device:
        return self.left.base.device

    def to(self, device: torch.device) -> HeadForms:
        return HeadForms(self.left.to(device), self.right.to(device))

    def select(self, heads: list[int]) -> HeadForms:
        return HeadForms(self.left.select(heads), self.right.select(heads))

    def head_inner(self, other: HeadForms) -> torch.Tensor:
        """``<T_h, T'_h>`` per head, (heads,)."""
        return (gram(self.left, other.left) * gram(self.right, other.right)).sum((1, 2))

    def head_norms_sq(self) -> torch.Tensor:
        return self.head_inner(self)

    def head_distances_sq(self, other: HeadForms) -> torch.Tensor:
        """``||T_h - T'_h||_F^2`` per head (float64; exact to about 1e-16 of the norms squared)."""
        return (self.head_norms_sq() + other.head_norms_sq() - 2 * self.head_inner(other)).clamp_min(0)

    def dense(self) -> torch.Tensor:
        """Every head's product, (heads, d_in, d_out): for tests and small layers."""
        return self.left.rows().transpose(1, 2) @ self.right.rows()


@dataclass
class BandForms:
    """The logit forms of a rotary layer: per frequency band, every head's complex form ``M_hi`` (d_in x d_in; a bias
    is one more input column), each held as the real ``HeadForms`` of ``[Re M_hi | Im M_hi]`` (``complex_forms``):
    the same Frobenius norms, so errors sum over the bands."""

    bands: list[HeadForms]

    @property
    def heads(self) -> int:
        return self.bands[0].heads

    @property
    def device(self) -> torch.device:
        return self.bands[0].device

    def to(self, device: torch.device) -> BandForms:
        return BandForms([band.to(device) for band in self.bands])

    def select(self, heads: list[int]) -> BandForms:
        return BandForms([band.select(heads) for band in self.bands])

    def head_inner(self, other: BandForms) -> torch.Tensor:
        return sum(mine.head_inner(theirs) for mine, theirs in zip(self.bands, other.bands, strict=True))

    def head_norms_sq(self) -> torch.Tensor:
        return self.head_inner(self)

    def head_distances_sq(self, other: BandForms) -> torch.Tensor:
        return (self.head_norms_sq() + other.head_norms_sq() - 2 * self.head_inner(other)).clamp_min(0)


def complex_forms(left: torch.Tensor, right: torch.Tensor) -> HeadForms:
    """``M_h = sum_p left_hp conj(right_hp)^T`` from complex rows (heads or 1, p, d), as the real forms of
    ``[Re M_h | Im M_h] = sum_p Re(l) [Re(r), -Im(r)] + Im(l) [Im(r), Re(r)]``."""
    left, right = left.detach().to(torch.complex128), right.detach().to(torch.complex128)
    rows = torch.cat([left.real, left.imag], dim=1)
    columns = torch.cat([torch.cat([right.real, -right.imag], -1), torch.cat([right.imag, right.real], -1)], dim=1)
    return HeadForms(Factor(rows), Factor(columns))


def band_forms_of(a: torch.Tensor, b: torch.Tensor, scale: float) -> BandForms:
    """An original rotary layer's forms from its per-band complex query and key vectors (bands, heads, d)."""
    return BandForms([complex_forms(a_band[:, None] * scale, b_band[:, None]) for a_band, b_band in zip(a, b)])


def relative_error(approximation: HeadForms, reference: HeadForms, kept: list[int] | None = None) -> float:
    """``||T~ - T||_F / ||T||_F`` over the stacked heads, the measure the decompositions report. ``kept``: the heads of
    ``reference`` that ``approximation`` holds, in order (pruning); the others count as removed (zero). Measured
    on ``reference``'s device (a model converted on the GPU against forms read before it moved)."""
    approximation = approximation.to(reference.device)
    total = reference.head_norms_sq().sum()
    if kept is not None:
        removed = total - reference.select(kept).head_norms_sq().sum()
        reference = reference.select(kept)
    else:
        removed = 0.0
    distance = approximation.head_distances_sq(reference).sum() + removed
    return float((distance.clamp_min(0) / total.clamp_min(1e-300)).sqrt())


def head_relative_errors(approximation: HeadForms, reference: HeadForms) -> torch.Tensor:
    """``||T~_h - T_h||_F / ||T_h||_F`` for every head, (heads,)."""
    approximation = approximation.to(reference.device)
    return (approximation.head_distances_sq(reference) / reference.head_norms_sq().clamp_min(1e-300)).sqrt()


def per_head(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """An (heads x width, d) weight as (heads, width, d)."""
    return weight.reshape(heads, -1, weight.shape[-1])


def grouped(weight: torch.Tensor, groups: int, heads: int) -> torch.Tensor:
    """(groups x width, d) -> (heads, width, d): query head h reads group h // (heads / groups)."""
    return per_head(weight, groups).repeat_interleave(heads // groups, dim=0)


def query_key_forms(layer: nn.Module) -> HeadForms | BandForms:
    """Head h's logit form ``scale Wq_h^T Wk_h`` of a converted layer, read from its own weights by the reader its
    kind names (``ConvertedSelfAttention.query_key_reader``: the ``*_forms`` function of its kind's package)."""
    reader = getattr(layer, "query_key_reader", None)
    if reader is None:
        raise TypeError(f"no logit form known for {type(layer).__name__}")
    return reader(layer)


def own_queries(layer: nn.Module) -> Factor:
    """Every head's own query rows, the logit scale included."""
    return Factor(per_head(layer.query.weight, layer.num_heads) * layer.scale)


def value_forms(layer: nn.Module, output_weight: torch.Tensor | None = None) -> HeadForms:
    """Head h's map to the model's output ``Wv_h^T Wo_h^T`` of a converted layer, read from its own weights (its
    value rows by the reader its kind names, ``ConvertedSelfAttention.value_reader``); ``output_weight``: the
    (d_out, width) weight of the output projection where it lives outside the layer (BERT, RoBERTa)."""
    output = layer.output.weight if layer.output is not None else output_weight
    if output is None:
        raise ValueError(f"{type(layer).__name__} has no output projection inside: pass output_weight")
    if getattr(layer, "value_mixing", None) is not None:  # shared values: (V N_h B^T), one value for all heads
        mixing = layer.value_mixing if getattr(layer, "value_core", None) is None else layer.value_mixing_matrices()
        return HeadForms(Factor(layer.value.weight[None], mixing), Factor(output.T[None]))
    reader = getattr(layer, "value_reader", None)
    if reader is None:
        raise TypeError(f"no value map known for {type(layer).__name__}")
    return HeadForms(reader(layer), Factor(per_head(output.T, layer.num_heads)))


def head_values(layer: nn.Module) -> Factor:
    """Every head's own value rows."""
    return Factor(per_head(layer.value.weight, layer.num_heads))


def grouped_values(layer: nn.Module) -> Factor:
    """Each head reads its key/value group's value rows."""
    return Factor(grouped(layer.value.weight, layer.kv_heads, layer.num_heads))


def content_vectors(layer: nn.Module) -> torch.Tensor:
    """Head h's logit term ``c_h^T y`` that does not depend on the query, (heads, d_in), scale included: a content
    bias, or what a query bias makes of the keys (zeros where there is neither)."""
    heads = layer.num_heads
    content = getattr(layer, "content_bias", None)
    if content is not None:
        return content.weight.detach().double() * layer.scale
    bias = layer.query.bias
    d_in = layer.query.weight.shape[1]
    if bias is None:
        return torch.zeros(heads, d_in, dtype=torch.float64)
    keys = query_key_forms(layer).right.rows()  # (heads, width, d_in)
    return torch.einsum("hw,hwi->hi", bias.detach().double().reshape(heads, -1), keys) * layer.scale


def original_forms(w_query, w_key, scale: float) -> HeadForms:
    """The logit forms of an original layer from its (heads, head_dim, d_in) query and key weights."""
    return HeadForms(Factor(w_query * scale), Factor(w_key))


def original_value_forms(w_value, w_output) -> HeadForms:
    """The value maps of an original layer from (heads, head_dim, d_in) values and (heads, head_dim, d_out) output
    columns."""
    return HeadForms(Factor(w_value), Factor(w_output))


def linear_weights(module: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear map's weight and bias (None without one), detached, float64, on the CPU: what the standard forms for
    export read (``collab_attn.serving.standard``)."""
    weight = module.weight.detach().cpu().double()
    return weight, None if module.bias is None else module.bias.detach().cpu().double()
